"""The tools around training: `acc-trainer bench` (bench.py, with the hand-written loops of baselines.py), `acc-trainer
bench-lm` (lm_bench.py), `acc-trainer report` (report.py), `acc-trainer check` (check.py, with the rows it judges in
check_rows.py, the faults it injects in check_faults.py and the samples it watches in check_samples.py), `acc-trainer
sweep` (sweep.py, with its space file in sweep_space.py and its results in sweep_results.py) and their figures
(figures.py). They measure and draw the training core from outside; the core never imports them.

May import: the base, data, workload, distributed, language, objectives, outputs, training.
"""
