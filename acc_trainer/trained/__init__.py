"""The old name of `acc_trainer.after_training` (evaluate, predict, export, rerun, consolidate), kept so that imports
written for it resolve: `acc_trainer.trained.inference` is `acc_trainer.after_training.inference`, the same module
object (imported on first use of this old name).

May import: the base, data, workload, distributed, language, objectives, outputs, training, after_training.
"""

import importlib
import sys

for _name in ("inference", "exporting", "consolidating", "reruns", "prediction_files"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"acc_trainer.after_training.{_name}")
