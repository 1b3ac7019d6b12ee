"""Processes and engines: the process group and what processes must agree on (processes.py), FSDP and DeepSpeed
setups (engines.py), `acc-trainer launch` (launching.py), the watchdog that names a hung process (watchdog.py) and
several processes from a notebook (notebook.py).

May import: the base, data, workload.
"""
