"""Stopping a run cleanly: preemption signals and runaway losses, decided by all processes together.

Processes of a DDP run are at most one step apart, so if one stopped on its own the others would
wait for it forever. At every log step and epoch end, where the loop reads its losses anyway, the
processes agree (one tiny gather) whether any of them was asked to stop. (Losses stay on the device until
log steps and checkpoints, where a NaN/inf is found and named by its step: state.IntervalLosses.)

A process started by torch's launcher (torchrun, accelerate launch, acc-trainer launch) runs in a session of its own,
so a launcher killed outright (SIGKILL: a scheduler, the out-of-memory killer) never passes a signal on and its
processes would train on, orphaned, into a folder a restarted job then meets half written. While the loop runs, each
such process watches its launcher and, once it is gone, stops as on SIGTERM: a checkpoint, exit 143.

torch is imported where it is used: a sweep's process (tools/sweep.py) stops with StopSignals and never loads it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

    from accelerate import Accelerator


# The launcher of this process, when torch's launcher started it (its agent sets TORCHELASTIC_RUN_ID), else None.
LAUNCHER = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


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

    `passes_on`: for a process that runs others (a sweep, its trials) and stops once they have. Every signal, the
    second too, is passed on to the process it `follow`s (which stops as it would in a terminal), and this process
    keeps its handlers: a second Ctrl-C must reach the trial, not interrupt the sweep that watches it.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    LAUNCHER_POLL_S = 0.5

    def __init__(self, accelerator: Accelerator | None = None, passes_on: bool = False):
        """`accelerator`: the run's (None: one process)."""
        self.received: int | None = None
        self._previous = {}
        self._accelerator = accelerator
        self._passes_on = passes_on
        self._child: subprocess.Popen | None = None
        self._done = threading.Event()

    def __enter__(self) -> "StopSignals":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if LAUNCHER is not None and not self._passes_on:
            threading.Thread(target=self._watch_launcher, name="acc-trainer launcher watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _watch_launcher(self) -> None:
        """A process whose launcher is gone (it was started by another parent) asks to stop, as on SIGTERM."""
        while not self._done.is_set():
            if os.getppid() != LAUNCHER:
                if self.received is None:
                    print(f"acc-trainer: the launcher (process {LAUNCHER}) is gone: this process stops as on SIGTERM, "
                          "after a checkpoint", file=sys.stderr, flush=True)
                    self.received = signal.SIGTERM
                return
            self._done.wait(self.LAUNCHER_POLL_S)

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum
        if not self._passes_on:
            signal.signal(signal.SIGINT, self._previous[signal.SIGINT])
        elif self._child is not None and self._child.poll() is None:
            self._child.send_signal(signum)

    def follow(self, child: subprocess.Popen | None) -> None:
        """With `passes_on`: the process the signals go to from now on (None: none), given the one received while
        it was starting."""
        self._child = child
        if child is not None and self.received:
            child.send_signal(self.received)

    def agreed(self, check: bool) -> int | None:
        """The signal any process has received (the same answer on all), or None.

        One process answers at once. Several agree only when `check` is true (the loop passes its
        log steps and epoch ends), so that no other step waits for an extra collective.
        """
        if self._accelerator is None or self._accelerator.num_processes == 1:
            return self.received
        if not check:
            return None
        import torch

        flags = self._accelerator.gather(torch.tensor([self.received or 0], device=self._accelerator.device))
        return max(flags.tolist()) or None


def lost_contact(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another process died, hung or vanished.

    gloo and NCCL report these as RuntimeError (or torch.distributed.DistError) with these words.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    text = str(error)
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError)
        and any(words in text for words in ("Connection closed by peer", "Timed out", "timed out", "Connection reset",
                                            "NCCL", "gloo"))
    )
