"""After training (named apart from `training/`; `trained/` before, whose imports still resolve): `evaluate` and
`predict` on a trained model or a run folder (inference.py), `export` (exporting.py), `acc-trainer rerun` (reruns.py)
and `acc-trainer consolidate` (consolidating.py).

May import: the base, data, workload, distributed, language, objectives, outputs, training.
"""
