"""Several processes from a notebook: `launch_in_notebook(function, args, num_processes=2)`.

Accelerate's `notebook_launcher` forks the notebook's process, so it refuses once an Accelerator exists in it
("the `Accelerator` should only be initialized inside your training function"): after any `fit()` run in the
notebook itself. It also drops what the function returns. This calls it after checking that forking is safe, and
forgets the state the earlier in-process runs left (Accelerate's singletons hold nothing the new processes need,
and fork would hand them over as they are: each process would take itself for the only one); it returns what the
main process's call returned (fit's summary). Where forking is not safe (CUDA is already in use in this process:
a run here used the GPU), it refuses in one line saying what to do.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from functools import partial, update_wrapper
from pathlib import Path

from .. import patches
from ..config import ConfigError


def launch_in_notebook(function, args: tuple = (), num_processes: int | None = None, **launcher_options):
    """`function(*args)` on `num_processes` processes (Accelerate's notebook_launcher: GPUs, or CPU processes
    without one; its other options pass through), after `fit()` ran in this process or not. Returns what
    `function` returned on the main process (rank 0); on one process, it runs here."""
    if not num_processes or num_processes == 1:
        return function(*args)
    _check_can_fork()
    _forget_earlier_runs()
    from accelerate import notebook_launcher

    with tempfile.TemporaryDirectory(prefix="acc-trainer-notebook-") as folder:
        result = Path(folder) / "main.pkl"
        # named as the function (torch's launcher names its processes' entry point after it)
        keeping = update_wrapper(partial(_keep_result, function, result), function)
        with patches.bitsandbytes_not_refused():  # peft imports it; CUDA was checked above (_check_can_fork)
            notebook_launcher(keeping, args, num_processes=num_processes, **launcher_options)
        if not result.exists():
            raise RuntimeError("the main process ended without returning (its error is printed above)")
        with open(result, "rb") as f:
            return pickle.load(f)


def _keep_result(function, result: Path, *args):
    """In each launched process: the function, and the main process's return value kept for the notebook."""
    value = function(*args)
    if os.environ.get("RANK", "0") == "0":
        with open(result, "wb") as f:
            pickle.dump(value, f)
    return value


def _check_can_fork() -> None:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_initialized():
        raise ConfigError("launch_in_notebook: CUDA is already in use in this notebook's process (a run here used the "
                          "GPU), and the processes the launcher forks cannot use it then: restart the kernel and call "
                          "launch_in_notebook before any run in the notebook itself (train inside the launched function)")
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError("launch_in_notebook: this process is already one of several (launched); call it from the "
                          "notebook's own process")


def _forget_earlier_runs() -> None:
    """Accelerate's process-wide state, as in a new process (a one-process group of an earlier run closed)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    if dist.is_initialized():
        dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
