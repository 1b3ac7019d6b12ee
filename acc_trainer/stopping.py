"""Stopping a run cleanly: preemption signals and runaway losses, decided by all processes together.

Processes of a DDP run are at most one step apart, so if one stopped on its own the others would
wait for it forever. At every log step and epoch end, where the loop reads its losses anyway, the
processes agree (one tiny gather) whether any of them was asked to stop. Losses stay on the device until log steps and checkpoints,
where a NaN/inf is found (and named by its step) before anything is logged or saved.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist
from accelerate import Accelerator


class TrainingStopped(Exception):
    """The run stopped before its end; `code` is the process exit code.

    `alone`: raised by the main process only (its own files could not be written), so no other process
    is stopping with it: the CLI must not wait for them at a barrier; the launcher ends them."""

    def __init__(self, message: str, code: int, alone: bool = False):
        super().__init__(message)
        self.code, self.alone = code, alone


class StopSignals:
    """Turns the first SIGTERM / SIGINT into a request to stop after the current step.

    A second signal gets the previous handler (so a second Ctrl-C interrupts at once).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, accelerator: Accelerator):
        self.received: int | None = None
        self._previous = {}
        self._accelerator = accelerator

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

    def agreed(self, check: bool) -> int | None:
        """The signal any process has received (the same answer on all), or None.

        One process answers at once. Several agree only when `check` is true (the loop passes its
        log steps and epoch ends), so that no other step waits for an extra collective.
        """
        if self._accelerator.num_processes == 1:
            return self.received
        if not check:
            return None
        flags = self._accelerator.gather(torch.tensor([self.received or 0], device=self._accelerator.device))
        return max(flags.tolist()) or None


class IntervalLosses:
    """The micro-batch losses of the current log interval, kept on the device.

    One copy per micro-batch and no host sync: read at log steps and checkpoints, it gives each
    process's mean loss, and the first step whose loss was NaN or inf (from where the interval began).
    """

    def __init__(self, log_every: int, grad_accum: int, device: torch.device):
        self.values = torch.zeros(log_every * grad_accum, device=device)
        self.positions = torch.arange(len(self.values), device=device)
        self.grad_accum, self.count, self.first_step = grad_accum, 0, 1

    def add(self, loss: torch.Tensor) -> None:
        self.values[self.count] = loss.detach()
        self.count += 1

    def restart(self, step: int) -> None:
        """A new interval, whose first step is step + 1."""
        self.count, self.first_step = 0, step + 1

    def read(self, accelerator: Accelerator) -> tuple[list[float], int | None]:
        """Every process's mean loss over the interval's finite losses (one gather), and the first
        step with a NaN/inf loss on any process, or None."""
        counted = self.positions < self.count
        bad = counted & ~torch.isfinite(self.values)
        finite = counted & ~bad
        mean = torch.where(finite, self.values, 0).sum() / finite.sum().clamp(min=1)
        first_bad = torch.where(bad.any(), bad.int().argmax(), -1)
        rows = accelerator.gather(torch.stack([mean, first_bad.to(mean.dtype)])[None]).tolist()
        bad = [int(b) for _, b in rows if b >= 0]
        return [m for m, _ in rows], (self.first_step + min(bad) // self.grad_accum if bad else None)

    def last_step_nonfinite(self, accelerator: Accelerator) -> bool:
        """Whether the step just made had a NaN/inf loss on any process (a host sync: --skip-nonfinite only)."""
        recent = self.values[self.count - self.grad_accum: self.count]
        return bool(accelerator.reduce((~torch.isfinite(recent)).sum().float(), "sum").item() > 0)

    def state(self, accelerator: Accelerator) -> dict:
        """For a checkpoint: every process's losses so far in the interval (all processes call this)."""
        return {"first_step": self.first_step, "count": self.count,
                "values": accelerator.gather(self.values[None]).tolist()}

    def load(self, state: dict, process_index: int) -> None:
        self.first_step, self.count = state["first_step"], state["count"]
        self.values.copy_(torch.tensor(state["values"][process_index]))


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
