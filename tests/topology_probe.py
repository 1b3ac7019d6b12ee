"""Runs a list of jobs in one launch of 1, 2 or 3 processes, through acc_trainer's own code.

    python tests/topology_probe.py JOBS.json OUT_DIR                       (1 process)
    accelerate launch --multi_gpu --num_processes 2 tests/topology_probe.py JOBS.json OUT_DIR
    topology_probe.run_jobs(JOBS, OUT_DIR)                                 (1 process: the test's own)

One launch runs many jobs because starting processes costs more than these small jobs. Jobs:
  train:     acc_trainer.training.api.train(options); the run folder is OUT_DIR/<name>
  order:     which sample indices every optimizer step of the training loader sees, over 2 epochs
  eval:      acc_trainer.training.evaluation.evaluate over eval sets of several sizes and batch sizes, with metrics with state
  allreduce: a train job that also counts DDP's gradient all-reduces (bucket hooks)
  disagree:  the trainer's rank-agreement check on weights changed on process 1 only
  mainfails: runs that an OSError on the main process stops at each place the others wait for it (MAIN_FAILS), each
             process's error and how long it took
The main process writes OUT_DIR/<name>.json for the jobs other than train.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from torch.utils.data import TensorDataset

from acc_trainer.config import make_config
from acc_trainer.data.datasets import Data
from acc_trainer.data.kinds import settle
from acc_trainer.data.loaders import build_loaders, dataloader_config
from acc_trainer.distributed.processes import ranks_agree
from acc_trainer.training.api import train
from acc_trainer.training.evaluation import evaluate
from acc_trainer.workload.components import build_data, build_model
from acc_trainer.workload.losses import cross_entropy
from acc_trainer.workload.metrics import AUROC, F1, METRICS, Confusion, Precision, Recall


def fresh_state() -> None:
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def run_train(job: dict, out: Path) -> None:
    # No figures: nothing here looks at them, and drawing them costs more than these small runs train.
    train(make_config({"progress": "none", "plots": False, **job["options"], "output_dir": str(out / job["name"])}))


def run_order(job: dict) -> dict:
    """Sample indices per optimizer step, from the trainer's own loaders and Accelerate config."""
    cfg = make_config(job["options"])
    accelerator = Accelerator(cpu=True, dataloader_config=dataloader_config(cfg),
                              gradient_accumulation_steps=cfg.grad_accum)
    n = cfg.train_size
    indices = TensorDataset(torch.arange(n), torch.zeros(n))
    data = settle(Data(indices, indices, "regression", None, (1,)), cfg.data_pipeline)
    loader = accelerator.prepare(build_loaders(cfg, data, accelerator.num_processes, accelerator.device)[0])
    epochs = []
    for _ in range(cfg.epochs):
        steps, current = [], []
        for ids, _ in loader:
            current += accelerator.gather(ids).tolist()
            if len(current) == cfg.batch_size:
                steps.append(current)
                current = []
        epochs.append(steps)
    return {"epochs": epochs}


def run_eval(job: dict) -> dict:
    """Metrics of one fixed model on eval sets whose sizes do not divide by processes x batch."""
    results = {}
    for size in job["sizes"]:
        for batch in job["batches"]:
            fresh_state()
            cfg = make_config({"model": "mlp", "eval_size": size, "train_size": 64, "batch_size": 6,
                               "eval_batch_size": batch})
            accelerator = Accelerator(cpu=True, dataloader_config=dataloader_config(cfg))
            data = build_data(cfg)
            torch.manual_seed(0)
            model = build_model(cfg, data)
            _, eval_loader = build_loaders(cfg, data, accelerator.num_processes, accelerator.device)
            model, eval_loader = accelerator.prepare(model, eval_loader)
            results[f"{size}/{batch}"] = evaluate(accelerator, model, eval_loader, cross_entropy,
                                                  stateful_metrics(data.num_classes), tables={"confusion": Confusion(10)})
    return results


def stateful_metrics(classes: int) -> dict:
    """Accuracy (a mean of per-sample values), the built-in metrics with state, and torchmetrics' macro F1."""
    from torchmetrics.classification import MulticlassF1Score

    return {"accuracy": METRICS["accuracy"], "f1": F1(classes), "precision": Precision(classes),
            "recall": Recall(classes), "auroc": AUROC(classes),
            "tm_f1": MulticlassF1Score(num_classes=classes, average="macro")}


def run_disagree(job: dict) -> dict:
    """The trainer's report of the processes' weights (summary.json's ranks_agree), on weights that differ on
    one process only, as DDP-wrapped models are at the end of a run."""
    accelerator = Accelerator(cpu=True)
    cfg = make_config({"model": "mlp"})
    model = accelerator.prepare(build_model(cfg, build_data(cfg)))
    same = ranks_agree(accelerator, model)
    if accelerator.process_index == 1:
        with torch.no_grad():
            accelerator.unwrap_model(model).fc2.bias[0] += 1e-6
    return {"same": same, "different": ranks_agree(accelerator, model)}


def run_allreduce(job: dict, out: Path) -> dict:
    """Counts DDP's gradient all-reduces (one call per bucket and synchronisation)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = [0]

    def counting_hook(state, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    original = Accelerator.prepare_model

    def prepare_model(self, model, *args, **kwargs):
        model = original(self, model, *args, **kwargs)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.register_comm_hook(None, counting_hook)
        return model

    Accelerator.prepare_model = prepare_model
    try:
        run_train(job, out)
    finally:
        Accelerator.prepare_model = original
    return {"allreduce_calls": calls[0]}


# Each place where the main process computes and the others wait: what raises there, on the main process only, and the
# run that reaches it (fit's options; "find" runs find_lr).
MAIN_FAILS = {
    "run folder's name": ("acc_trainer.outputs.runfiles._unused", {"output_dir": None}),
    "folder in use": ("acc_trainer.outputs.runfiles.check_not_in_use", {}),
    "folder's lock": ("acc_trainer.outputs.run_folder.lock_run_folder", {}),
    "checkpoint to resume": ("acc_trainer.outputs.checkpoints._chosen", {"resume": "auto"}),
    "trackers' start": ("acc_trainer.outputs.trackers.start", {"log_with": "tensorboard"}),
    "micro-batch try": ("acc_trainer.training.micro_batch._fits", {"micro_batch": "auto"}),
    "recorded learning rate": ("acc_trainer.training.lr_range.recorded_suggestion", {"lr": "find", "resume": "auto"}),
    "range test's figure": ("acc_trainer.training.lr_range.draw", {"lr": "find"}),
}


def run_mainfails(job: dict, out: Path) -> list:
    """Every process's error at each place of MAIN_FAILS (process 0's an OSError), and its seconds."""
    import importlib
    import time
    from unittest import mock

    from acc_trainer import fit

    state, mine = PartialState(cpu=True), {}  # the group every run of the launch joins
    cfg = make_config({"model": "mlp", "train_size": 64, "eval_size": 16, "batch_size": 8})
    data = build_data(cfg)
    for place, (target, options) in MAIN_FAILS.items():
        fresh_state()
        module, _, name = target.rpartition(".")
        original = getattr(importlib.import_module(module), name)

        def fails(*args, _place=place, _original=original, **kwargs):
            if state.is_main_process:
                raise OSError(f"injected at the {_place}")
            return _original(*args, **kwargs)

        torch.manual_seed(0)
        model = build_model(cfg, data)
        options = {"output_dir": str(out / "mainfails" / place.replace(" ", "_").replace("'", "")), "batch_size": 8,
                   "epochs": 1, "progress": "none", "plots": False, "dist_timeout": 60, "seed": 0, **options}
        since = time.perf_counter()
        try:
            with mock.patch(target, fails):
                if options.get("lr") == "find" and "resume" not in options:
                    options.pop("lr")
                    from acc_trainer import find_lr

                    find_lr(model, data.train, steps=10, **options)
                else:
                    fit(model, data.train, data.eval, **options)
            mine[place] = {"error": None}
        except Exception as e:
            mine[place] = {"error": type(e).__name__, "message": str(e)}
        mine[place]["seconds"] = time.perf_counter() - since
    from accelerate.utils import gather_object

    return gather_object([mine])


def run_jobs(jobs: list[dict], out: Path) -> None:
    """Every job, one after another, in this process (of a launch, or a test's own for 1 process)."""
    for job in jobs:
        fresh_state()
        kind = job["kind"]
        if kind == "train":
            run_train(job, out)
            continue
        if kind == "allreduce":
            result = run_allreduce(job, out)
        elif kind == "mainfails":
            result = run_mainfails(job, out)
        else:
            result = {"order": run_order, "eval": run_eval, "disagree": run_disagree}[kind](job)
        if PartialState().is_main_process:
            (out / f"{job['name']}.json").write_text(json.dumps(result))
        PartialState().wait_for_everyone()


def launched(run: Callable[[list[dict], Path], None]) -> None:
    """`run(JOBS, OUT_DIR)` from the command line in a launch, then out of the process without its teardown."""
    # One process group serves every job of the launch; a fresh Accelerator per job.
    PartialState.destroy_process_group = lambda self, group=None: None
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
    # torch 2.14's gloo sometimes aborts a finished multi-process script at interpreter exit ("terminate
    # called without an active exception", SIGABRT), after every result is written: leave without the
    # teardown, so that the launcher reports what the jobs did, not that.
    PartialState().wait_for_everyone()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    launched(run_jobs)
