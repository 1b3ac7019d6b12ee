"""The run folder: which folder a run writes to, its lock (one run at a time), and the files the main
process writes there (config.yaml, metrics.jsonl, summary.json; the model card's command line: `command_line`)."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from ..config import ConfigError, TrainConfig
from ..distributed.processes import main_decides
from .checkpoints import write_sums

# What fit() was given as objects, set by api.fit for its run: config.yaml's first line names them, since the file
# cannot build them again (`acc-trainer rerun` says so instead of training something else).
OBJECTS_NOTE = "# fit() trained this run on objects this file cannot build again: "
# Where a run wrote and whether it resumed are not what it trains: left out of config.yaml, which then trains the
# run again into a new folder (`acc-trainer --config RUN_DIR/config.yaml`, `acc-trainer rerun RUN_DIR`).
NOT_RECORDED = ("output_dir", "resume")
LOCK = ".lock"  # held by the run that writes the folder (lock_run_folder)


def _in_use(folder: Path, handle) -> ConfigError | None:
    import fcntl

    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        return ConfigError(f"--output-dir {folder} is in use by another run (process {holder}); wait for it to end, "
                           "or choose another folder")
    return None


def check_not_in_use(folder: Path) -> None:
    """Refuses a folder another live run holds (main process only; the lock is let go at once)."""
    try:  # read only: a lock file that a finished run just removed is not made again
        handle = open(folder / LOCK)
    except OSError:  # no lock file, no folder: nothing holds it (a folder that cannot be written is said on locking it)
        return
    with handle:
        error = _in_use(folder, handle)
    if error:
        raise error


def refuse_a_run_in(folder: Path) -> None:
    """A run that does not resume is refused a folder where a run left its files."""
    if any((Path(folder) / name).exists() for name in RunFiles.OUTPUTS):
        raise ConfigError(f"--output-dir {folder} already holds a run; choose a new folder, or add --resume auto")


def lock_run_folder(folder: Path, resuming: bool):
    """One run at a time per folder: an exclusive flock on <folder>/.lock, held by the open file returned until the
    run lets it go (`RunFiles.release`, at the run's end, whatever ended it; a finished run removes the file). The
    operating system drops it when the process dies, so a killed run never leaves a lock behind. Main process only."""
    while True:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            handle = open(folder / LOCK, "a+")
        except OSError as e:  # a read-only file system, a parent that is a file, no permission
            where = next((p for p in [folder, *folder.parents] if p.exists()), folder)
            raise ConfigError(f"--output-dir {folder} cannot be written ({e.strerror or type(e).__name__}"
                              + (f": {where} is not a folder" if where.exists() and not where.is_dir() else "")
                              + "); choose another folder") from None
        error = _in_use(folder, handle)
        if error:
            handle.close()
            raise error
        if _still_named(folder / LOCK, handle):
            break
        # A finished run removed the file between its opening here and the lock: locked, it guards nothing. The file
        # now at that name (made again, or by another run) is the lock.
        handle.close()
    # Checked again under the lock: a run that finished since this one started left its files here.
    if not resuming:
        try:
            refuse_a_run_in(folder)
        except ConfigError:
            handle.close()
            raise
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def _still_named(path: Path, handle) -> bool:
    """Whether the open `handle` is the file now at `path`."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(handle.fileno())
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


class RunFiles:
    """config.yaml, metrics.jsonl and summary.json of one run; written by the main process only.

    A file that cannot be written (a full disk, a file size limit) stops the run with one line naming
    it, the operating system's reason and the checkpoint to resume from; what was written before stays.
    """

    OUTPUTS = ("metrics.jsonl", "summary.json", "model.safetensors")

    def __init__(self, folder: Path, enabled: bool, resumed_step: int | None = None, lock=None):
        """`resumed_step`: the run continues from a checkpoint at that step; records after it,
        logged before the interruption, are dropped because the resumed run logs them again, and a summary.json
        left by an earlier end is removed (the run writes its own when it ends). `lock`: the folder's
        lock (lock_run_folder), let go by `release`."""
        self.folder, self.enabled = folder, enabled
        self._metrics, self._lock, self._finished = None, lock, False
        if enabled:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / "metrics.jsonl"
            with self.writing(path):
                if resumed_step is not None and path.exists():
                    kept = [line for line in path.read_text().splitlines(keepends=True)
                            if _complete_record_before(line, resumed_step)]
                    _write_atomically(path, "".join(kept))
                if resumed_step is not None:  # continued: a summary of an earlier end no longer describes the run
                    (folder / "summary.json").unlink(missing_ok=True)
                self._metrics = open(path, "a", buffering=1)  # line-buffered: survives a kill

    def write_config(self, cfg: TrainConfig, objects: tuple[str, ...] = ()) -> None:
        """The resolved options, in the form `--config` reads back (less NOT_RECORDED), after a line naming what
        fit() was given as `objects` (the model, the data, functions without an import path)."""
        if self.enabled:
            note = f"{OBJECTS_NOTE}{', '.join(objects)}\n" if objects else ""
            # Named as the command line and the docs' YAML files name them (batch-size, not batch_size).
            options = {name.replace("_", "-"): value for name, value in {**cfg.to_dict(),
                                                                         **dict.fromkeys(NOT_RECORDED)}.items()}
            with self.writing(self.folder / "config.yaml"):
                (self.folder / "config.yaml").write_text(note + yaml.safe_dump(options, sort_keys=False))
                write_sums(self.folder, ["config.yaml"])  # evaluate and rerun verify it (the weights join it at the end)

    def log(self, record: dict) -> None:
        if self.enabled:
            with self.writing(self.folder / "metrics.jsonl"):
                self._metrics.write(json.dumps(strict_json(record), allow_nan=False) + "\n")

    @contextmanager
    def writing(self, path: Path):
        """An OSError while writing `path` (main process only) becomes one line and exit 1."""
        from ..stopping import TrainingStopped

        try:
            yield
        except OSError as e:
            self._close_metrics()
            raise TrainingStopped(f"writing {path} failed: {_write_failure(e, path)}; {self._resume_from()}",
                                  code=1, alone=True) from None

    @contextmanager
    def plots_if_stopped(self, draw: bool = True):
        """A run stopped early (signal, NaN/inf, a full disk) still gets plots of what it did, where
        they can be written."""
        from ..stopping import TrainingStopped

        try:
            yield
        except TrainingStopped as stopped:
            if self.enabled and draw:
                from .plots import plot_run  # matplotlib: imported only when a plot is drawn

                try:
                    if self._metrics is not None and not self._metrics.closed:
                        self._metrics.flush()
                    plot_run(self.folder)
                except OSError as e:  # the disk that stopped the run, most likely: the first reason stays
                    reason = _write_failure(e, self.folder / "plots")
                    reason = "the same reason" if reason in str(stopped) else reason
                    raise TrainingStopped(f"{stopped}; the plots could not be written either ({reason})",
                                          stopped.code, stopped.alone) from None
            raise

    def write_summary(self, summary: dict) -> None:
        if self.enabled:
            with self.writing(self.folder / "metrics.jsonl"):
                self._metrics.close()
            with self.writing(self.folder / "summary.json"):
                _write_atomically(self.folder / "summary.json", json.dumps(strict_json(summary), indent=2, allow_nan=False)
                                  + "\n")
            self._finished = True

    def release(self) -> None:
        """The run has ended: metrics.jsonl closed and the folder's lock let go (another run may take the folder). A
        finished run's folder keeps no lock file: it is removed while still locked, and a run that opened it before
        the removal takes the lock again at its name (lock_run_folder); a run that does not resume is then refused by
        the summary.json written here (refuse_a_run_in). A stopped run's folder keeps it, for the run that resumes it."""
        self._close_metrics()
        if self._lock is not None:
            if self._finished:
                (self.folder / LOCK).unlink(missing_ok=True)
            self._lock.close()
            self._lock = None

    def _close_metrics(self) -> None:
        # A failed write leaves the line in the file's buffer: close() drops it (and still closes the
        # file) instead of failing again at interpreter exit with "Exception ignored".
        if self._metrics is not None and not self._metrics.closed:
            try:
                self._metrics.close()
            except OSError:
                pass

    def _resume_from(self) -> str:
        from .checkpoints import complete_checkpoints

        found = complete_checkpoints(self.folder / "checkpoints")
        if not found:
            return "no complete checkpoint was written"
        return f"the last complete checkpoint is {found[-1]} (continue with --resume auto --output-dir {self.folder})"


def command_line(cfg: TrainConfig) -> str:
    """The options config.yaml records, as the `acc-trainer` command that gives them: those that differ from their
    defaults (lists and mappings as JSON, which the options read as YAML)."""
    defaults = TrainConfig()
    words = ["acc-trainer"]
    for name, value in cfg.to_dict().items():
        if name in NOT_RECORDED or value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # no_x: set by --no-x, cleared by --x (flags._OnOrOff); any other x: --x, --no-x
            off = "--" + flag[len("--no-"):] if name.startswith("no_") else "--no-" + flag[2:]
            words.append(flag if value else off)
        else:
            words += [flag, shlex.quote(json.dumps(value) if isinstance(value, (list, dict)) else str(value))]
    return " ".join(words)


def given_as_objects(run: Path) -> str | None:
    """What fit() was given as objects for the run in folder `run` (config.yaml's note, or for a run written before
    the note, summary.json's model and data); None for a run the options name whole."""
    with open(run / "config.yaml") as f:
        first = f.readline()
    if first.startswith(OBJECTS_NOTE):
        return first[len(OBJECTS_NOTE):].strip()
    made = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    return f"model {made['model']}, data {made['dataset']}" if made.get("built_from") == "objects (fit)" else None


def _write_failure(error: OSError, path: Path) -> str:
    from .checkpoints import write_failure

    return write_failure(error, path)


def _complete_record_before(line: str, step: int) -> bool:
    try:
        return json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):  # a line cut short by a kill
        return False


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # half written: the old file, if any, is still whole
        raise


def new_run_folder(model_name: str, dataset_name: str, kind: str = "") -> Path:
    """A new runs/<kind><time>-<model>-<dataset>, named by the main process for every process (each then writes to
    the same folder); `kind` "lr-find-" for a range test's."""
    labels = [re.sub(r"[^\w.-]+", "_", name.rpartition(":")[2]) for name in (model_name, dataset_name)]
    return Path(main_decides(lambda: _unused(f"runs/{kind}{time.strftime('%Y%m%d-%H%M%S')}-{labels[0]}-{labels[1]}")))


def _unused(name: str) -> str:
    """`name`, or `name-2`, `name-3`, ...: runs started within the same second (fit() twice) get folders of their own."""
    path, count = name, 1
    while Path(path).exists():
        count += 1
        path = f"{name}-{count}"
    return path


def output_dir(cfg: TrainConfig, model_name: str, dataset_name: str) -> Path:
    """The run's folder, the same on every process: --output-dir, the resumed checkpoint's run, or a new
    runs/<time>-<model>-<dataset>; refused when another live run holds it or (not resuming) a run is there."""
    if cfg.output_dir:
        out = Path(cfg.output_dir)
    elif cfg.resume not in (None, "auto"):  # <run>/checkpoints/<checkpoint>
        out = Path(cfg.resume).resolve().parent.parent
    elif cfg.resume == "auto":
        raise ConfigError("--resume auto needs the --output-dir of the run to continue")
    else:
        out = new_run_folder(model_name, dataset_name)
    main_decides(lambda: _check_usable(out, cfg.resume is None))  # every process waits for it: none writes before
    return out


def refuse_a_used_folder(cfg: TrainConfig) -> None:
    """The check of `output_dir` made before the workload is built (a large set takes minutes to build), for the one
    folder known then that must be new: an --output-dir given without --resume (the folder a resume continues is
    checked by finding its checkpoint; a runs/<time>-... folder is made new). Every process calls this."""
    if cfg.output_dir and cfg.resume is None:
        main_decides(lambda: _check_usable(Path(cfg.output_dir), fresh=True))


def _check_usable(out: Path, fresh: bool) -> None:
    """A folder (or nothing yet) that no live run holds and, for a run that does not resume (`fresh`), where no run
    left its files. Main process only."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out} exists and is not a folder")
    check_not_in_use(out)
    if fresh:
        refuse_a_run_in(out)


def strict_json(value):
    """`value` as JSON can hold it: a NaN or an infinity (a metric with nothing to measure, AUROC of one class) becomes
    null, which every JSON reader takes (Python's NaN, written bare, is not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value
