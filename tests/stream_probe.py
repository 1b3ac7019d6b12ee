"""Runs a list of fit() jobs on streams in one launch of 1, 2 or 3 processes (see topology_probe.py).

    accelerate launch --multi_gpu --num_processes 2 tests/stream_probe.py JOBS.json OUT_DIR
    stream_probe.run_jobs(JOBS, OUT_DIR)                      (1 process: the test's own)

A job: {"name", "data": a streams_data kind, "parquet": the folder of its files, "options": fit options,
"resume": a checkpoint folder (of any run, of any number of processes) or absent}. The run folder is
OUT_DIR/<name>; a run stopped by acc_trainer (TrainingStopped) writes OUT_DIR/<name>.stopped.json with its
message and exit code on the main process (a ConfigError too, with code 2), and the next job runs. A job with
"inference": true evaluates and predicts with acc_trainer.after_training.inference on the evaluation set instead
(OUT_DIR/<name>.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import streams_data
from accelerate.state import PartialState
from topology_probe import fresh_state, launched

from acc_trainer import fit
from acc_trainer.config import ConfigError
from acc_trainer.stopping import TrainingStopped


def run_job(job: dict, out: Path) -> None:
    train, eval_ = streams_data.datasets(job["data"], Path(job.get("parquet") or "."))
    if job.get("inference"):  # the finished model's evaluation and predictions on the evaluation set
        from acc_trainer.after_training.inference import evaluate, predict

        collate = streams_data.collate(job["data"])
        options = {"progress": "none", "batch_size": 12, "eval_batch_size": 4, "output_dir": str(out / job["name"])}
        results = evaluate(streams_data.model(), eval_, loss="mse", collate_fn=collate, **options)
        rows = predict(streams_data.model(), eval_, collate_fn=collate, **options)
        if PartialState().is_main_process:
            (out / f"{job['name']}.json").write_text(json.dumps({"evaluate": results, "predict": rows}))
        return
    options = {"progress": "none", "plots": False, "optimizer": "sgd", "lr": 0.05, "scheduler": "constant",
               **job.get("options", {}), "output_dir": str(out / job["name"])}
    if job.get("resume"):
        options["resume"] = job["resume"]
    produced = streams_data.Numbers.produced
    try:
        fit(streams_data.model(job["data"]), train, eval_, collate_fn=streams_data.collate(job["data"]), **options)
    except (TrainingStopped, ConfigError) as e:
        if PartialState().is_main_process:
            (out / f"{job['name']}.stopped.json").write_text(json.dumps({"message": str(e),
                                                                        "code": getattr(e, "code", 2)}))
        return
    if PartialState().is_main_process:
        (out / job["name"] / "produced.json").write_text(json.dumps(streams_data.Numbers.produced - produced))


def run_jobs(jobs: list[dict], out: Path) -> None:
    for job in jobs:
        fresh_state()
        run_job(job, out)
        PartialState().wait_for_everyone()


if __name__ == "__main__":
    launched(run_jobs)
