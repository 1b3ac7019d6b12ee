"""Where a run writes and what it continues from (`origin`: the folder, the checkpoint it resumes, checked against
the model as built), and the run folder opened once every stage of the start succeeded (`opened`: the folder locked,
the config written, the trackers started, the checkpoints' writer, the terminal's progress), so that a failed start
leaves nothing behind.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from ..config import TrainConfig
from ..distributed import processes
from ..distributed.processes import Group
from . import checkpoints, trackers
from .checkpoints import Checkpoints
from .progress import Progress, engine_name
from .runfiles import RunFiles, lock_run_folder, output_dir


@dataclass
class Origin:
    """Where a run writes and what it continues from."""

    folder: Path
    resume: Path | None
    resumed: dict | None  # the checkpoint's trainer state (checkpoints.read_state)
    notes: list[str]  # checkpoints --resume auto skipped, and why


@dataclass
class Output:
    """Where the run writes: its folder, its files and checkpoints, and what the terminal shows."""

    folder: Path
    resume: Path | None  # the checkpoint the run continues from
    files: RunFiles
    checkpoints: Checkpoints
    progress: Progress


def origin(cfg: TrainConfig, job, group: Group) -> Origin:
    """The run's folder and the checkpoint it resumes from (checked against this run)."""
    folder = output_dir(cfg, job.model_name, job.dataset_name)
    resume, notes = checkpoints.find_resume(cfg, folder)
    resumed = checkpoints.read_state(resume, cfg, group.state.num_processes, group.engine) if resume else None
    return Origin(folder, resume, resumed, notes)


def fits(origin: Origin, model) -> dict:
    """The resumed checkpoint holds this model (its parameters' shapes), and the shapes of the model as the user built
    it (with its adapters): what the run's checkpoints record and a later resume must match."""
    if origin.resumed:
        checkpoints.check_model(origin.resume, origin.resumed, model)
    return checkpoints.parameter_shapes(model)


def opened(cfg: TrainConfig, accelerator: Accelerator, origin: Origin, step: int, shape: Any,
           unnamed: tuple[str, ...] = ()) -> Output:
    """Startup succeeded: only now does the run write anything (the folder locked, its config, the trackers)."""
    # --resume auto with no checkpoint yet: an earlier attempt's files (stopped before its first checkpoint) are
    # replaced, from step 0 on.
    again = cfg.resume == "auto"
    existed = origin.folder.exists()
    lock = []  # the folder's lock, held by the main process until the run ends (RunFiles.release)
    processes.main_decides(lambda: lock.append(lock_run_folder(origin.folder, origin.resume is not None or again)))
    try:
        if cfg.log_with:  # before the run's own files: a tracker that fails to start leaves the folder reusable
            processes.main_decides(lambda: trackers.start(accelerator, cfg, origin.folder, existed))
        files = RunFiles(origin.folder, enabled=accelerator.is_main_process,
                         resumed_step=step if origin.resumed or again else None, lock=lock[0] if lock else None)
    except BaseException:
        for handle in lock:
            handle.close()
        raise
    with released_on_failure(files):
        files.write_config(cfg, unnamed)
        saver = Checkpoints(accelerator, origin.folder / "checkpoints", cfg.keep_last)
        saver.last = origin.resume
        progress = Progress(cfg.progress, accelerator.is_main_process, shape.total_steps, shape.epochs, shape.per_epoch)
    return Output(origin.folder, origin.resume, files, saver, progress)


@contextmanager
def released_on_failure(files: RunFiles):
    """A start that fails once the folder is locked lets the lock go (the run's own `finally` is not reached yet)."""
    try:
        yield
    except BaseException:
        files.release()
        raise


def start_notes(cfg: TrainConfig, origin: Origin, world: int, data_notes: list[str]) -> list[str]:
    """What the start line says of where the run starts (another number of processes than the checkpoint's, what
    finding the checkpoint noted, no checkpoint yet for --resume auto) and of the data's labels."""
    notes = checkpoints.elastic_note(origin.resumed["world_size"], world) if origin.resumed else []
    notes += origin.notes + data_notes
    if cfg.resume == "auto" and not origin.resume:
        notes.append(f"--resume auto: no checkpoint in {origin.folder / 'checkpoints'} yet: the run starts from its "
                     "beginning")
    return notes


def announce(r) -> None:
    """The start line (the run as set up: its processes, engine, precision, global batch, steps, parameters), then
    every note of the start, on the main process's terminal."""
    accelerator, cfg = r.accelerator, r.cfg
    r.output.progress.print(
        f"[bold]acc_trainer[/] {r.job.model_name} on {r.job.dataset_name}: {r.world} process(es) "
        f"({engine_name(accelerator.distributed_type.value)}, {accelerator.device.type}), precision "
        f"{accelerator.mixed_precision}, "
        f"global batch {cfg.batch_size} = {r.world} x {cfg.grad_accum} x {r.per_process_batch}, "
        + (f"{r.shape.total_steps} steps" if r.shape.total_steps else
           "steps: as many as the stream gives (learnt in its first epoch)")
        + (f", resuming at step {r.state.step} from {r.output.resume}" if r.output.resume else "")
        + f"; {_counted(r.trained.counts)}"
    )
    for note in r.notes:
        r.output.progress.print(note)


def _counted(counts: dict) -> str:
    if counts["trainable"] == counts["total"]:
        return f"{counts['total']:,} parameters, all trained"
    return f"{counts['trainable']:,} of {counts['total']:,} parameters trained"
