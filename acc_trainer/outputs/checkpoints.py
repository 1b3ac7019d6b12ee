"""Checkpoints: full training state through `accelerator.save_state`, written so that a checkpoint
that looks complete is complete, and read back only after checking it belongs to this run.

A checkpoint is a folder `<output-dir>/checkpoints/step-<N>` holding what `save_state` writes (model,
optimizer, scheduler, grad scaler, every process's RNG states) plus `trainer_state.json` (step,
loss accumulators, evaluations so far, the options that define the run). It is written under a
temporary name and renamed once every process has finished writing; a process killed mid-write
leaves only a `.tmp-` folder, which is never picked up and is cleared by the next save. Before the rename
the main process writes `SHA256SUMS` (the format `sha256sum -c` reads) with a digest of every file; a
checkpoint is verified against it before it is resumed, so bytes damaged at rest (a disk, a copy) are
found, named, and under `--resume auto` skipped for the newest checkpoint that verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from safetensors import SafetensorError

from ..config import ConfigError, TrainConfig, first_line
from ..distributed import engines
from ..distributed.processes import main_decides
from ..workload.models import initial_weights  # noqa: F401 - --init-from's weights (evaluate/predict read them here)

STATE_FILE = "trainer_state.json"
SUMS = "SHA256SUMS"
BEST = "best"
NAME = re.compile(r"^step-(\d+)$")
ABANDONED = "abandoned"  # checkpoints of an attempt a run resumed before (Checkpoints._set_aside_newer)
# Options that may change between an interrupted run and its resumption: they do not change what is
# computed. Every other option must match the checkpoint's.
MAY_CHANGE = {"output_dir", "resume", "accept_unverified",
              "data_dir", "num_workers", "data_pipeline", "log_with", "project", "progress", "plots",
              "dist_timeout", "hang_timeout",
              "eval_batch_size", "checkpoint_every", "keep_last", "lora_merge",
              "tokenizer", "prompts", "max_new_tokens"}


class Checkpoints:
    """The checkpoints of one run; every process writes through `writing` (each writes its own RNG state)."""

    def __init__(self, accelerator: Accelerator, folder: Path, keep_last: int | None):
        self.accelerator, self.folder, self.keep_last = accelerator, folder, keep_last
        self.last: Path | None = None

    @contextmanager
    def writing(self, state: dict, name: str | None = None):
        """`with checkpoints.writing(state) as folder: accelerator.save_state(folder)`: every process
        writes its part into a temporary folder, the main process adds `state` (trainer_state.json), and
        the folder takes its final name only once every process has written. A write that fails on any
        process stops every process, naming the reason and the last complete checkpoint."""
        name = name or f"step-{state['step']:08d}"
        final, tmp = self.folder / name, self.folder / f".tmp-{name}"
        main = self.accelerator.is_main_process
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        self.accelerator.wait_for_everyone()
        error = None
        try:
            yield tmp
            if main:
                (tmp / STATE_FILE).write_text(json.dumps(state))
        except WRITE_ERRORS as e:
            error = e
        failed = self.accelerator.gather(torch.tensor([error is not None], device=self.accelerator.device))
        if failed.any():  # every process stops, for the same reason
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            kept = f"the last complete checkpoint is {self.last}" if self.last else "no complete checkpoint was written"
            from ..stopping import TrainingStopped

            raise TrainingStopped(f"writing checkpoint {final} failed: {write_failure(error, tmp)}; {kept}", code=1)
        self.accelerator.wait_for_everyone()  # every process's files are in place
        error = None
        if main:
            try:
                self._put_in_place(tmp, final, state["step"] if name != BEST else None)
            except WRITE_ERRORS as e:
                error = e
        # A failure there stops every process too (the main one alone would leave the others waiting).
        if self.accelerator.gather(torch.tensor([error is not None], device=self.accelerator.device)).any():
            from ..stopping import TrainingStopped

            kept = f"the last complete checkpoint is {self.last}" if self.last else "no complete checkpoint was written"
            raise TrainingStopped(f"putting checkpoint {final} in place failed: {write_failure(error, tmp)}; {kept}",
                                  code=1)
        if name != BEST:
            self.last = final

    def _put_in_place(self, tmp: Path, final: Path, step: int | None) -> None:
        """The written folder summed and renamed to its final name (replacing one of that name), the abandoned attempt's
        later checkpoints set aside, --keep-last applied. Main process only."""
        write_sums(tmp)
        if final.exists():
            old = self.folder / f".old-{final.name}"
            shutil.rmtree(old, ignore_errors=True)  # left by a write killed between the two renames
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        if step is not None:
            self._set_aside_newer(step)
        self._prune()

    def _set_aside_newer(self, step: int) -> None:
        """Checkpoints of later steps than the one just written are an attempt this run abandoned (it resumed from an
        earlier checkpoint): moved into checkpoints/abandoned/, so that neither --keep-last nor --resume auto takes
        them for this run's newest (said at start: abandoned_note)."""
        for path in complete_checkpoints(self.folder):
            if int(NAME.match(path.name)[1]) > step:
                aside = self.folder / ABANDONED / path.name
                aside.parent.mkdir(exist_ok=True)
                shutil.rmtree(aside, ignore_errors=True)  # an older set-aside copy of the same step
                path.rename(aside)

    def _prune(self) -> None:
        """--keep-last: the newest checkpoints kept (by step: none is newer than the one just written)."""
        if self.keep_last:
            for old in complete_checkpoints(self.folder)[: -self.keep_last]:
                shutil.rmtree(old)


# torch's zip writer reports a failed write as RuntimeError, safetensors as its own SafetensorError.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def write_failure(error: BaseException | None, where: Path) -> str:
    """Why a write failed, in the operating system's words where it gave them (torch's zip writer does
    not: then the disk and the file size limit are looked at)."""
    import errno
    import os
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if isinstance(error, OSError) and error.errno and error.errno != errno.EFBIG:
        return os.strerror(error.errno)
    if limit != resource.RLIM_INFINITY:
        return f"File too large (the file size limit, ulimit -f, is {limit:,} bytes)"
    try:
        stats = os.statvfs(where if where.exists() else where.parent)
        if stats.f_bavail * stats.f_frsize < 64 << 20:
            return "No space left on device"
    except OSError:
        pass
    return first_line(error) if error else "another process could not write its part"


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete step checkpoints in `folder`, oldest first (temporary folders are never complete)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def find_resume(cfg: TrainConfig, out: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint `--resume` names, verified against its checksums, and notes to print. `auto` is the newest
    complete checkpoint in the run's folder that verifies (the damaged ones after it are skipped, saying why),
    or none: the run starts from its beginning, so the same command serves a first attempt and every restart,
    unless the folder holds a finished run with nothing to continue from. The main process reads the files;
    every process gets its answer."""
    if cfg.resume is None:
        return None, []

    def chosen():
        try:
            return _chosen(cfg, out)
        except OSError as e:  # a folder that cannot be read is the user's input too
            raise ConfigError(f"--resume {cfg.resume}: the checkpoints in {out} cannot be read ({type(e).__name__}: "
                              f"{first_line(e)})") from e

    path, notes = main_decides(chosen)
    return (Path(path) if path else None), notes


def _chosen(cfg: TrainConfig, out: Path) -> tuple[str | None, list[str]]:
    if cfg.resume != "auto":
        path = Path(cfg.resume)
        if not path.is_dir():
            raise ConfigError(f"--resume {path}: no such checkpoint folder")
        problem = damage(path)
        if problem and not (cfg.accept_unverified and problem.startswith("unverifiable")):
            hint = " or give --accept-unverified" if problem.startswith("unverifiable") else ""
            raise ConfigError(f"checkpoint {path} is {problem}; resume from another one (--resume auto takes the "
                              f"newest that verifies){hint}")
        notes = [unverified(f"checkpoint {path}", problem, True)] if problem else []
        return str(path), notes + abandoned_note(path, out)
    found, notes = complete_checkpoints(out / "checkpoints"), []
    if (out / "summary.json").exists():  # written last: the run ended (resuming it would rewrite its summary)
        again = f", or --resume {found[-1]} to train its last steps again" if found else ""
        raise ConfigError(f"--resume auto: {out} holds a finished run (its summary.json), with nothing left to continue; "
                          f"choose a new --output-dir{again}")
    for path in reversed(found):
        problem = damage(path)
        if problem is None:
            return str(path), notes
        if cfg.accept_unverified and problem.startswith("unverifiable"):
            return str(path), notes + [unverified(f"checkpoint {path}", problem, True)]
        notes.append(f"--resume auto: skipped checkpoint {path}: {problem}")
    if found:
        raise ConfigError(f"--resume auto: no checkpoint in {out / 'checkpoints'} verifies ({'; '.join(notes)})")
    return None, []


def abandoned_note(path: Path, out: Path) -> list[str]:
    """A run resumed from `path` while later checkpoints sit beside it: an attempt it abandons, set aside by its first
    checkpoint when it writes into their folder (`out`, the run's folder); one that writes elsewhere leaves them."""
    step = NAME.match(path.name)
    later = [p.name for p in complete_checkpoints(path.parent) if step and int(NAME.match(p.name)[1]) > int(step[1])]
    if not later:
        return []
    if path.parent.resolve() != (out / "checkpoints").resolve():
        return [f"note: resuming from {path.name}, which has later checkpoint(s) {', '.join(later)} beside it: they stay "
                f"where they are, since this run writes its checkpoints to {out / 'checkpoints'}/"]
    return [f"note: resuming from {path.name}, this run abandons the later checkpoint(s) {', '.join(later)} beside it: its "
            f"first checkpoint moves them to {path.parent / ABANDONED}/ (--resume auto and --keep-last then see this "
            "run's)"]


def write_sums(folder: Path, names: list[str] | None = None) -> None:
    """`folder/SHA256SUMS`: the digest of every file in it (or of `names`), as `sha256sum` writes them."""
    paths = [folder / n for n in names] if names is not None else \
        sorted(p for p in folder.rglob("*") if p.is_file() and p.name != SUMS)
    text = "".join(f"{_sha256(p)}  {p.relative_to(folder).as_posix()}\n" for p in paths)
    (folder / f".{SUMS}.tmp").write_text(text)
    os.replace(folder / f".{SUMS}.tmp", folder / SUMS)


def damage(folder: Path, needed: list[str] | None = None) -> str | None:
    """What is wrong with `folder`'s files against its SHA256SUMS: None when every file `needed` (default: every file in
    the folder, as a checkpoint lists them all) is listed there and matches its digest. A folder without SHA256SUMS, or
    with a needed file it does not list, is "unverifiable: ..." (deleting the digests does not switch the check off;
    --accept-unverified reads such a folder, saying so: `unverified`)."""
    sums = folder / SUMS
    if not sums.is_file():
        return f"unverifiable: it has no {SUMS}"
    listed = {}  # name -> digest, as `sha256sum` writes them: "<digest>  <name>"
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
    if needed is None:
        needed = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != SUMS)
    unlisted = [name for name in needed if name not in listed]
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        return f"unverifiable: its {SUMS} does not list {unlisted[0]}{more}"
    for name in needed:
        path = folder / name
        if not path.is_file():
            return f"incomplete: {name} missing"
        if _sha256(path) != listed[name]:
            return f"damaged: {name} does not match the digest written with it ({sums})"
    return None


def unverified(what: str, problem: str | None, accept: bool, verb: str = "is") -> str | None:
    """`problem` (from `damage`) as the ConfigError to raise, or, for an unverifiable folder with --accept-unverified,
    the note that says it was read unchecked (None: nothing to say). `what ... verb`: "the weights F are"."""
    if problem is None:
        return None
    if accept and problem.startswith("unverifiable"):
        return f"note: --accept-unverified: {what} {verb} {problem}; read without checking"
    hint = "; --accept-unverified reads it unchecked" if problem.startswith("unverifiable") else ""
    raise ConfigError(f"{what} {verb} {problem}{hint}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def read_state(path: Path, cfg: TrainConfig, world: int, engine: str | engines.Engine) -> dict:
    """The checkpoint's trainer state, after checking it is whole and belongs to this run."""
    state_file = path / STATE_FILE
    try:
        state = json.loads(state_file.read_text())
        saved = state["config"]
        step = int(state["step"])
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {path} is incomplete: {STATE_FILE} is missing") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"checkpoint {state_file} is corrupt ({type(e).__name__}: {e})") from None
    defaults = TrainConfig().to_dict()  # a checkpoint written before an option existed had its default
    # --micro-batch sets the accumulation (the checkpoint holds what it chose): the global batch is what must match.
    may_change = MAY_CHANGE | ({"grad_accum"} if cfg.micro_batch is not None else set())
    mismatches = [
        f"{key} {saved.get(key, defaults[key])!r} (this run: {value!r})"
        for key, value in cfg.to_dict().items()
        if key not in may_change and saved.get(key, defaults[key]) != value
    ]
    if mismatches:
        raise ConfigError(f"checkpoint {path} is from a different run: {'; '.join(mismatches)}")
    if state.setdefault("engine", "DDP") not in engines.ENGINES:
        raise ConfigError(f"checkpoint {path} is corrupt: it names no engine acc_trainer knows ({state['engine']!r})")
    saved = engines.of(state["engine"])
    engines.of(engine).check_move(path, saved, state["world_size"], world)
    names = {p.name for p in path.iterdir()}
    required = ["scheduler.bin"] + [f"random_states_{i}.pkl" for i in range(min(world, state["world_size"]))]
    missing = [name for name in required if name not in names] + saved.missing_files(names)
    if missing:
        raise ConfigError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing")
    state["step"] = step
    return state


def parameter_shapes(model) -> dict[str, list[int]]:
    """Every parameter's name and shape: what makes a checkpoint's weights fit a model."""
    return {name: list(p.shape) for name, p in model.named_parameters()}


def check_model(path: Path, state: dict, model) -> None:
    """A checkpoint of another model is refused, whatever the options say (fit() and import paths name
    a model by its class; its parameters are what must match)."""
    saved = state.get("parameters")
    if saved is None:  # written before checkpoints recorded them
        return
    here = parameter_shapes(model)
    if saved == here:
        return
    differ = [f"{n} {saved[n]} in the checkpoint, {here[n]} here" for n in saved if n in here and saved[n] != here[n]]
    only_saved, only_here = [n for n in saved if n not in here], [n for n in here if n not in saved]
    detail = differ[:2]
    if only_saved:
        detail.append(f"{len(only_saved)} parameter(s) only in the checkpoint (e.g. {only_saved[0]})")
    if only_here:
        detail.append(f"{len(only_here)} parameter(s) only in this model (e.g. {only_here[0]})")
    raise ConfigError(f"checkpoint {path} holds a different model: {'; '.join(detail)}")


@contextmanager
def reading(path: Path):
    """Around `accelerator.load_state(path)`: a damaged file is the user's problem, reported naming it
    (safetensors, pickle and torch each raise their own types for a bad file)."""
    try:
        with warnings.catch_warnings():
            # torch warns that Accelerate's own files use pickle protocol 4: nothing the user can act on.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            yield
    except ConfigError:  # a check of the checkpoint's own (distributed/engines/) says what is wrong already
        raise
    except Exception as e:
        raise ConfigError(f"checkpoint {path} cannot be loaded ({type(e).__name__}: {first_line(e)})") from None


def elastic_note(saved_world: int, world: int) -> list[str]:
    """What a checkpoint continued on another number of processes keeps, said once."""
    if saved_world == world:
        return []
    return [f"note: the checkpoint was written by {saved_world} process(es) and continues on {world}: the same samples "
            "make each step (--batch-size is global), and each process continues the random numbers of the process of "
            f"its index{', a new one those of process 0' if world > saved_world else ''} (dropout then draws other "
            "masks than an uninterrupted run)"]


def check_random_states(accelerator: Accelerator, path: Path, saved_world: int | None = None) -> None:
    """After `load_state`: every process's random number generators are the checkpoint's, or every
    process stops with one line. A process the checkpoint has no state for (it was written by fewer
    processes) takes process 0's, as every process starts from the same seed in a new run."""
    rank = accelerator.process_index
    if saved_world is not None and rank >= saved_world:
        _restore_random_states(path / "random_states_0.pkl")
        rank = 0
    problem = _rng_not_restored(path, rank)
    failed = accelerator.gather(torch.tensor([problem is not None], device=accelerator.device)).tolist()
    if any(failed):  # every process raises: the same decision everywhere
        ranks = ", ".join(str(i) for i, bad in enumerate(failed) if bad)
        raise ConfigError(f"checkpoint {path}: the random number generator states of process {ranks} cannot be "
                          f"restored ({problem or 'see that process'}); resuming would not continue the same run")


def restore_random_states(path: Path, rank: int) -> None:
    """This process's generators from the checkpoint's random states of process `rank` (what `load_state` does, for a
    checkpoint loaded without it: Engine.move_in)."""
    _restore_random_states(path / f"random_states_{rank}.pkl")


def _restore_random_states(file: Path) -> None:
    """Sets the generators (CPU, and CUDA where there is one) from an Accelerate random-states file (weights-only
    unpickling): Accelerate's load_state reads only the file of the process's own index."""
    from accelerate.utils import load as load_weights_only

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            states = load_weights_only(file)
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
            torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    except Exception:  # noqa: BLE001 - reported by _rng_not_restored, which reads the same file
        pass


def _rng_not_restored(path: Path, rank: int) -> str | None:
    """Accelerate (1.15) catches every error while restoring random_states_<rank>.pkl and logs it at INFO
    level, so a run would quietly resume with other randomness. The file is read again the same way
    (weights-only unpickling: a file carrying code is refused, never run) and compared with the
    generators as they are now."""
    from accelerate.utils import load as load_weights_only

    file = path / f"random_states_{rank}.pkl"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            states = load_weights_only(file)
        restored = (torch.equal(torch.get_rng_state(), states["torch_manual_seed"])
                    and random.getstate() == states["random_state"]
                    and all(np.array_equal(a, b)
                            for a, b in zip(np.random.get_state(), states["numpy_random_seed"], strict=True)))
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
            # Not strict: on a machine with another number of GPUs, set_rng_state_all restores the devices both
            # machines have (it sets those it is given, one by one), and those are what can be compared.
            restored = restored and all(torch.equal(a, b) for a, b in
                                        zip(torch.cuda.get_rng_state_all(), states["torch_cuda_manual_seed"]))
    except Exception as e:
        kind = "it holds more than plain data and was refused" if "Weights only load failed" in str(e) else first_line(e)
        return f"{file.name}: {kind}"
    return None if restored else f"{file.name} does not match the generators after loading"


# ----------------------------------------------------------------------------------------- --init-from

