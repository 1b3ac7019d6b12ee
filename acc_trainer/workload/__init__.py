"""The workload's pieces: the one place names become objects (components.py: a run's model, data, loss and metrics
as a `Workload`), the first-sample check (first_batch.py), built-in models (models.py), losses and forward functions
(losses.py), metrics (metrics.py), optimizers and schedules (optim.py), what a model costs (measure.py: FLOPs,
peak FLOP/s, weight fingerprints, peak memory), and 4-bit bases (quantized.py: --load-in-4bit, through bitsandbytes).

May import: the base, data.
"""
