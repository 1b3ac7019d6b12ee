"""`acc-trainer sweep SPACE.yaml`: a hyperparameter search with Optuna, each trial a whole run (docs/experiments.md).

SPACE.yaml holds the options every trial shares (`options`, as `--config` takes them, import paths included), the
options to search (`search`) and how (`metric`, `sampler`, `pruner`, `trials`, `launcher`). Each trial is the
launcher's command (`acc-trainer`, or `acc-trainer launch ... -m acc_trainer` for several processes) in a process
of its own, with its options in `<sweep>/trial-N/trial.yaml` and `<sweep>/trial-N` as its run folder. This process
reads the trial's metrics.jsonl as it grows, reports each evaluation to the study, and stops a trial that the pruner
prunes with SIGTERM (the trainer checkpoints and exits 143).

The study lives in Optuna's storage: a SQLite file in the sweep folder, or any database URL Optuna takes, which
several workers (this command, run again on this machine or another) share. Ctrl-C (or SIGTERM) is passed on to the
running trial, which checkpoints; the same command run again continues the study, first resuming the trials this
sweep folder left running (`--resume auto` from their checkpoints; a lock file tells them from another live worker's).

This module runs the trials; the space file is read in sweep_space.py, and sweep_results.py tabulates and draws the
trials.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, did_you_mean, first_line
from ..flags import Parser
from ..stopping import StopSignals
from .sweep_results import _shown, show_results
from .sweep_space import TRIALS, Space, read_space, trial_options

POLL_S = 0.2  # how often a running trial's metrics.jsonl is read


@dataclass
class Picked:
    """The trial a worker runs next: a new one, or one this sweep folder left running (resumed)."""

    trial: Any  # optuna.Trial
    folder: Path
    lock: Any  # the open lock file: held while this worker runs the trial
    resumed: bool
    reported: dict = field(default_factory=dict)  # step -> value already reported to the study
    seconds: float = 0.0  # run time before this attempt


def main(argv: list[str]) -> None:
    parser = Parser(prog="acc-trainer sweep", description="Search the options of SPACE.yaml with Optuna: each trial a "
                    "whole run in its own process and folder, pruned from its evaluations; run it again to continue.")
    parser.add_argument("space", metavar="SPACE.yaml", help="the search space, the options every trial shares and "
                        "the study's settings (docs/experiments.md#sweeps)")
    parser.add_argument("--trials", type=int, metavar="N", help="trials in the study, all workers together "
                        f"(default: the space file's, else {TRIALS}; a grid: its size)")
    parser.add_argument("--storage", metavar="URL", help="Optuna's storage: a database URL several workers share "
                        "(default: the space file's, else sqlite:///<sweep-dir>/study.db)")
    parser.add_argument("--study", metavar="NAME", help="the study's name (default: the space file's, else its file name)")
    parser.add_argument("--sweep-dir", metavar="DIR", help="where the trials' run folders go (default: sweeps/<study>)")
    parser.add_argument("--seed", type=int, metavar="N", help="the sampler's seed (give each worker its own)")
    parser.add_argument("--launcher", metavar="COMMAND", help="the command before each trial's options (default: "
                        "acc-trainer; e.g. 'acc-trainer launch --multi_gpu --num_processes 2 -m acc_trainer')")
    args = parser.parse_args(argv)
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError("acc-trainer sweep needs Optuna: pip install optuna (or this package's optuna extra)") from None
    given = {key: getattr(args, key.replace("-", "_")) for key in ("trials", "storage", "study", "sweep-dir", "seed",
                                                                    "launcher")}
    space = read_space(Path(args.space), {k: v for k, v in given.items() if v is not None})
    from ..outputs.progress import make_console

    sys.exit(sweep(space, make_console()))


def open_study(space: Space):
    """The study in its storage, created by the first worker and loaded by the others."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # this command says what happens, trial by trial
    samplers = {"tpe": lambda seed: optuna.samplers.TPESampler(seed=seed),
                "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
                "grid": lambda seed: optuna.samplers.GridSampler({n: list(d.choices) for n, d in space.search.items()},
                                                                 seed=seed)}
    pruners = {"median": optuna.pruners.MedianPruner, "successive-halving": optuna.pruners.SuccessiveHalvingPruner,
               "hyperband": optuna.pruners.HyperbandPruner, "none": optuna.pruners.NopPruner}
    try:
        pruner = pruners[space.pruner](**space.pruner_args)
    except TypeError as e:
        raise ConfigError(f"space file {space.path}: pruner-args: {first_line(e)}") from None
    space.folder.mkdir(parents=True, exist_ok=True)
    # SQLite: several workers on one file wait for each other's writes (up to a minute) instead of failing.
    engine = {"connect_args": {"timeout": 60}} if space.storage.startswith("sqlite") else None
    try:
        storage = optuna.storages.RDBStorage(space.storage, engine_kwargs=engine)
        study = optuna.create_study(storage=storage, study_name=space.study, direction=space.direction,
                                    pruner=pruner, load_if_exists=True)
        seed = None if space.seed is None else sampler_seed(space.seed, len(study.get_trials(deepcopy=False)))
        study.sampler = samplers[space.sampler](seed)
    except ImportError as e:
        raise ConfigError(f"--storage {space.storage}: {first_line(e)}") from None
    except Exception as e:  # SQLAlchemy's: a URL it cannot parse, a server it cannot reach
        if type(e).__module__.split(".")[0] not in ("sqlalchemy", "optuna"):
            raise
        raise ConfigError(f"--storage {space.storage}: {type(e).__name__}: {first_line(e)}") from None
    if study.direction.name.lower() != space.direction:
        raise ConfigError(f"study {space.study} in {space.storage} was created to {study.direction.name.lower()}, not "
                          f"to {space.direction}; name another --study")
    return study


def sampler_seed(seed: int, trials: int) -> int:
    """The seed of a worker's sampler, given --seed and the trials the study holds when the worker starts. A seeded
    sampler draws the same values in every process: one restarted on a study that has trials would draw the first ones
    again, so the seed moves on with the study; and each (seed, trials) pair gets its own (seed + trials made worker 1
    restarted after 2 trials draw what worker 2 drew after 1)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{trials}".encode()).digest()[:4], "big")


def sweep(space: Space, console) -> int:
    """Runs trials until the study holds `space.trials`; the exit code (128 + the signal when stopped)."""
    study = open_study(space)
    console.print(f"study {space.study} ({space.storage}): {space.trials} trials, {space.sampler} sampler, "
                  f"{space.pruner} pruner, {space.direction} {space.metric}; run folders in {space.folder}", markup=False)
    ran, failed = 0, 0
    with StopSignals(passes_on=True) as stop:
        while not stop.received:
            picked = next_trial(study, space)
            if picked is None:
                break
            try:
                if not stop.received:  # else it stays running, to be resumed
                    ran += 1
                    failed += not run_trial(study, space, picked, stop, console) and not stop.received
            finally:
                picked.lock.close()
    show_results(study, space, console)
    if stop.received:
        console.print(f"sweep stopped by {signal.Signals(stop.received).name}: run the same command again to continue "
                      "(a stopped trial resumes from its checkpoint)", markup=False)
        return 128 + stop.received
    if ran and failed == ran:
        print(f"acc-trainer: every trial this sweep ran failed ({ran}); their trial.log says why", file=sys.stderr)
        return 1
    return 0


def next_trial(study, space: Space) -> Picked | None:
    """A trial this sweep folder left running (no live worker holds its lock), else a new one while the study
    holds fewer than `space.trials`, else None."""
    import optuna
    from optuna.trial import TrialState

    for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        folder = space.folder / f"trial-{frozen.number}"
        if not (folder / "trial.yaml").is_file():  # another machine's, or one being started
            continue
        lock = _lock(folder)
        if lock is not None:
            # Optuna's FrozenTrial names its storage id privately; Trial(study, id) takes the running trial over.
            return Picked(optuna.trial.Trial(study, frozen._trial_id), folder, lock, True, dict(frozen.intermediate_values),
                          frozen.user_attrs.get("seconds", 0.0))
    if len(study.get_trials(deepcopy=False, states=_counted())) >= space.trials:
        return None
    trial = study.ask(space.search)
    folder = space.folder / f"trial-{trial.number}"
    try:
        folder.mkdir()
    except FileExistsError:
        tell(study, trial, state=TrialState.FAIL)
        raise ConfigError(f"{folder} holds a trial of another study: give each study its own --sweep-dir") from None
    lock = _lock(folder)
    trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    # Written under the lock: a worker that finds it knows the trial is taken while the lock is held.
    options = {k.replace("_", "-"): v for k, v in trial_options(space.options, trial.params).items()}
    (folder / "trial.yaml").write_text(f"# trial {trial.number} of study {space.study} ({space.storage})\n"
                                       + yaml.safe_dump(options, sort_keys=False))
    return Picked(trial, folder, lock, False)


def _counted() -> tuple:
    """The trials that count towards `trials`: all but those enqueued and not started yet."""
    from optuna.trial import TrialState

    return tuple(state for state in TrialState if state != TrialState.WAITING)


def _lock(folder: Path):
    """The trial's lock, held while a worker runs it (the system drops it when the worker dies), or None."""
    handle = open(folder / ".sweep-lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.truncate(0)
    handle.write(f"{socket.gethostname()} {os.getpid()}\n")
    handle.flush()
    return handle


def run_trial(study, space: Space, picked: Picked, stop: StopSignals, console) -> bool:
    """One trial's run, followed to its end: complete (its last evaluation's value), pruned, failed, or left
    running when the sweep is stopped (the sweep run again resumes it). False when it failed."""
    from optuna.trial import TrialState

    trial, folder, reported = picked.trial, picked.folder, picked.reported
    command = [*launcher_argv(space.launcher), "--config", str(folder / "trial.yaml"), "--output-dir", str(folder),
               *(["--resume", "auto"] if picked.resumed else [])]
    console.print(f"trial {trial.number} {'resumed' if picked.resumed else 'started'}: {_shown(trial.params)}",
                  markup=False)
    started = time.monotonic()
    with open(folder / "trial.log", "a") as log:
        # A session of its own: Ctrl-C in a terminal reaches this process alone, which passes it on (StopSignals).
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 preexec_fn=_stopped_with_the_sweep)
        stop.follow(child)
        try:
            pruned, seen = follow(trial, folder / "metrics.jsonl", child, space.metric, reported, stop)
        finally:
            stop.follow(None)
    seconds = picked.seconds + time.monotonic() - started
    trial.set_user_attr("seconds", round(seconds, 2))
    step = max(reported) if reported else None
    said = f"trial {trial.number}: "
    if pruned is not None:
        tell(study, trial, state=TrialState.PRUNED)
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)  # a pruned trial never continues
        said += f"pruned at step {pruned} ({space.metric} {reported[pruned]:.6g})"
    elif child.returncode == 0 and step is not None:
        tell(study, trial, reported[step])
        said += f"{space.metric} {reported[step]:.6g} at step {step}"
    elif stop.received:
        said += "stopped" + (f" after step {step}" if step else "") + "; it resumes when the sweep runs again"
    else:
        reason = _failure(child.returncode, folder, space.metric, seen)
        trial.set_user_attr("failure", reason)
        tell(study, trial, state=TrialState.FAIL)
        said += f"failed: {reason} ({folder / 'trial.log'})"
        if child.returncode == 0 and seen:  # the run evaluated, and never this metric: no trial ever would
            console.print(f"{said}, {seconds:.1f} s", markup=False)
            raise ConfigError(f"space file {space.path}: metric {space.metric!r} is not among the trials' evaluations "
                              f"({', '.join(sorted(seen))}); the sweep stops" + did_you_mean(space.metric, seen))
    console.print(f"{said}, {seconds:.1f} s", markup=False)
    return trial.user_attrs.get("failure") is None and not stop.received


def _stopped_with_the_sweep() -> None:
    """In the trial's process before it starts: SIGTERM when the sweep's process dies (Linux's PR_SET_PDEATHSIG), so
    that a sweep killed outright leaves no trial running unwatched: the trial checkpoints and stops, and the sweep
    run again resumes it (elsewhere the trial runs on to its end)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl: not Linux
        pass


def tell(study, trial, value: float | None = None, state=None) -> None:
    """study.tell. Optuna's GridSampler stops the study once its last grid point is told, and Study.stop raises outside
    study.optimize (Optuna 5.0): the trial is stored all the same (study/_tell.py stores it in a `finally`)."""
    try:
        study.tell(trial, value, state=state)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise


def follow(trial, metrics: Path, child: subprocess.Popen, metric: str, reported: dict, stop: StopSignals) -> tuple:
    """Reports each new evaluation of `metric` in the trial's metrics.jsonl to the study while the trial runs, and
    stops it (SIGTERM) when the pruner prunes it. Returns the step it was pruned at (None: it was not) and the names
    of the evaluations' results."""
    lines, pruned, seen = _Lines(metrics), None, set()
    while True:
        ended = child.poll() is not None  # read after this: all of what a trial that has ended wrote
        for record in lines.new():
            results = [key[5:] for key in record if key.startswith("eval_")]
            seen.update(results)
            value, step = record.get(f"eval_{metric}"), record.get("step")
            # A resumed trial logs again what it did after its checkpoint; a pruned one is over for the study.
            if value is None or step in reported or pruned is not None:
                continue
            trial.report(value, step)
            reported[step] = value
            if trial.should_prune():  # asked even while stopping: a pruner keeps its own records (rungs) as it answers
                pruned = step
                if not stop.received:  # else it is stopping already, and a second signal would skip its checkpoint
                    child.send_signal(signal.SIGTERM)
        if ended:
            return pruned, seen
        time.sleep(POLL_S)


class _Lines:
    """The JSON records a growing file gains between reads; a file written anew (a resumed run rewrites its
    metrics.jsonl up to its checkpoint) is read again from its start."""

    def __init__(self, path: Path):
        self.path, self.inode, self.offset, self.rest = path, None, 0, b""

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                status = os.fstat(f.fileno())
                if status.st_ino != self.inode or status.st_size < self.offset:
                    self.inode, self.offset, self.rest = status.st_ino, 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *whole, self.rest = (self.rest + data).split(b"\n")
        records = []
        for line in whole:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records


def _failure(code: int, folder: Path, metric: str, seen: set) -> str:
    if code == 0:
        return (f"its evaluations have no {metric} (they have {', '.join(sorted(seen))})" if seen else
                "it made no evaluation (give it an evaluation set)")
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    try:
        lines = [line for line in (folder / "trial.log").read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return f"exit {code}" + (f": {lines[-1].strip()}" if lines else "")


def launcher_argv(launcher: str) -> list[str]:
    """The launcher's command line; `acc-trainer` runs as this Python's `-m acc_trainer`, whatever PATH holds."""
    words = shlex.split(launcher)
    return [sys.executable, "-m", "acc_trainer", *words[1:]] if words[:1] == ["acc-trainer"] else words
