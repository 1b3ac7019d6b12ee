"""Stopping a run cleanly: preemption signals and runaway losses, decided by all processes together.

Processes of a DDP run are at most one step apart, so if one stopped on its own the others would
wait for it forever. Each step, the processes agree (one tiny all-reduce on the CPU) whether any of
them was asked to stop; a NaN/inf loss is noted on the device without a host sync and checked at
log steps and before every checkpoint, so that no checkpoint is written after it.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist
from accelerate import Accelerator


class TrainingStopped(Exception):
    """The run stopped before its end; `code` is the process exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class StopSignals:
    """Turns the first SIGTERM / SIGINT into a request to stop after the current step.

    A second signal gets the previous handler (so a second Ctrl-C interrupts at once).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, accelerator: Accelerator):
        self.received: int | None = None
        self._previous = {}
        self._world = accelerator.num_processes
        # On GPUs the default group is NCCL; the agreement goes through a CPU (gloo) group so that it
        # never waits for the device.
        self._group = None
        if self._world > 1 and accelerator.device.type != "cpu":
            self._group = dist.new_group(backend="gloo")

    def __enter__(self) -> "StopSignals":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received = signum
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed(self) -> int | None:
        """The signal any process received (the same answer on all), or None."""
        if self._world == 1:
            return self.received
        flag = torch.tensor([self.received or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item()) or None


class NonFinite:
    """The first step whose loss was NaN or inf on this process, tracked on the device."""

    def __init__(self, device: torch.device):
        self.first_step = torch.zeros((), dtype=torch.long, device=device)
        self.in_step = torch.zeros((), dtype=torch.bool, device=device)

    def observe(self, loss: torch.Tensor) -> None:
        self.in_step |= ~torch.isfinite(loss.detach())

    def step_done(self, step: int) -> None:
        self.first_step = torch.where((self.first_step == 0) & self.in_step, step, self.first_step)
        self.in_step.zero_()

    def in_step_anywhere(self, accelerator: Accelerator) -> bool:
        """Whether any process saw a NaN/inf loss in the current step (a host sync: --skip-nonfinite only)."""
        return bool(accelerator.reduce(self.in_step.float(), "sum").item() > 0)

    def first_anywhere(self, accelerator: Accelerator) -> int | None:
        """The earliest step with a NaN/inf loss on any process, or None."""
        steps = [s for s in accelerator.gather(self.first_step[None]).tolist() if s > 0]
        return min(steps) if steps else None


def lost_contact(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another process died, hung or vanished.

    gloo and NCCL report these as RuntimeError (or torch.distributed.DistError) with these words.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    text = str(error)
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError)
        and any(words in text for words in ("Connection closed by peer", "Timed out", "timed out", "Connection reset",
                                            "NCCL", "gloo"))
    )
