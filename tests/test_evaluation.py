"""Evaluation that real tasks need, and the model after training: early stopping, `acc-trainer evaluate`
and `acc-trainer predict` (metrics with state on 1, 2 and 3 processes: tests/test_topology.py)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import forked, metrics, run_here, summary

# An MLP on the generated 10-class images whose evaluation cannot improve (lr 1e-9): the first evaluation is
# the best, and with --patience 2 the run stops after the third epoch (step 24 of 8 per epoch).
PLATEAU = ["--model", "mlp", "--dataset", "synthetic", "--train-size", "512", "--eval-size", "101", "--batch-size", "64",
           "--epochs", "20", "--lr", "1e-9", "--early-stop", "accuracy", "--patience", "2", "--progress", "none",
           "--no-plots", "--checkpoint-every", "epoch", "--save-best", "accuracy"]


def test_early_stopping_resumed_mid_patience_stops_where_the_whole_run_does(tmp_path):
    whole = tmp_path / "whole"
    done = run_here(*PLATEAU, "--output-dir", whole)
    # --progress none hides the progress, not the result (it hid both); the summary counts the epochs trained (3, not 20)
    assert done.returncode == 0 and done.stdout.startswith("final eval loss") and done.stdout.count("\n") == 1
    stopped = summary(whole)["stopped_early"]
    assert stopped["step"] == 24 and stopped["epoch"] == 3 and stopped["metric"] == "accuracy"
    assert summary(whole)["epochs"] == 3
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


def test_a_checkpoint_written_before_the_newer_options_still_resumes(tmp_path):
    """Options added since a checkpoint was written count as their defaults when the checkpoint lacks them."""
    run = tmp_path / "run"
    options = [*PLATEAU[:10], "--epochs", "2", "--checkpoint-every", "epoch", "--output-dir", run, "--progress", "none",
               "--no-plots"]
    assert run_here(*options, "--early-stop", "accuracy", "--patience", "2").returncode == 0
    state_file = run / "checkpoints" / "step-00000008" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for key in ("early_stop", "patience", "min_delta", "init_from", "init_strict", "pretrained", "freeze",
                "param_groups", "layer_decay", "collate", "forward"):
        state["config"].pop(key)
    state_file.write_text(json.dumps(state))
    (state_file.parent / "SHA256SUMS").unlink()  # written before checksums, too: read only when accepted as such
    shutil.rmtree(run / "checkpoints" / "step-00000016")
    resumed = run_here(*options, "--resume", str(run / "checkpoints" / "step-00000008"), "--accept-unverified")
    assert resumed.returncode == 0, resumed.stderr


def test_early_stop_naming_a_metric_the_run_does_not_compute_is_one_line(tmp_path):
    result = run_here(*PLATEAU[:-4], "--early-stop", "f1", "--output-dir", tmp_path / "never")
    assert result.returncode == 2
    assert result.stderr.strip() == "acc-trainer: error: --early-stop f1: the run evaluates loss, accuracy"
    assert not (tmp_path / "never").exists()


# ----------------------------------------------------------------------------------------- evaluate and predict

# Label smoothing: `evaluate` on the run scores with the loss the run evaluated with.
RUN = ["--model", "mlp", "--dataset", "synthetic", "--train-size", "512", "--eval-size", "101", "--batch-size", "64",
       "--epochs", "2", "--metrics", "accuracy,f1,auroc,precision,recall", "--progress", "none", "--label-smoothing", "0.1"]
def _evaluated_from_python(run: Path, out: Path) -> None:
    """In each of several processes: acc_trainer.evaluate and predict on the run's model, as a user's script calls
    them; the main process writes OUT/results.json."""
    from safetensors.torch import load_file

    import acc_trainer
    from acc_trainer.config import make_config
    from acc_trainer.workload.components import build_data, build_model

    cfg = make_config({"model": "mlp", "dataset": "synthetic", "train_size": 512, "eval_size": 101})
    data = build_data(cfg)
    model = build_model(cfg, data)
    model.load_state_dict(load_file(run / "model.safetensors"))
    results = acc_trainer.evaluate(model, data.eval, metrics=["accuracy", "f1", "auroc", "precision", "recall"],
                                   eval_batch_size=7, label_smoothing=0.1)  # as the run was trained and evaluated
    written = acc_trainer.predict(model, data.eval, output=out / "predictions.jsonl", eval_batch_size=7)
    rows = acc_trainer.predict(model, data.eval, eval_batch_size=5)
    if torch.distributed.get_rank() == 0:
        (out / "results.json").write_text(json.dumps({"results": results, "rows": rows, "written": str(written)}))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished classification run with metrics with state, its plots drawn."""
    out = tmp_path_factory.mktemp("finished") / "run"
    result = run_here(*RUN, "--output-dir", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _model_outputs(run, train_size: int = 512):
    """The run's model called on each evaluation sample alone, in the test's own process (`train_size`: the
    synthetic set's, which draws its evaluation samples after the training ones)."""
    from safetensors.torch import load_file

    from acc_trainer.config import make_config
    from acc_trainer.workload.components import build_data, build_model

    cfg = make_config({"model": "mlp", "dataset": "synthetic", "train_size": train_size, "eval_size": 101})
    data = build_data(cfg, trains=False)
    model = build_model(cfg, data).eval()
    model.load_state_dict(load_file(run / "model.safetensors"))
    with torch.no_grad():
        return [model(data.eval[i][0][None])[0] for i in range(len(data.eval))]


def test_a_classification_run_records_its_confusion_matrix_and_per_class_table(finished):
    s = summary(finished)
    matrix = s["confusion_matrix"]
    assert len(matrix) == 10 and sum(map(sum, matrix)) == 101 == s["eval_samples"]
    assert sum(matrix[i][i] for i in range(10)) / 101 == pytest.approx(s["eval"]["accuracy"])
    f1 = [c["f1"] for c in s["per_class"].values()]
    assert s["eval"]["f1"] == pytest.approx(sum(f1) / len(f1))  # every class occurs in these 101 samples
    assert (finished / "plots" / "confusion.png").stat().st_size > 10_000
    report = run_here("report", finished, "--output", finished.parent / "report.png")
    assert report.returncode == 0 and "f1 0." in report.stdout and "auroc 0." in report.stdout


def test_evaluate_gives_the_runs_final_numbers(finished, tmp_path):
    result = run_here("evaluate", finished, "--eval-batch-size", "7", f"--output={tmp_path / 'eval.json'}")
    assert result.returncode == 0, result.stderr[-3000:]
    got, s = json.loads((tmp_path / "eval.json").read_text()), summary(finished)
    for name, value in s["eval"].items():
        assert got[name] == pytest.approx(value, abs=1e-6), name  # the loss: float32 sums over other batches
    assert got["samples"] == 101 and got["confusion_matrix"] == s["confusion_matrix"]
    assert "on 101 samples" in result.stdout


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".npz"])
def test_predict_writes_one_row_per_sample_in_order(finished, tmp_path, suffix):
    out = tmp_path / f"predictions{suffix}"
    result = run_here("predict", finished, "--output", out, "--eval-batch-size", "6")
    assert result.returncode == 0, result.stderr[-3000:]
    if suffix == ".jsonl":
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        index, classes, outputs = [r["index"] for r in rows], [r["class"] for r in rows], [r["output"] for r in rows]
    elif suffix == ".csv":
        lines = list(csv.reader(out.read_text().splitlines()))
        assert lines[0][:3] == ["index", "class", "output_0"]
        index, classes = [int(r[0]) for r in lines[1:]], [int(r[1]) for r in lines[1:]]
        outputs = [[float(v) for v in r[2:]] for r in lines[1:]]
    else:
        arrays = np.load(out)
        index, classes, outputs = arrays["index"].tolist(), arrays["class"].tolist(), arrays["output"].tolist()
    assert index == list(range(101))
    expected = _model_outputs(finished)
    for i, value in enumerate(expected):
        assert outputs[i] == pytest.approx(value.tolist(), abs=1e-5) and classes[i] == int(value.argmax())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".predict-")]  # its temporary folder is gone


def test_predict_and_evaluate_read_a_set_whose_training_split_is_smaller_than_a_batch(finished, tmp_path):
    """The run trained with batches of 64; predicting and evaluating on the evaluation split of a set whose training
    split holds 16 samples read that split only (they used to be refused: "the training set ... has 16 samples, fewer
    than one global batch")."""
    out = tmp_path / "rows.jsonl"
    result = run_here("predict", finished, "--train-size", "16", "--output", out)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(101))
    for row, value in zip(rows, _model_outputs(finished, train_size=16), strict=True):
        assert row["output"] == pytest.approx(value.tolist(), abs=1e-5)
    result = run_here("evaluate", finished, "--train-size", "16")
    assert result.returncode == 0 and "(eval): " in result.stdout and "on 101 samples" in result.stdout, result.stderr


@pytest.mark.parametrize("world", [2, 3])
def test_evaluate_and_predict_from_python_on_several_processes(finished, tmp_path, world):
    """acc_trainer.evaluate and acc_trainer.predict on 2 and 3 processes (forked from this one), with evaluation
    batches (7 and 5 per process) that leave the last global batch padded."""
    forked(_evaluated_from_python, finished, tmp_path, processes=world)
    got = json.loads((tmp_path / "results.json").read_text())
    s = summary(finished)
    for name, value in s["eval"].items():
        assert got["results"][name] == pytest.approx(value, abs=1e-6), name
    assert got["results"]["samples"] == 101
    written = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [r["index"] for r in written] == [r["index"] for r in got["rows"]] == list(range(101))
    expected = _model_outputs(finished)
    for row, other, value in zip(written, got["rows"], expected):
        assert row["output"] == pytest.approx(value.tolist(), abs=1e-5) and row["class"] == other["class"]


def test_bad_input_after_training_is_one_line(finished, tmp_path):
    (tmp_path / "no_weights").mkdir()
    for name in ("config.yaml", "SHA256SUMS"):  # a run's options, verified, without its weights
        shutil.copy(finished / name, tmp_path / "no_weights" / name)
    cases = [
        (["evaluate", tmp_path / "no_weights"], "model.safetensors does not exist (a run writes model.safetensors when "
                                                "it finishes); give --weights FILE: never an evaluation of random weights"),
        (["predict", finished, "--output", tmp_path / "p.parquet"],
         "acc-trainer predict needs --output FILE with a suffix of .jsonl, .csv, .npz, not '.parquet'"),
        (["evaluate", tmp_path], "holds no config.yaml: not the folder of an acc_trainer run"),
        (["evaluate", finished, "--weights", finished / "config.yaml"], "do not load into mlp"),
    ]
    for args, message in cases:
        result = run_here(*args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], (args, result.stderr)
    assert not (tmp_path / "p.parquet").exists()


def test_a_metric_object_without_compute_is_one_line(tmp_path):
    import acc_trainer

    class Half:
        def update(self, preds, target):
            pass

    train = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    with pytest.raises(acc_trainer.ConfigError, match="fit: metric half is a Half without update, compute and reset"):
        acc_trainer.fit(torch.nn.Linear(16, 4), train, train, metrics={"half": Half()}, batch_size=32,
                        output_dir=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_iou_of_segmentation_outputs_over_batches():
    """`iou` sums intersections and unions per class over the batches (labels of -100 left out)."""
    from acc_trainer.workload.metrics import IoU

    g = torch.Generator().manual_seed(0)
    scores, targets = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 3, (6, 8, 8), generator=g)
    targets[0, :2] = -100
    metric = IoU.for_outputs(scores, targets)
    metric.update(scores[:4], targets[:4])
    metric.update(scores[4:], targets[4:])
    predicted, keep = scores.argmax(1), targets != -100
    expected = [((predicted == c) & (targets == c) & keep).sum().double() / (((predicted == c) | (targets == c)) & keep).sum()
                for c in range(3)]
    assert metric.compute(metric.sums, None) == pytest.approx(float(sum(expected) / 3), abs=1e-12)


def test_binary_auroc_counts_ties_half_as_scikit_learn_does():
    """Two classes (or one logit per sample), with tied scores, over batches."""
    from sklearn.metrics import roc_auc_score

    from acc_trainer.workload.metrics import AUROC

    g = torch.Generator().manual_seed(1)
    logits = torch.randint(-3, 4, (200,), generator=g).float()  # few distinct values: many ties
    labels = (torch.rand(200, generator=g) < torch.sigmoid(logits)).long()
    for outputs in (logits[:, None], torch.stack([torch.zeros(200), logits], 1)):
        metric = AUROC.for_outputs(outputs, labels)
        metric.update(outputs[:77], labels[:77])
        metric.update(outputs[77:], labels[77:])
        assert metric.compute(None, torch.cat(metric.rows)) == pytest.approx(roc_auc_score(labels, logits), abs=1e-12)
    # Far apart logits: probabilities computed in float32 would both be 1.0 and tie.
    scores, labels = torch.tensor([[0.0, 20.0], [0.0, 25.0]]), torch.tensor([0, 1])
    metric = AUROC.for_outputs(scores, labels)
    metric.update(scores, labels)
    assert metric.compute(None, torch.cat(metric.rows)) == 1.0


def test_best_means_one_thing_everywhere(tmp_path, capsys, torch_on_one_thread):
    """With --save-best loss, the best checkpoint, summary.json, the end-of-run table and `acc-trainer report`
    name the same evaluation, even when another metric peaks elsewhere (here an "accuracy" that falls at every
    evaluation while the loss falls too)."""
    from conftest import reset_accelerate

    import acc_trainer
    from acc_trainer.tools.report import report

    calls = []

    def falling(outputs, targets):
        calls.append(1)
        return torch.full((len(targets),), 1.0 / len(calls))

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    y = (x[:, 0] > 0).long()
    data = torch.utils.data.TensorDataset(x, y)
    reset_accelerate()
    acc_trainer.set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    s = acc_trainer.fit(model, data, data, metrics={"accuracy": falling}, epochs=3, batch_size=64, eval_batch_size=256,
                        optimizer="sgd", lr=0.1, save_best="loss", progress="plain", plots=False,
                        output_dir=str(tmp_path / "run"))
    reset_accelerate()
    printed = capsys.readouterr().out
    losses = {e["step"]: e["loss"] for e in s["evals"]}
    by_loss = min(losses, key=losses.get)
    by_accuracy = max(s["evals"], key=lambda e: e["accuracy"])["step"]
    assert by_loss != by_accuracy  # so "the best" of the two measures differ
    kept = json.loads((tmp_path / "run" / "checkpoints" / "best" / "trainer_state.json").read_text())["step"]
    assert s["best"] == {"step": by_loss, "metric": "loss", "value": losses[by_loss]} and kept == by_loss
    row = next(line for line in printed.splitlines() if "best evaluation" in line)
    assert f"loss {losses[by_loss]:.4g} at step {by_loss}" in row
    table = report([tmp_path / "run"], ["run"], tmp_path / "report.png")
    assert table.columns[8]._cells == [f"loss {losses[by_loss]:.4g} @ {by_loss}"]


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_and_predict_leave_the_model_in_its_mode(training):
    """The caller's model comes back from `evaluate` and `predict` in the mode it was given in (they used to leave it in
    training mode: dropout on in the caller's next forward pass)."""
    import acc_trainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)).train(training)
    data = torch.utils.data.TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,)))
    results = acc_trainer.evaluate(model, data, batch_size=4, progress="none")
    assert results["samples"] == 20 and model.training is training and model[1].training is training
    rows = acc_trainer.predict(model, data, batch_size=4, progress="none")
    assert len(rows) == 20 and model.training is training and model[1].training is training
