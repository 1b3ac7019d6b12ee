"""What a run writes and shows: checkpoints (checkpoints.py), the run folder and its files (runfiles.py), experiment
trackers (trackers.py), figures (plots.py) and terminal output (progress.py).

May import: the base, data, workload, distributed.
"""
