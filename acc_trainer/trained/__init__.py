"""After training: `evaluate` and `predict` on a trained model or a run folder (inference.py), `export` (exporting.py)
and `acc-trainer rerun` (reruns.py).

May import: the base, data, workload, distributed, language, outputs, training.
"""
