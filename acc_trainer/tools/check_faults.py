"""`acc-trainer check --faults` (check.py): the faults injected into the 2-process job (process 1 sends itself SIGKILL
or SIGSTOP from a hook on the model), the wait for its processes to end, and the fault rows: whether the run stopped,
clearly and within the watchdog's bound, and whether `--resume auto` then finished it bit for bit.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, TrainConfig
from .check_rows import FAIL, PASS, RESUME_CAUSE, SKIPPED, max_difference, row
from .check_samples import _in_training_steps

FAULTS = {"kill": signal.SIGKILL, "stall": signal.SIGSTOP}
# --faults' default --hang-timeout: the watchdog's own rule (20 x the median step time) over a floor of 5 s
# instead of 60 s: the check's short runs hold no long first step to wait for (the watchdog still gives the
# first step and checkpoint writes 10 x the bound), and a stall is then named in seconds, not minutes.
HANG_FLOOR = 5.0
# The time a stopped run may take beyond the bound: the watchdog looks once a second, tells a stopped process
# by a heartbeat older than watchdog.STALE (3 s), and the processes take a moment to end on a loaded machine.
SLACK = 10.0


def fault_names(faults, cfg: TrainConfig) -> list[str]:
    """`faults` as given (False, True, names, or "kill,stall") as a list of FAULTS' names, checked against `cfg`."""
    if faults is True:
        return list(FAULTS)
    names = [n.strip() for n in faults.split(",")] if isinstance(faults, str) else list(faults or [])
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ConfigError(f"--faults: unknown fault {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    if "stall" in names and cfg.hang_timeout == 0:
        raise ConfigError("--faults stall needs the watchdog, which --hang-timeout 0 turns off")
    return names


@dataclass(frozen=True)
class Fault:
    """A fault for one job: process `rank` sends itself `signal` at its first training forward after the
    checkpoint `checkpoint` exists, writing the time to `marker` first. Sent from within, by a hook on the model,
    so that it lands in that step however fast the run: a short run can end before a signal from outside."""

    signal: int
    rank: int
    checkpoint: Path
    marker: Path
    allowed: float  # seconds from the signal until every process must have ended

    def hook(self):
        @torch.compiler.disable  # a file check and a signal: not something --compile's graphs can hold
        def fire(module, args):
            if module.training and self.checkpoint.is_dir() and _in_training_steps():
                tmp = self.marker.with_suffix(".tmp")
                tmp.write_text(json.dumps({"at": time.time()}))
                os.replace(tmp, self.marker)
                os.kill(os.getpid(), self.signal)

        return fire


def _faulted(context, fault: Fault) -> dict:
    """Waits for a faulted job's processes: `at` (the signal's time, None when it was never sent), `took`
    (seconds from it until every process had ended) and `killed` (the ranks still running `fault.allowed`
    seconds after it, which the check then killed)."""
    processes, at, killed = context.processes, None, []
    while running := [p for p in processes if p.exitcode is None]:
        if at is None and fault.marker.exists():
            at = json.loads(fault.marker.read_text())["at"]
        if at is not None and time.time() > at + fault.allowed:
            killed = [processes.index(p) for p in running]
            for p in running:
                p.kill()
                p.join()
            break
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=0.05)
    ended = time.time()
    for p in processes:
        p.join()
    if at is None and fault.marker.exists():  # sent just before the last process ended
        at = json.loads(fault.marker.read_text())["at"]
    return {"at": at, "took": ended - at if at else None, "killed": killed}


def _stop_row(fault: Fault, faulted: dict, half: int, hang: float) -> dict:
    """Whether a run that lost process `fault.rank` stopped by itself, clearly, within `fault.allowed` seconds
    of the signal: after a kill the survivor's collective fails (or its watchdog fires); after a stall the
    watchdog names the stopped process (the survivor's line, on its stderr) and ends every process."""
    signame = signal.Signals(fault.signal).name
    name = f"{signame} to process {fault.rank} after the step-{half} checkpoint"
    watchdog = _watchdog_line(faulted["said"])
    if faulted["at"] is None:
        if faulted["finished"]:
            return row(name, SKIPPED, f"not sent: the run ended without a training forward of process {fault.rank} "
                                      "after the checkpoint", "the forward function does not call the model itself "
                                      "(the signal is sent from a hook on it)")
        if watchdog:
            return row(name, FAIL, f"not sent: the watchdog stopped the run before it: {_short(watchdog)}",
                       "a step (the first one compiles, with --compile) slower than the check's bound",
                       "a larger --hang-timeout")
        return row(name, FAIL, f"not sent: the run failed before it: {faulted['error'] or 'no error recorded'}", "")
    took = (f"{faulted['took']:.1f} s after it (at most {fault.allowed:.0f} s: --hang-timeout {hang:.3g} s + "
            f"{SLACK:.0f} s)")
    if faulted["killed"]:
        return row(name, FAIL, f"process(es) {', '.join(map(str, faulted['killed']))} still running {took}: killed "
                               "by the check", "the survivor neither failed in its collective nor was stopped by the "
                               "watchdog", "--hang-timeout (the watchdog is the bound on a hang)")
    if fault.signal == signal.SIGSTOP:
        named = watchdog is not None and f"process {fault.rank} stopped responding" in watchdog
        return row(name, PASS if named else FAIL, f"every process ended {took}; " + (
            f"the watchdog named process {fault.rank}" if named else f"the watchdog said: {_short(watchdog)}"),
                   "" if named else "the watchdog did not name the stopped process")
    said = faulted["error"] or watchdog
    clear = watchdog is not None or "lost contact" in (said or "")
    return row(name, PASS if clear else FAIL, f"every process ended {took}; process 0: {_short(said)}",
               "" if clear else "the survivor ended without saying that it lost a process")


def _watchdog_line(said: list[str | None]) -> str | None:
    """The watchdog's line (it names the processes and the checkpoint to resume from) in what the processes
    printed, if any."""
    lines = [line for text in said if text for line in text.splitlines()]
    return next((line for line in lines if line.startswith("acc-trainer: process ") and "stopped every process" in line),
                None)


def _short(text: str | None) -> str:
    """A line cut for the table: its first sentence, without the source location gloo puts in its errors."""
    line = re.sub(r"\[\S+:\d+\] ", "", (text or "nothing").splitlines()[0]).split(". ")[0]
    return line if len(line) <= 100 else line[:97] + "..."


def _resumed_row(fault: Fault, resumed: dict | None, two: dict, half: int, world: int) -> dict:
    """The faulted run continued with --resume auto in its folder, against the uninterrupted run ("two"):
    it must start from the half-way checkpoint (a run that starts over also ends bit-identical) and end
    bit-identical."""
    name = f"resumed after {signal.Signals(fault.signal).name} (--resume auto)"
    if resumed is None:
        return row(name, SKIPPED, "no fault, nothing to resume", "")
    if resumed["error"]:
        return row(name, FAIL, resumed["error"], "", "")
    start = resumed["summary"]["resumed_from"]
    if start != str(fault.checkpoint):
        return row(name, FAIL, f"started from {start or 'the beginning'}, not the step-{half} checkpoint",
                   "--resume auto did not find the checkpoint")
    d = max_difference(two["weights"], resumed["weights"])
    if d == 0:
        return row(name, PASS, f"from step {half}: bit-identical to the uninterrupted {world}-process run", "")
    return row(name, FAIL, f"from step {half}: max parameter difference {d:.1e} from the uninterrupted run", *RESUME_CAUSE)
