"""Processes and engines: the process group and what processes must agree on (processes.py), the engines, one room
each (engines/: DDP, FSDP2, DeepSpeed), `acc-trainer launch` (launching.py), the watchdog that names a hung process
(watchdog.py) and several processes from a notebook (notebook.py).

May import: the base, data, workload.
"""
