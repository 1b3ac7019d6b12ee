"""Stopping a run cleanly: preemption signals and runaway losses, decided by all processes together.

Processes of a DDP run are at most one step apart, so if one stopped on its own the others would
wait for it forever. At every log step and epoch end, where the loop reads its losses anyway, the
processes agree (one tiny gather) whether any of them was asked to stop. (Losses stay on the device until
log steps and checkpoints, where a NaN/inf is found and named by its step: state.IntervalLosses.)
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

    A SIGTERM that comes again is the same request (a scheduler signals every process, and the launcher passes
    its own on: the second must not kill a process before its checkpoint); after any of them a Ctrl-C gets the
    previous handler (so a second Ctrl-C interrupts at once).
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
        self.received = self.received or signum
        signal.signal(signal.SIGINT, self._previous[signal.SIGINT])

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
