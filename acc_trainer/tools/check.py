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

This module runs the jobs and holds the command; the rows are judged in check_rows.py (the fault rows in
check_faults.py, which also injects the faults), and check_samples.py holds the hooks that record what each step saw.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from ..config import ConfigError, TrainConfig, first_line
from .check_faults import FAULTS, HANG_FLOOR, SLACK, Fault, _faulted, _resumed_row, _stop_row, fault_names
from .check_rows import FAIL, SKIPPED, rows_for, table
from .check_samples import _recorder


def check(model, train_data, eval_data=None, *, loss=None, metrics=None, collate_fn=None, forward=None,
          config: TrainConfig | None = None, steps: int = 8, output_dir: str | None = None, faults=False,
          **options) -> list[dict]:
    """Checks a user's workload, given as to `fit`. Prints the table; returns its rows (dicts with
    check, result, measured, cause, fix). `output_dir` keeps the short runs (else they are removed).
    `faults`: True (or names from FAULTS: "kill", "stall") for the fault rows instead of the guarantees;
    `hang_timeout=S` sets the watchdog's bound for them."""
    from ..training.api import fit_config
    from ..workload.components import from_objects

    tokenizer = options.pop("tokenizer", None)  # a tokenizer object goes with the workload, a name in the config
    if isinstance(tokenizer, str):
        options["tokenizer"], tokenizer = tokenizer, None
    cfg = replace(fit_config(model, train_data, config, options, collate_fn, forward), output_dir=None)
    # One thread per process: this process may have run OpenMP work already (building the data, say),
    # and GNU OpenMP's thread pool does not survive a fork: a forked child that uses it hangs.
    names = fault_names(faults, cfg)  # before the Checker makes its folder
    return Checker(cfg, lambda cfg: from_objects(model, train_data, eval_data, loss, metrics, collate_fn or cfg.collate,
                                                 forward or cfg.forward, cfg.pack, cfg.data_pipeline, cfg,
                                                 tokenizer),
                   steps, output_dir, threads=1).run(names)


def _named_workload(cfg: TrainConfig):
    """The workload `cfg` names, built in a job's process (after its process group is formed: the main process
    reads or downloads the data first)."""
    from accelerate.utils import set_seed

    from ..workload.components import build_workload

    set_seed(cfg.seed)
    return build_workload(cfg)


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


def _has_batchnorm(folder: Path) -> bool:
    from safetensors.torch import load_file

    return any(name.endswith("running_mean") for name in load_file(folder / "model.safetensors"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    if "max_steps" in args:  # each short run is --steps long: a --max-steps would be ignored without a word
        raise ConfigError(f"acc-trainer check runs --steps optimizer steps per short run (default 8): give --steps "
                          f"{args.max_steps}, not --max-steps")
    cfg = config_from(args)
    output_dir, cfg = cfg.output_dir, replace(cfg, output_dir=None)
    faults = fault_names(args.faults, cfg)  # before the Checker makes its folder
    rows = Checker(cfg, _named_workload, args.steps, output_dir).run(faults)
    # A fault asked for and not injected proved nothing: that fails the command too.
    if any(r["result"] == FAIL or faults and r["result"] == SKIPPED for r in rows):
        sys.exit(1)
