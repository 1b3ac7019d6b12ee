"""A hung process found and named within about a minute, not at the collective timeout (--dist-timeout).

Every process runs a watchdog thread. The loop tells it, without a system call, where it is: a step begun, waiting
for data, computing, evaluating a batch, writing a checkpoint (`Watchdog.at`). The thread writes a heartbeat file
for its process every second (`<run>/.heartbeats/<rank>`: what the process is doing and since when), and fires when
its own process has made no progress for longer than the bound: --hang-timeout seconds, or by default 20 times the
run's own median step time (each step timed whole, every micro-batch of an accumulation) with a floor of 60 s (the
first step, which may compile, checkpoint writes and the final save get 10 times that). The loop watches the final
save and every collective after the last step too. When it fires it reads every process's heartbeat and names the
one that holds the others up: a process whose heartbeat stopped (stopped, swapped out, its machine gone) or the one
doing something else than the rest (waiting for data while the others wait in a collective). A live process that is
stuck prints its own Python stacks (faulthandler); the lowest-ranked process prints the one line, with the
checkpoint to resume from, and every process ends with exit code 1. Checkpoints are written atomically, so nothing
saved is lost.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

FLOOR = 60.0  # seconds: the shortest default bound
STEPS = 20.0  # the default bound in median step times
SLOW = 10.0  # how much longer the first step and a write (a checkpoint, the final weights) may take
WRITES = ("checkpoint", "final weights")
EXIT = 1


class Idle:
    """The loop's watchdog when there is none (--hang-timeout 0, or outside the loop): told, and ignoring it."""

    def at(self, what: str, step: int | None = None) -> None:
        pass

    @contextmanager
    def slow(self, what: str):
        yield


class Watchdog:
    """`with Watchdog(folder, rank, world, timeout, last_checkpoint) as watch:` around the loop."""

    def __init__(self, folder: Path, rank: int, world: int, timeout: float | None, resume_hint: callable):
        self.folder, self.rank, self.world = folder / ".heartbeats", rank, world
        self.timeout, self.resume_hint = timeout, resume_hint
        self.what, self.since, self.step, self.moved = "starting", time.monotonic(), 0, time.monotonic()
        self.step_began = self.moved  # when the step under way began (its first micro-batch's data)
        self.durations: list[float] = []  # the last steps' times, each from its first micro-batch to its update
        self._told = False  # this process has printed its stacks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="acc_trainer-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        self.folder.mkdir(parents=True, exist_ok=True)
        # At once, not a second later: a process stopped before its first heartbeat could not be named by its
        # pid, nor ended by the others (`acc-trainer check --faults` stops one in a short run's first second).
        self._beat(time.monotonic())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            (self.folder / str(self.rank)).unlink()  # none yet in a run shorter than a second
        with contextlib.suppress(OSError):
            self.folder.rmdir()  # the last one out (the folder may hold others' still)

    def at(self, what: str, step: int | None = None) -> None:
        """The process moved on: to `what` ("data", "compute", "evaluation", ...), at optimizer step `step`."""
        now = time.monotonic()
        if step is not None and step != self.step:
            if self.step:  # the first step may compile: not a measure of the run's speed
                # The whole step, every micro-batch of an accumulation: since the previous one ended.
                self.durations = (self.durations + [now - self.step_began])[-50:]
            self.step, self.step_began = step, now
        self.what, self.since, self.moved = what, now, now

    @contextmanager
    def slow(self, what: str):
        """A write (a checkpoint, the final weights): allowed SLOW times the bound. Its heartbeat is written at once: a
        process stopped in it is named as it is, not as it was up to a second before (a few steps earlier)."""
        self.at(what)
        self._beat(time.monotonic(), f".{self.rank}.{threading.get_ident()}.tmp")
        try:
            yield
        finally:
            self.at("compute")
            self.step_began = time.monotonic()  # the write is no part of the next step's time

    def bound(self) -> float:
        """Seconds without progress after which the process counts as hung."""
        if self.timeout:
            bound = self.timeout
        else:
            bound = max(FLOOR, STEPS * statistics.median(self.durations)) if self.durations else FLOOR
        return bound * (SLOW if not self.durations or self.what in WRITES else 1.0)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            self._beat(now)
            if now - self.moved > self.bound():
                self._fire(now)

    def _beat(self, now: float, tmp_name: str | None = None) -> None:
        record = {"what": self.what, "step": self.step, "for_s": round(now - self.since, 1), "wall": time.time(),
                  "pid": os.getpid(), "host": socket.gethostname()}
        tmp = self.folder / (tmp_name or f".{self.rank}.tmp")  # the loop's own beats beside the thread's
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.folder / str(self.rank))
        except OSError:
            pass  # a heartbeat that cannot be written only makes the diagnosis vaguer

    def _fire(self, now: float) -> None:
        waited = now - self.moved
        if self.rank in (odd_ones(self._beats()) if self.world > 1 else [0]):  # alive and stuck: where, at once
            self._stacks(waited)
        # A process that stopped is told from one that waits by its heartbeat, which goes stale within STALE s.
        for _ in range(int(STALE * 2) + 2):
            wall, beats = time.time(), self._beats()
            stale = [r for r, b in beats.items() if b is None or wall - b["wall"] > STALE]
            if stale or self.world == 1:
                break
            time.sleep(0.5)
            self._beat(time.monotonic())
        culprits = stale or odd_ones(beats) or [self.rank]
        if self.rank in culprits and not self._told:  # nobody stands out: each says where it is
            self._stacks(waited)
        if self.rank == min(set(range(self.world)) - set(stale) or {self.rank}):  # the lowest-ranked live one says it
            waited = time.monotonic() - self.moved
            print(f"acc-trainer: {describe(culprits, stale, beats, wall, self.world)}: no progress for {waited:.0f} s "
                  f"(the bound, --hang-timeout: {self.bound():.0f} s); stopped every process; {self.resume_hint()}",
                  file=sys.stderr, flush=True)
            host = socket.gethostname()
            for rank in stale:  # a stopped process cannot end itself, and its launcher would wait for it
                if beats[rank] and beats[rank]["host"] == host:
                    with contextlib.suppress(OSError):
                        os.kill(beats[rank]["pid"], signal.SIGKILL)
        os._exit(EXIT)


    def _stacks(self, waited: float) -> None:
        print(f"acc-trainer: process {self.rank} made no progress for {waited:.0f} s ({self.what} at step "
              f"{self.step}); its Python stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self._told = True

    def _beats(self) -> dict:
        beats = {}
        for rank in range(self.world):
            try:
                beats[rank] = json.loads((self.folder / str(rank)).read_text())
            except (OSError, ValueError):
                beats[rank] = None
        return beats


STALE = 3.0  # seconds without a heartbeat (written every second) after which a process has stopped responding


def odd_ones(beats: dict) -> list[int]:
    """The processes that hold the others up while all still answer: those waiting for data while the others
    wait in the step's collectives, else the fewest doing the same thing."""
    if any(b is None for b in beats.values()):
        return []
    data = [r for r, b in beats.items() if b["what"] == "data"]
    if data and len(data) < len(beats):
        return data
    doing = [b["what"] for b in beats.values()]
    fewest = min(doing.count(w) for w in doing)
    return [r for r, b in beats.items() if doing.count(b["what"]) == fewest] if fewest < len(doing) / 2 else []


def describe(culprits: list[int], stale: list[int], beats: dict, wall: float, world: int) -> str:
    if world == 1:
        return f"the process hung ({beats[0]['what']} at step {beats[0]['step']})" if beats.get(0) else \
            "the process hung"
    parts = []
    for rank in culprits:
        beat = beats.get(rank)
        if beat is None:
            parts.append(f"process {rank} never wrote a heartbeat")
        elif rank in stale:
            parts.append(f"process {rank} stopped responding (no heartbeat for {wall - beat['wall']:.0f} s; it was "
                         f"{beat['what']} at step {beat['step']})")
        else:
            parts.append(f"process {rank} is stuck ({beat['what']} at step {beat['step']} for {beat['for_s']:.0f} s)")
    return "; ".join(parts) + ", while the others wait"
