"""acc_trainer: one training loop on Hugging Face Accelerate, from a laptop CPU to several machines.

    import acc_trainer
    acc_trainer.fit(model, train_data, eval_data, epochs=3, batch_size=256)   # your own model and data
    acc_trainer.train(acc_trainer.TrainConfig(model="lenet"))                 # a workload by name

`python -m acc_trainer` / `acc-trainer` is the command line. Importing the package is cheap: torch,
Accelerate and torchvision are imported when a name below is first used.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "fit": ("acc_trainer.training.api", "fit"),
    "train": ("acc_trainer.training.api", "train"),
    "find_lr": ("acc_trainer.training.api", "find_lr"),  # the learning-rate range test, on a copy of the model
    "check": ("acc_trainer.tools.check", "check"),
    "evaluate": ("acc_trainer.after_training.inference", "evaluate"),  # a trained model on any set, exactly
    "predict": ("acc_trainer.after_training.inference", "predict"),  # one row per sample, in the dataset's order
    "export": ("acc_trainer.after_training.exporting", "export"),  # ONNX, pt2 or safetensors, checked on samples
    "launch_in_notebook": ("acc_trainer.distributed.notebook", "launch_in_notebook"),  # several processes from a notebook
    "TrainConfig": ("acc_trainer.config", "TrainConfig"),
    "ConfigError": ("acc_trainer.config", "ConfigError"),
    "TrainingStopped": ("acc_trainer.stopping", "TrainingStopped"),
    "parse_config": ("acc_trainer.flags", "parse_config"),  # acc-trainer's flags, for a script of your own
    "set_seed": ("accelerate.utils", "set_seed"),  # seeds Python, NumPy and torch on this process
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'acc_trainer' has no attribute {name!r}")
    import importlib

    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(module), attr)
