"""acc_trainer: one training loop on Hugging Face Accelerate, from a laptop CPU to several machines.

Importing the package is cheap and never imports torchvision; `acc_trainer.train.train(config)`
runs a training job, `python -m acc_trainer` / `acc-trainer` is the command line.
"""

__version__ = "0.1.0"
