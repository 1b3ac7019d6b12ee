"""The tools around training: `acc-trainer bench` (bench.py, with the hand-written loops of baselines.py),
`acc-trainer report` (report.py), `acc-trainer check` (check.py) and their figures (figures.py).

They import the training core; the core never imports them.
"""
