"""`acc-trainer check` / `acc_trainer.check(...)`: the package's own proofs, run on a user's workload.

Short runs of the user's job (`--steps` optimizer steps each) are compared with each other:

| job | what it is | compared for |
| --- | --- | --- |
| base | 1 process, a checkpoint half-way | the reference |
| nudged | base with every initial weight moved by one ulp | how far rounding alone carries a run (chaos) |
| accum | 1 process, `--grad-accum 2` | accumulation |
| again | base, once more | determinism |
| resumed | base continued from its half-way checkpoint | exact resume |
| two | 2 processes (2 CPU processes over gloo, or 2 GPUs) | topology, samples, evaluation counts |
| two_sync_bn | two with `--sync-bn` (only when the model has BatchNorm) | what unsynchronised BatchNorm costs |

Every job runs in processes forked from this one (so a user's objects need no pickling, and each job
starts from the same untouched model and a fresh Accelerate state). A forward pre-hook records a
fingerprint of every training sample the model is given, per process, to compare what each step saw.

A difference counts as a topology dependence only when it is larger than what chaos explains:
tolerance = max(1e-5, 10 x the nudged run's drift).

`--faults` (`faults=True`) asks another question, of the same forked jobs: does a run that loses a process
stop, clearly and soon, and does `--resume auto` then finish it as if nothing had happened? The job runs on 2
processes with a checkpoint half-way; process 1 sends itself SIGKILL (fault "kill") or SIGSTOP (fault "stall")
at its first training forward after that checkpoint, and the check measures the time from the signal until
every process has ended, reads what the survivor said, resumes in the same folder and compares the final
weights bit for bit with the uninterrupted 2-process job ("two"). It replaces the guarantee rows rather than
adding to them: it waits out a watchdog bound and answers a separate question; each mode stays cheap enough
to run often.
"""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing.connection
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import ConfigError, TrainConfig, first_line

PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"
FAULTS = {"kill": signal.SIGKILL, "stall": signal.SIGSTOP}
# --faults' default --hang-timeout: the watchdog's own rule (20 x the median step time) over a floor of 5 s
# instead of 60 s: the check's short runs hold no long first step to wait for (the watchdog still gives the
# first step and checkpoint writes 10 x the bound), and a stall is then named in seconds, not minutes.
HANG_FLOOR = 5.0
# The time a stopped run may take beyond the bound: the watchdog looks once a second, tells a stopped process
# by a heartbeat older than watchdog.STALE (3 s), and the processes take a moment to end on a loaded machine.
SLACK = 10.0


def check(model, train_data, eval_data=None, *, loss=None, metrics=None, collate_fn=None, forward=None,
          config: TrainConfig | None = None, steps: int = 8, output_dir: str | None = None, faults=False,
          **options) -> list[dict]:
    """Checks a user's workload, given as to `fit`. Prints the table; returns its rows (dicts with
    check, result, measured, cause, fix). `output_dir` keeps the short runs (else they are removed).
    `faults`: True (or names from FAULTS: "kill", "stall") for the fault rows instead of the guarantees;
    `hang_timeout=S` sets the watchdog's bound for them."""
    from ..training.api import fit_config
    from ..workload.components import from_objects

    cfg = replace(fit_config(model, train_data, config, options, collate_fn, forward), output_dir=None)
    # One thread per process: this process may have run OpenMP work already (building the data, say),
    # and GNU OpenMP's thread pool does not survive a fork: a forked child that uses it hangs.
    names = fault_names(faults, cfg)  # before the Checker makes its folder
    return Checker(cfg, lambda cfg: from_objects(model, train_data, eval_data, loss, metrics, collate_fn or cfg.collate,
                                                 forward or cfg.forward, cfg.pack), steps, output_dir,
                   threads=1).run(names)


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


def _named_workload(cfg: TrainConfig):
    """The workload `cfg` names, built in a job's process (after its process group is formed: the main process
    reads or downloads the data first)."""
    from accelerate.utils import set_seed

    from ..workload.components import build_workload

    set_seed(cfg.seed)
    return build_workload(cfg)


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


class Checker:
    def __init__(self, cfg: TrainConfig, build, steps: int, output_dir: str | None, threads: int | None = None):
        if steps < 2:
            raise ConfigError(f"--steps must be at least 2, got {steps}")
        if cfg.lora:  # its rows compare whole weights files; a LoRA run writes its adapter alone
            raise ConfigError("acc-trainer check does not take --lora yet: check the workload without it (the adapters "
                              "train through the same loop), or wrap the model with peft in your model factory")
        self.cfg, self.build, self.steps, self.threads = cfg, build, steps, threads
        self.folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="acc-trainer-check-"))
        self.keep = output_dir is not None
        # 2 GPUs when there are; else every run on the CPU (one GPU cannot hold two processes' runs).
        gpus = torch.cuda.device_count() if not cfg.cpu else 0  # counts without initialising CUDA (fork-safe)
        self.devices, self.world = ("GPUs" if gpus >= 2 else "CPU processes"), 2
        self.options = {"max_steps": steps, "epochs": 10**6, "progress": "none", "plots": False, "resume": None,
                        "log_with": None,
                        "checkpoint_every": None, "save_best": None, "keep_last": None, "cpu": gpus < 2}

    # --------------------------------------------------------------------------------------- jobs

    def job(self, name: str, world: int = 1, nudge: bool = False, fault: Fault | None = None, **options) -> dict:
        """Runs one job in `world` forked processes; returns what it left (summary, weights, samples, error),
        and with a fault what `_faulted` measured."""
        folder = self.folder / name
        cfg = replace(self.cfg, **{**self.options, **options, "output_dir": str(folder)})
        port = _free_port()
        threads = self.threads or max(1, (os.cpu_count() or 2) // world)
        context = torch.multiprocessing.start_processes(
            _worker, args=(self.build, cfg, world, port, nudge, str(folder), threads, fault), nprocs=world,
            start_method="fork", join=False)
        error = folder / "error.txt"
        if fault:
            measured = {**_faulted(context, fault), "error": _read(error), "finished": (folder / "summary.json").exists(),
                        "said": [_read(folder / f"stderr-{r}.txt") for r in range(world)]}
            error.unlink(missing_ok=True)  # the run's resumption, in this folder, writes its own
            return measured
        while not context.join():  # a process that dies ends the others (else they would wait for it)
            pass
        result = {"error": None, "summary": None, "weights": None, "samples": []}
        if error.exists():
            result["error"] = error.read_text().strip()
            return result
        from safetensors.torch import load_file

        result["summary"] = json.loads((folder / "summary.json").read_text())
        result["weights"] = load_file(folder / "model.safetensors")
        ranks = [json.loads((folder / f"samples-{r}.json").read_text()) for r in range(world)]
        calls = [rank["samples"] for rank in ranks]
        result["samples"] = [sorted(sum((rank[i] for rank in calls), [])) for i in range(len(calls[0]))]
        result["draws"] = any(rank["draws"] for rank in ranks)
        return result

    def run(self, faults: list[str] = ()) -> list[dict]:
        """The guarantee rows, or with `faults` (names from FAULTS) the fault rows; prints the table."""
        # Imported once here and inherited by every forked job, which would otherwise import them itself:
        # torch._dynamo alone (imported by the first optimizer) costs each job about 3 s on a small CPU.
        for module in ("torch._dynamo", "acc_trainer.training.loop"):
            importlib.import_module(module)
        from ..outputs.progress import make_console

        console = make_console()
        half = self.steps // 2
        console.print(f"[bold]acc-trainer check[/]: {self.cfg.model} on {self.cfg.dataset}, {self.steps} steps per "
                      f"run, 2 {self.devices}" + (f"; faults: {', '.join(faults)}" if faults else ""))
        try:
            rows = self.fault_rows(faults, half) if faults else self.guarantee_rows(half)
        finally:
            if not self.keep:
                shutil.rmtree(self.folder, ignore_errors=True)
        console.print(table(rows))
        failed, skipped = (sum(r["result"] == kind for r in rows) for kind in (FAIL, SKIPPED))
        # A guarantee row is SKIPPED where it does not apply (no BatchNorm); a fault that was not sent proved nothing.
        console.print(f"{failed} check(s) failed" if failed else
                      f"{skipped} fault(s) not injected: nothing was measured there (see why above)"
                      if faults and skipped else "every check passed")
        return rows

    def guarantee_rows(self, half: int) -> list[dict]:
        base = self.job("base", checkpoint_every=str(half))
        if base["error"]:
            raise ConfigError(f"the workload does not train on 1 process: {base['error']}")
        nudged = self.job("nudged", nudge=True)
        again = self.job("again")
        accum = self.job("accum", grad_accum=2) if self.cfg.batch_size % 2 == 0 else None
        resumed = self.resume(base, half)
        two = self.job("two", world=self.world)
        has_bn = _has_batchnorm(self.folder / "base")
        synced = self.job("two_sync_bn", world=self.world, sync_bn=True) if has_bn and not self.cfg.sync_bn \
            else None
        return rows_for(base, nudged, again, accum, resumed, two, synced, has_bn, self.cfg, half, self.world,
                        self.folder)

    def fault_rows(self, faults: list[str], half: int) -> list[dict]:
        """Per fault, the uninterrupted 2-process job ("two") faulted in process 1 after its half-way
        checkpoint, then resumed in the same folder: two rows, the stop and the resumption."""
        two = self.job("two", world=self.world)
        if two["error"]:
            raise ConfigError(f"the workload does not train on {self.world} processes: {two['error']}")
        hang = self.cfg.hang_timeout if self.cfg.hang_timeout is not None else \
            max(HANG_FLOOR, 20 * two["summary"]["train_time_s"] / two["summary"]["steps"])
        rows = []
        for name in faults:
            folder = self.folder / name
            fault = Fault(FAULTS[name], 1, folder / "checkpoints" / f"step-{half:08d}", folder / "fault.json",
                          hang + SLACK)
            options = {"checkpoint_every": str(half), "hang_timeout": hang}
            faulted = self.job(name, world=self.world, fault=fault, **options)
            resumed = self.job(name, world=self.world, resume="auto", **options) if faulted["at"] else None
            rows += [_stop_row(fault, faulted, half, hang), _resumed_row(fault, resumed, two, half, self.world)]
        return rows

    def resume(self, base: dict, half: int) -> dict:
        """A copy of base's folder holding only its half-way checkpoint, continued to the end."""
        folder = self.folder / "resumed"
        shutil.copytree(self.folder / "base" / "checkpoints" / f"step-{half:08d}",
                        folder / "checkpoints" / f"step-{half:08d}")
        (folder / "metrics.jsonl").write_text("")
        return self.job("resumed", resume="auto", checkpoint_every=str(half))


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


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() else None


def _worker(rank: int, build, cfg: TrainConfig, world: int, port: int, nudge: bool, folder: str, threads: int,
            fault: Fault | None) -> None:
    """One process of a job. Forked: it starts from the parent's objects, untouched by earlier jobs."""
    from accelerate.state import AcceleratorState, GradientState

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # as accelerate launch sets it, without its warning
    torch.set_num_threads(threads)
    AcceleratorState._reset_state(reset_partial_state=True)  # the parent's, copied by fork
    GradientState._reset_state()
    if fault:  # what each process says (the watchdog's line, its stacks) is read by the check
        Path(folder).mkdir(parents=True, exist_ok=True)
        file = os.open(Path(folder) / f"stderr-{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, 2)
        os.close(file)
    from ..distributed.processes import start
    from ..stopping import lost_contact
    from ..training.loop import run

    record = {"samples": [], "draws": False}
    try:
        group = start(cfg)  # once, for the build (the main process reads the data first) and the run
        job = build(cfg)
        if nudge:
            with torch.no_grad():
                for p in job.model.parameters():
                    p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
        before, after = _recorder(record)
        job.model.register_forward_pre_hook(before, with_kwargs=True)
        job.model.register_forward_hook(after)
        if fault and rank == fault.rank:
            job.model.register_forward_pre_hook(fault.hook())
        run(cfg, job, group)
    except Exception as e:  # the parent reports it in its row
        if rank == 0:
            text = str(e) if isinstance(e, ConfigError) else "".join(traceback.format_exception_only(e)).strip()
            if lost_contact(e):  # as the command line says it (cli.py)
                text = f"lost contact with another process: {first_line(e)}"
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "error.txt").write_text(text)
        return
    (Path(folder) / f"samples-{rank}.json").write_text(json.dumps(record))


def _recorder(record: dict):
    """Forward hooks: a fingerprint of every sample of every training call (micro-batch), and whether
    the call drew from torch's global random number generators (dropout, torch.rand)."""
    state = {}

    def before(module, args, kwargs):
        if not module.training or not _in_training_steps():
            return
        rows = _sample_rows([*args, *kwargs.values()])
        if rows is not None:
            record["samples"].append([_fingerprint(row) for row in rows])
        state["rng"] = _rng_states()

    def after(module, args, output):
        if module.training and _in_training_steps() and "rng" in state and not record["draws"]:
            record["draws"] = any(not torch.equal(a, b) for a, b in zip(state["rng"], _rng_states()))

    return before, after


@torch.compiler.disable  # a stack walk: not something --compile's graphs can hold
def _in_training_steps() -> bool:
    """Whether the model is called by the loop's training steps (loop.train_epoch is on the stack), not by the
    checks at start (components.check_fit) or the FLOP count, which pass the first samples through it."""
    from ..training.loop import train_epoch

    # sys._getframe (CPython's frame access, documented as implementation-specific): the recorder asks where
    # it is called from instead of the core setting a flag for it.
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is train_epoch.__code__:
            return True
        frame = frame.f_back
    return False


def _sample_rows(values: list) -> list[torch.Tensor] | None:
    """Each sample of the model's first input, flattened: the rows of a batched tensor, or the tensors of a
    list of samples (images for a detector). Padding is left out where an attention mask of 0s and 1s
    marks it (a sample padded to one length on 1 process and to another on 2 is the same sample);
    padding with 0s adds nothing to the fingerprint anyway."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim():
            x = value.detach().double().cpu()
            mask = next((m for m in tensors[1:] if m.shape == value.shape and m.dim() == 2 and not m.is_floating_point()
                         and bool(((m == 0) | (m == 1)).all())), None)
            if mask is not None and value.dim() == 2:
                return [row[keep.bool()] for row, keep in zip(x, mask.cpu())]
            return list(x.reshape(len(x), -1))
        if isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
            return [t.detach().flatten().double().cpu() for t in value]
    return None


def _fingerprint(row: torch.Tensor) -> list[float]:
    weights = torch.arange(1, len(row) + 1, dtype=torch.float64)
    return [round(row.sum().item(), 6), round((row * weights).sum().item(), 6)]


def _rng_states() -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])]


def _has_batchnorm(folder: Path) -> bool:
    from safetensors.torch import load_file

    return any(name.endswith("running_mean") for name in load_file(folder / "model.safetensors"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------- the rows


def max_difference(a: dict, b: dict) -> float:
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()),
               default=0.0)


def rows_for(base, nudged, again, accum, resumed, two, synced, has_bn, cfg, half, world, folder: Path) -> list[dict]:
    """The table's rows: topology and accumulation against the 1-process run, the samples, the
    evaluation counts, the resume, determinism and BatchNorm."""
    return [*_equivalence_rows(base, nudged, accum, two, has_bn, cfg, world), _samples_row(base, two, world),
            _evaluation_row(base, two, world), _resume_row(base, resumed, half), _determinism_row(base, again),
            _unused_row(base, world, folder, half),
            *_batchnorm_rows(base, two, synced, has_bn, cfg, world)]


def _equivalence_rows(base, nudged, accum, two, has_bn, cfg, world) -> list[dict]:
    """N processes and --grad-accum 2 against 1 process, within what a 1-ulp nudge of the start moves."""
    rows = []
    chaos = max_difference(base["weights"], nudged["weights"]) if not nudged["error"] else math.inf
    tolerance = max(1e-5, 10 * chaos)
    chaotic = f"; a 1-ulp nudge of the initial weights moves it {chaos:.1e}"

    def compare(name: str, job: dict | None, cause: str, fix: str) -> None:
        if job is None:
            rows.append(row(name, SKIPPED, "not applicable", ""))
        elif job["error"]:
            rows.append(row(name, FAIL, job["error"], cause, fix))
        else:
            d = max_difference(base["weights"], job["weights"])
            result = PASS if d <= tolerance else FAIL
            rows.append(row(name, result, f"max parameter difference {d:.1e} (tolerance {tolerance:.0e}{chaotic})",
                            cause if result == FAIL else "", fix if result == FAIL else ""))

    draws = base.get("draws", False)
    compare(f"{world} processes vs 1", two, *_topology_cause(base, two, draws, has_bn and not cfg.sync_bn))
    compare("--grad-accum 2 vs 1 process", accum, *_topology_cause(base, accum, draws, has_bn))
    return rows


def _topology_cause(base: dict, other: dict | None, draws: bool, batchnorm: bool) -> tuple[str, str]:
    """Why another topology ends elsewhere than 1 process: the first cause the runs show, in this order:
    BatchNorm, random numbers drawn in forward, other samples, a loss averaged over each micro-batch's
    positions; else what was ruled out."""
    if batchnorm:
        return ("BatchNorm normalises each process's (or micro-batch's) share of the batch separately",
                "--sync-bn for processes; larger micro-batches, or a model without BatchNorm, for accumulation")
    if draws:
        return ("the model draws random numbers in forward (dropout, torch.rand without a generator): each process "
                "draws its own masks, so the runs see the same samples and the same expected gradient but not the same "
                "masks", "turn dropout off to check the rest; draw from a torch.Generator seeded per sample to match")
    if other is not None and not other["error"] and _all_samples(base) != _all_samples(other):
        return ("the samples differ between the runs (see the samples row)", "make each sample a function of (seed, "
                "index) only")
    if base["summary"].get("loss_per") == "position":
        return ("the loss is a mean over each micro-batch's positions (tokens, pixels, labels of -100 left out), whose "
                "number differs between micro-batches: each micro-batch weighs the same, not each position",
                "return (sum, count) from the loss, or leave the loss to the model (its own token loss is counted per "
                "token)")
    return ("not BatchNorm, not random numbers, the samples are the same: the loss or the model depends on how the batch "
            "is split (a mean over a varying number of items such as boxes or tokens, statistics over the batch)",
            "return (sum, count) from the loss for items; compute per-sample values otherwise")


def _all_samples(job: dict) -> list:
    return sorted(sample for call in job["samples"] for sample in call)


def _unused_row(base: dict, world: int, folder: Path, half: int) -> dict:
    """Parameters the first samples leave without a gradient, measured over the run: those still unchanged
    between the half-way checkpoint and the end never trained (a layer the forward never calls); those that
    changed are used by some batches only (a conditional branch), which trains."""
    from safetensors.torch import load_file

    name = "every parameter gets a gradient"
    unused = base["summary"].get("unused_parameters") or []
    if not unused:
        return row(name, PASS, "all parameters used by the first samples' backward pass", "")
    # A compiled model's checkpoint names its weights through the compile wrapper (`_orig_mod.`).
    halfway = {k.removeprefix("_orig_mod."): v for k, v in
               load_file(folder / "base" / "checkpoints" / f"step-{half:08d}" / "model.safetensors").items()}
    final = base["weights"]
    unknown = [n for n in unused if n not in halfway or n not in final]  # tied weights are stored once
    still = [n for n in unused if n not in unknown and torch.equal(halfway[n], final[n])]
    ddp = f"; {world} processes train with DDP's find_unused_parameters"
    if unknown and not still:
        return row(name, SKIPPED, f"{len(unused)} without a gradient from the first samples ({_names(unused)}); "
                                  f"{_names(unknown)} could not be compared (not in the saved files by that name){ddp}", "")
    if not still:
        return row(name, PASS, f"{len(unused)} without a gradient from the first samples ({_names(unused)}) but "
                               f"trained later (used by some batches only){ddp}", "")
    return row(name, FAIL, f"{len(still)} never trained ({_names(still)}): no gradient from the first samples and "
                           f"unchanged from step {half} to step {base['summary']['steps']}{ddp}",
               "a layer the forward never calls",
               "remove it, or freeze it (requires_grad=False), to train without find_unused_parameters")


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _samples_row(base, two, world) -> dict:
    name = "same start, same samples at every step"
    if two["error"]:
        return row(name, FAIL, two["error"], "the processes do not build the same data or model",
                   "build them from the seed only")
    different = [i for i, (a, b) in enumerate(zip(base["samples"], two["samples"])) if a != b]
    if different:
        return row(name, FAIL, f"{len(different)} of {len(base['samples'])} steps saw other samples on {world} "
                               f"processes than on 1 (first: step {different[0] + 1})",
                   "the data depends on the process: a random transform drawing from each process's generator, or a "
                   "dataset that reads other files per process", "make each sample a function of (seed, index) only")
    differed = any("initial weights differed" in note for note in two["summary"].get("notes") or [])
    return row(name, PASS, f"{len(base['samples'])} steps, identical samples" +
               ("; initial weights differed, process 0's were used" if differed else ""), "")


def _evaluation_row(base, two, world) -> dict:
    name = "evaluation counts every sample once"
    expected = base["summary"]["eval_samples"] if base["summary"]["eval"] else None
    if expected is None:
        return row(name, SKIPPED, "no evaluation set", "")
    if two["error"]:
        return row(name, FAIL, two["error"], "", "")
    counts = (base["summary"]["eval_samples"], two["summary"]["eval_samples"])
    ok = counts[0] == counts[1] == expected
    return row(name, PASS if ok else FAIL, f"{counts[0]} samples on 1 process, {counts[1]} on {world}",
               "" if ok else "padding counted")


def _resume_row(base, resumed, half) -> dict:
    name = f"stopped at step {half} and resumed"
    if resumed["error"]:
        return row(name, FAIL, resumed["error"], "", "")
    d = max_difference(base["weights"], resumed["weights"])
    if d == 0:
        return row(name, PASS, "bit-identical", "")
    return row(name, FAIL, f"max parameter difference {d:.1e}", *RESUME_CAUSE)


RESUME_CAUSE = ("random numbers drawn where a checkpoint cannot restore them: in a dataset's __getitem__ (the loader "
                "reads a batch ahead of the step a checkpoint records), from a generator of the dataset's own, or from "
                "NumPy/Python state seeded at import", "draw from torch's generator, or from one seeded per sample")


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


def _determinism_row(base, again) -> dict:
    d = max_difference(base["weights"], again["weights"])
    if d == 0:
        return row("the same run twice", PASS, "bit-identical", "")
    layer = max(base["weights"], key=lambda k: (base["weights"][k].double() - again["weights"][k].double())
                .abs().max().item())
    return row("the same run twice", FAIL, f"max parameter difference {d:.1e}, largest in {layer}",
               "a non-deterministic operation (atomic adds on GPUs, an unseeded random source)",
               "torch.use_deterministic_algorithms(True) names the operation")


def _batchnorm_rows(base, two, synced, has_bn, cfg, world) -> list[dict]:
    name = "BatchNorm across processes"
    if not has_bn:
        return [row(name, SKIPPED, "the model has no BatchNorm", "")]
    if cfg.sync_bn:
        return [row(name, PASS, "--sync-bn: statistics over all processes", "")]
    if not two["error"] and synced and not synced["error"]:
        d, ds = max_difference(base["weights"], two["weights"]), max_difference(base["weights"], synced["weights"])
        return [row(name, FAIL, f"{world} processes vs 1: {d:.1e} without --sync-bn, {ds:.1e} with it",
                    "each process normalises with its own share of the batch", "add --sync-bn")]
    return []


def row(check_name: str, result: str, measured: str, cause: str, fix: str = "") -> dict:
    return {"check": check_name, "result": result, "measured": measured, "cause": cause, "fix": fix}


def table(rows: list[dict]):
    from rich.table import Table

    out = Table(title="acc_trainer check", title_justify="left")
    for column in ("check", "result", "measured", "likely cause and fix"):
        out.add_column(column, overflow="fold")
    colours = {PASS: "green", FAIL: "bold red", SKIPPED: "yellow"}
    for r in rows:
        advice = "; ".join(x for x in (r["cause"], f"fix: {r['fix']}" if r["fix"] else "") if x)
        out.add_row(r["check"], f"[{colours[r['result']]}]{r['result']}[/]", r["measured"], advice)
    return out


def main(argv: list[str]) -> None:
    """`acc-trainer check [--steps N] [--faults [kill,stall]] [training options]`: exit 1 when a check fails."""
    from ..flags import Parser, add_training_options, config_from

    parser = Parser(prog="acc-trainer check", description="Run short versions of the job and print one row per "
                    "guarantee (2 processes vs 1, accumulation, samples, evaluation counts, resume, determinism); "
                    "exit 1 when one fails.")
    parser.add_argument("--steps", type=int, default=8, metavar="N",
                        help="optimizer steps of each short run, at least 2 (default: 8)")
    parser.add_argument("--faults", nargs="?", const=",".join(FAULTS), metavar="kill,stall",
                        help="instead of the guarantees: SIGKILL (kill) or SIGSTOP (stall) process 1 of the 2-process "
                             "job after its half-way checkpoint, measure the time until every process has ended, "
                             "resume it and compare bit for bit with the uninterrupted job (default: both faults; "
                             f"--hang-timeout sets the watchdog's bound, else 20 x the step time, at least {HANG_FLOOR:g} s)")
    add_training_options(parser, "every option of acc-trainer --help: the job to check (--output-dir keeps the "
                                 "runs' folders)")
    args = parser.parse_args(argv)
    cfg = config_from(args)
    output_dir, cfg = cfg.output_dir, replace(cfg, output_dir=None)
    faults = fault_names(args.faults, cfg)  # before the Checker makes its folder
    rows = Checker(cfg, _named_workload, args.steps, output_dir).run(faults)
    # A fault asked for and not injected proved nothing: that fails the command too.
    if any(r["result"] == FAIL or faults and r["result"] == SKIPPED for r in rows):
        sys.exit(1)
