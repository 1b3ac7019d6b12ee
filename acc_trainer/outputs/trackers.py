"""Experiment trackers (--log-with): which ones run, how each names its run and project and where its files go,
starting them without the run's seed steering their own draws, and at the end the final summary and the run's
files as artifacts. Accelerate's trackers (accelerate/tracking.py) do the logging; this module only builds them
with the run's names and folders, and starts and ends them.

Accelerate call made here: `init_trackers` (the trackers' runs started, on the main process).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import yaml

from ..config import TRACKERS, ConfigError, TrainConfig, first_line

DEFAULT_PROJECT = "acc_trainer"
# A tracker's own variable for its project, read when --project is not given (Accelerate's MLflow tracker reads
# MLFLOW_EXPERIMENT_NAME too; wandb would let init's argument win over WANDB_PROJECT).
PROJECT_VARIABLES = {"wandb": "WANDB_PROJECT", "mlflow": "MLFLOW_EXPERIMENT_NAME"}
# wandb's own variables for what acc_trainer would otherwise set: the run's name and the folder of its files.
WANDB_VARIABLES = {"name": "WANDB_NAME", "dir": "WANDB_DIR"}
FINAL = ("steps", "wall_time_s", "train_time_s", "samples_per_s", "peak_memory_mb", "mfu")  # summary.json's, logged


def chosen(log_with: list | None) -> list[str]:
    """--log-with's trackers, each once (`all`: every one installed). Accelerate drops a tracker that is not
    installed with a warning; a user who asked for it gets an error."""
    if not log_with:
        return []
    from accelerate.tracking import get_available_trackers

    installed = [str(t) for t in get_available_trackers()]
    if "all" in log_with:
        if not installed:
            raise ConfigError(f"--log-with all: no tracker is installed (Accelerate supports {', '.join(TRACKERS)})")
        return installed
    for name in log_with:
        if name not in installed:
            extra = ' (pip install -e ".[tensorboard]")' if name == "tensorboard" else ""
            raise ConfigError(f"--log-with {name}: the {name} package is not installed{extra}")
    return list(dict.fromkeys(log_with))


def build(cfg: TrainConfig, folder: Path) -> list:
    """Accelerate's trackers for --log-with, not started yet: each run named after the run folder, in the project of
    --project (else the tracker's own environment variable, else acc_trainer), its files in the run folder where
    the tracker keeps files of one run (TensorBoard, wandb; MLflow's and trackio's stores hold many runs: they stay
    where MLFLOW_TRACKING_URI and TRACKIO_DIR say)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    out = []
    for name in chosen(cfg.log_with):
        project = cfg.project or os.environ.get(PROJECT_VARIABLES.get(name, "-")) or DEFAULT_PROJECT
        cls = LOGGER_TYPE_TO_CLASS[name]
        if name == "tensorboard":  # <run>/logs/<project>: the run's one TensorBoard run
            tracker = cls(re.sub(r"[^\w.-]+", "_", project), folder / "logs")
        elif name == "wandb":  # files in <run>/wandb/
            mine = {"name": folder.name, "dir": str(folder.resolve())}
            tracker = cls(project, **{k: v for k, v in mine.items() if not os.environ.get(WANDB_VARIABLES[k])})
        elif name == "mlflow":
            tracker = cls(run_name=folder.name)
            tracker.experiment_name = project  # its __init__ prefers MLFLOW_EXPERIMENT_NAME to any argument
        elif name == "trackio":
            tracker = cls(project, name=folder.name)
        else:  # as Accelerate builds them (untested here)
            tracker = cls(project, folder / "logs") if cls.requires_logging_directory else cls(project)
        out.append(tracker)
    return out


def options(cfg: TrainConfig) -> dict:
    """The run's options as trackers take them (numbers, text, booleans)."""
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in cfg.to_dict().items()}


@contextlib.contextmanager
def own_draws():
    """Trackers draw names and ids from Python's and NumPy's global generators (MLflow's run names do), which the
    run has seeded from --seed: every run of a seed would draw the same. Here they draw from the system's entropy,
    and the run's generators are left where they were (a tracker never changes what the run draws either)."""
    import numpy as np

    state, np_state = random.getstate(), np.random.get_state()
    random.seed()
    np.random.seed()
    try:
        yield
    finally:
        random.setstate(state)
        np.random.set_state(np_state)


def start(accelerator, cfg: TrainConfig, folder: Path, existed: bool) -> None:
    """Starts the trackers' runs (main process, after the folder is locked, before the run writes its own files)
    with the run's options. One that fails stops the run with one line; the trackers already started are
    finished and the files they made removed (the whole folder when this run made it), so the same command can
    run again into it."""
    before = set(folder.rglob("*"))
    failed = None
    try:
        with own_draws():
            accelerator.init_trackers(cfg.project or DEFAULT_PROJECT)  # each tracker already holds its project
            values = options(cfg)
            for tracker in accelerator.trackers:
                failed = tracker
                _store(tracker, values)
    except Exception as e:  # noqa: BLE001 - any tracker's own error (a store it cannot reach, a bad key) is the line
        failed = failed or next((t for t in accelerator.trackers if not _started(t)), None)
        for tracker in accelerator.trackers:
            with contextlib.suppress(Exception):
                tracker.finish()
        accelerator.trackers.clear()
        _remove_new(folder, before, existed)
        name = failed.name if failed is not None else ",".join(cfg.log_with)
        raise ConfigError(f"--log-with {name}: the tracker did not start: {first_line(e)}") from None


def _started(tracker) -> bool:
    """Whether `start` has run: a tracker's `tracker` (its writer, run or client) exists only from then on."""
    try:
        return tracker.tracker is not None
    except AttributeError:
        return False


def _store(tracker, values: dict) -> None:
    """The options, as each tracker keeps them. TensorBoard's go into the run's own event file (Accelerate's
    `store_init_configuration` would write them into a second TensorBoard run, a subfolder, where the HParams tab
    finds no results): the HParams session starts there, and the scalars logged beside it are its results."""
    if tracker.name != "tensorboard":
        tracker.store_init_configuration(values)
        return
    from torch.utils.tensorboard.summary import hparams

    tracker.writer.file_writer.add_summary(hparams(values, {})[1])  # (experiment, session start, session end)
    tracker.writer.flush()
    # The file Accelerate's tracker writes, where it writes it, for scripts that read it (no event file: no TensorBoard run).
    where = Path(tracker.logging_dir) / str(time.time())
    where.mkdir(parents=True, exist_ok=True)
    (where / "hparams.yml").write_text(yaml.safe_dump(values))


def _remove_new(folder: Path, before: set, existed: bool) -> None:
    """What a failed start made in the run folder: all of it when the folder is new, else each new file or folder."""
    if not existed:
        shutil.rmtree(folder, ignore_errors=True)
        return
    new = set(folder.rglob("*")) - before
    for path in sorted(new):
        if path.parent in new or not os.path.lexists(path):
            continue  # inside a new folder, removed with it
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


def final_results(summary: dict) -> dict:
    """summary.json's results as numbers: the final evaluation, the best one by the run's measure, speed, time and
    memory, under `final/`."""
    out = {f"final/eval_{k}": v for k, v in (summary.get("eval") or {}).items() if _number(v)}
    best = summary.get("best")
    if best and _number(best["value"]):
        out[f"final/best_{best['metric']}"] = best["value"]
        out["final/best_step"] = best["step"]
    out.update({f"final/{k}": summary[k] for k in FINAL if _number(summary.get(k))})
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_files(folder: Path) -> list[Path]:
    """The files a tracker keeps as the run's artifacts: config.yaml, summary.json, the plots, and the final weights
    with what loads them (the files SHA256SUMS lists, and SHA256SUMS)."""
    names = ["config.yaml", "summary.json", "SHA256SUMS"]
    sums = folder / "SHA256SUMS"
    if sums.is_file():
        names += [line.split("  ", 1)[1] for line in sums.read_text().splitlines() if "  " in line]
    files = [folder / name for name in names] + sorted((folder / "plots").glob("*.png"))
    return [f for f in files if f.is_file()]


def end(accelerator, folder: Path, summary: dict) -> None:
    """At the run's end (main process): the final summary logged to every tracker at the last step, the run's files
    as artifacts where the tracker takes them (MLflow, wandb), TensorBoard's HParams session ended, and each
    tracker finished. A tracker that fails here costs a warning: the run and its files are complete."""
    if not accelerator.trackers:
        return
    results, files = final_results(summary), run_files(folder)
    with own_draws():
        for tracker in accelerator.trackers:
            try:
                tracker.log(results, step=summary["steps"])
                _artifacts(tracker, folder, files, results)
            except Exception as e:  # noqa: BLE001 - the tracker's own error, reported in one line
                _warn(tracker, "the final summary or the run's files were not logged", e)
            try:
                tracker.finish()  # its last events written, its run marked finished
            except Exception as e:  # noqa: BLE001
                _warn(tracker, "its run did not finish", e)


def _warn(tracker, what: str, error: Exception) -> None:
    print(f"acc-trainer: warning: {tracker.name}: {what}: {first_line(error)}", file=sys.stderr)


def _artifacts(tracker, folder: Path, files: list[Path], results: dict) -> None:
    """The run's files kept by the tracker (MLflow, wandb); TensorBoard's HParams session marked ended."""
    if tracker.name == "mlflow":  # copied into the run's artifact store, in the run folder's layout
        for f in files:
            parent = f.parent.relative_to(folder).as_posix()
            tracker.log_artifact(str(f), artifact_path=None if parent == "." else parent)
    elif tracker.name == "wandb":  # one artifact of the run's name, its results as metadata
        import wandb

        artifact = wandb.Artifact(re.sub(r"[^\w.-]+", "_", folder.name), type="model", metadata=results)
        for f in files:  # immutable: the run's files are final, and wandb refers to them instead of copying them
            artifact.add_file(str(f.resolve()), name=f.relative_to(folder).as_posix(), policy="immutable")
        tracker.run.log_artifact(artifact)
    elif tracker.name == "tensorboard":
        from torch.utils.tensorboard.summary import hparams

        tracker.writer.file_writer.add_summary(hparams({}, {})[2])  # (experiment, session start, session end)
        tracker.writer.flush()
