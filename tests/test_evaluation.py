"""Evaluation that real tasks need, and the model after training: early stopping, `acc-trainer evaluate`
and `acc-trainer predict` (metrics with state on 1, 2 and 3 processes: tests/test_topology.py)."""

from __future__ import annotations

import shutil

from conftest import metrics, run_here, summary

# An MLP on the generated 10-class images whose evaluation cannot improve (lr 1e-9): the first evaluation is
# the best, and with --patience 2 the run stops after the third epoch (step 24 of 8 per epoch).
PLATEAU = ["--model", "mlp", "--dataset", "synthetic", "--train-size", "512", "--eval-size", "101", "--batch-size", "64",
           "--epochs", "20", "--lr", "1e-9", "--early-stop", "accuracy", "--patience", "2", "--progress", "none",
           "--no-plots", "--checkpoint-every", "epoch", "--save-best", "accuracy"]


def test_early_stopping_resumed_mid_patience_stops_where_the_whole_run_does(tmp_path):
    whole = tmp_path / "whole"
    assert run_here(*PLATEAU, "--output-dir", whole).returncode == 0
    stopped = summary(whole)["stopped_early"]
    assert stopped["step"] == 24 and stopped["epoch"] == 3 and stopped["metric"] == "accuracy"
    assert "did not improve by more than 0.0 for 2 evaluations" in stopped["reason"]
    assert summary(whole)["steps"] == 24 and (whole / "checkpoints" / "best").is_dir()  # with --save-best
    # The checkpoint of epoch 2 holds one evaluation without improvement; resumed from it, the run stops at the
    # same step (a run that forgot the count would go on to step 40).
    cut = tmp_path / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step-00000016", cut / "checkpoints" / "step-00000016")
    shutil.copytree(whole / "checkpoints" / "best", cut / "checkpoints" / "best")
    assert run_here(*PLATEAU, "--output-dir", cut, "--resume", "auto").returncode == 0
    assert summary(cut)["stopped_early"] == stopped and summary(cut)["steps"] == 24
    assert [r["step"] for r in metrics(cut) if "eval_accuracy" in r] == [24]


def test_early_stop_naming_a_metric_the_run_does_not_compute_is_one_line(tmp_path):
    result = run_here(*PLATEAU[:-4], "--early-stop", "f1", "--output-dir", tmp_path / "never")
    assert result.returncode == 2
    assert result.stderr.strip() == "acc-trainer: error: --early-stop f1: the run evaluates loss, accuracy"
    assert not (tmp_path / "never").exists()
