"""The training run: `train()` and `fit()` (api.py), setup (setup.py), the training steps and the recipe that calls
the others (loop.py), the one evaluation path (evaluation.py), the run's progress (state.py) and its end
(summary.py).

May import: the base, data, workload, distributed, language, objectives, outputs.
"""
