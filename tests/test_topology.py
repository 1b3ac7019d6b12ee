"""Same computation on every topology: 1 vs 2 (vs 3) processes, accumulation, precision, evaluation.

The jobs run through tests/topology_probe.py: once with 1 process (the test's own), once on 2 and once on 3
processes forked from it (conftest.forked: gloo on the CPU). Each comparison below would catch a
broken gradient sync, a double-counted or dropped sample, a wrong accumulation scale or ranks
that drift apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import forked, metrics, one_thread, reset_accelerate, summary
from safetensors.torch import load_file

BASE = {"train_size": 1024, "eval_size": 256, "batch_size": 64, "epochs": 2, "max_steps": 24, "log_every": 4}
SGD = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
# AdamW with the parts of the loop that also depend on counting steps right: warmup, cosine decay, clipping.
ADAMW = {"optimizer": "adamw", "lr": 2e-3, "weight_decay": 0.01, "scheduler": "cosine", "warmup_steps": 5,
         "max_grad_norm": 1.0}
RUNS = {
    "sgd_mlp": {**BASE, **SGD, "model": "mlp"},
    "adamw_mlp": {**BASE, **ADAMW, "model": "mlp"},
    # At lr 0.05 LeNet+SGD is chaotic here: 1 process with and without accumulation (a different
    # summation order, no DDP) already end 3e-4 apart. 0.02 is the largest that stays stable.
    "sgd_lenet": {**BASE, **SGD, "model": "lenet", "nesterov": True, "lr": 0.02},
    "adamw_lenet": {**BASE, **ADAMW, "model": "lenet"},
}
BN = {"model": "convnet", "train_size": 256, "eval_size": 64, "batch_size": 64, "max_steps": 1, "optimizer": "sgd",
      "lr": 0.1}
ORDER = {"train_size": 200, "batch_size": 32, "grad_accum": 2, "epochs": 2}
EVAL = {"sizes": [97, 1001], "batches": [1, 16, 64]}
# Early stopping on a loss that improves by less than --min-delta after a few epochs of SGD.
EARLY = {**BASE, **SGD, "model": "mlp", "lr": 0.05, "epochs": 30, "max_steps": None, "train_size": 384,
         "batch_size": 96, "early_stop": "loss", "patience": 2, "min_delta": 0.015}  # 96: 2 and 3 processes


def _train(name, **options):
    return {"kind": "train", "name": name, "options": options}


ONE_PROCESS = [
    *[_train(name, **options) for name, options in RUNS.items()],
    _train("sgd_mlp_accum4", **RUNS["sgd_mlp"], grad_accum=4),
    _train("sgd_mlp_again", **RUNS["sgd_mlp"]),
    _train("sgd_mlp_bf16", **RUNS["sgd_mlp"], mixed_precision="bf16"),
    _train("convnet", **BN),
    _train("early", **EARLY),
    {"kind": "order", "name": "order", "options": ORDER},
    {"kind": "eval", "name": "eval", **EVAL},
]
TWO_PROCESSES = [
    *[_train(name, **options) for name, options in RUNS.items()],
    _train("sgd_mlp_accum2", **RUNS["sgd_mlp"], grad_accum=2),
    _train("convnet_sync_bn", **BN, sync_bn=True),
    _train("convnet", **BN),
    {"kind": "allreduce", "name": "allreduce_accum1", "options": {**RUNS["sgd_mlp"], "max_steps": 8}},
    {"kind": "allreduce", "name": "allreduce_accum4", "options": {**RUNS["sgd_mlp"], "max_steps": 8, "grad_accum": 4}},
    {"kind": "order", "name": "order", "options": ORDER},
    {"kind": "eval", "name": "eval", **EVAL},
    {"kind": "disagree", "name": "disagree"},
    _train("early", **EARLY),
    {"kind": "mainfails", "name": "mainfails"},
]
THREE_PROCESSES = [{"kind": "eval", "name": "eval", **EVAL}, _train("early", **EARLY)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    """Folder of each launch's results, by number of processes. The 1-process jobs run in this process
    (on one thread, as a launched process runs), the others on 2 and on 3 processes forked from it."""
    import topology_probe

    folders = {}
    for world, jobs in ((1, ONE_PROCESS), (2, TWO_PROCESSES), (3, THREE_PROCESSES)):
        folder = tmp_path_factory.mktemp(f"world{world}")
        (folder / "jobs.json").write_text(json.dumps(jobs))
        if world == 1:
            reset_accelerate()
            try:
                with one_thread():
                    topology_probe.run_jobs(jobs, folder)
            finally:
                reset_accelerate()
        else:
            forked(topology_probe.run_jobs, jobs, folder, processes=world)
        folders[world] = folder
    return folders


def max_difference(run_a: Path, run_b: Path) -> float:
    a, b = load_file(run_a / "model.safetensors"), load_file(run_b / "model.safetensors")
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_end_with_the_parameters_of_one(runs, name):
    one, two = runs[1] / name, runs[2] / name
    assert (summary(one)["world_size"], summary(two)["world_size"]) == (1, 2)
    assert summary(one)["steps"] == summary(two)["steps"] == 24  # 16 steps per epoch: the run crosses an epoch
    difference = max_difference(one, two)
    print(f"{name}: max |1 process - 2 processes| = {difference:.2e}")
    assert difference <= 1e-5
    assert summary(two)["ranks_agree"] is True
    # The weights really moved, by far more than the tolerance: this is not two untrained models.
    assert max_difference_from_initial(one, RUNS[name]) > 100 * 1e-5


def max_difference_from_initial(run: Path, options: dict) -> float:
    from accelerate.utils import set_seed

    from acc_trainer.config import make_config
    from acc_trainer.workload.components import build_data, build_model

    cfg = make_config(options)
    set_seed(cfg.seed)  # as the trainer does before building the model
    initial = build_model(cfg, build_data(cfg)).state_dict()
    final = load_file(run / "model.safetensors")
    return max((final[k] - initial[k]).abs().max().item() for k in final)


def test_accumulation_gives_the_same_steps(runs):
    reference = runs[1] / "sgd_mlp"
    accum4 = max_difference(reference, runs[1] / "sgd_mlp_accum4")
    accum2_two_processes = max_difference(reference, runs[2] / "sgd_mlp_accum2")
    print(f"grad-accum 4 vs none: {accum4:.2e}; 2 processes x grad-accum 2 vs 1 process: {accum2_two_processes:.2e}")
    assert accum4 <= 1e-5 and accum2_two_processes <= 1e-5
    assert summary(runs[2] / "sgd_mlp_accum2")["per_process_batch_size"] == 16


def test_an_error_on_the_main_process_stops_every_process_with_its_message(runs):
    """At each place where the main process computes and the others wait (the run's folder, its lock, the checkpoint
    to resume, the trackers, the range test's files, the micro-batch try), an OSError on the main process alone ends
    every process at once: the main process with its own error, the other with the main's message (a ConfigError for
    a checkpoint folder that cannot be read), none waiting out --dist-timeout (60 s here)."""
    import topology_probe

    main, other = json.loads((runs[2] / "mainfails.json").read_text())
    assert list(main) == list(topology_probe.MAIN_FAILS)
    for place in topology_probe.MAIN_FAILS:
        injected = f"injected at the {place}"
        if place == "checkpoint to resume":
            assert main[place]["error"] == other[place]["error"] == "ConfigError", place
            assert main[place]["message"] == other[place]["message"] and injected in main[place]["message"]
        else:
            assert (main[place]["error"], main[place]["message"]) == ("OSError", injected), place
            assert other[place]["error"] == "MainProcessFailed", (place, other[place])
            assert f"OSError: {injected}" in other[place]["message"]
            assert ("process 0 failed" if place == "micro-batch try" else "the main process failed") in other[place]["message"]
        assert max(main[place]["seconds"], other[place]["seconds"]) < 20, (place, main[place], other[place])


def test_gradients_sync_once_per_optimizer_step(runs):
    once = json.loads((runs[2] / "allreduce_accum1.json").read_text())["allreduce_calls"]
    accum4 = json.loads((runs[2] / "allreduce_accum4.json").read_text())["allreduce_calls"]
    assert once > 0 and once % 8 == 0  # 8 steps, the same number of buckets each
    assert accum4 == once  # not 4x: the 3 micro-batches before each step do not all-reduce


def test_evaluation_counts_every_sample_once(runs):
    one = json.loads((runs[1] / "eval.json").read_text())
    for world in (2, 3):
        results = json.loads((runs[world] / "eval.json").read_text())
        for key, reference in one.items():
            size = int(key.split("/")[0])
            assert reference["samples"] == size
            assert results[key]["samples"] == size, f"{world} processes, size/batch {key}"
            assert results[key]["accuracy"] == reference["accuracy"], f"{world} processes, size/batch {key}"
            assert results[key]["loss"] == pytest.approx(reference["loss"], rel=1e-6)


def test_metrics_with_state_equal_the_whole_set_on_any_number_of_processes(runs):
    """F1, precision, recall (macro), AUROC (one-vs-rest), torchmetrics' macro F1 and the confusion matrix, on
    evaluation sets of 97 and 1001 samples in batches of 1, 16 and 64 per process: on 1, 2 and 3 processes
    each equals the metric computed over the whole set at once (scikit-learn; torchmetrics for its own),
    although Accelerate pads the last batch of every multi-process evaluation here."""
    from sklearn.metrics import confusion_matrix, f1_score, precision_score, recall_score, roc_auc_score
    from torchmetrics.classification import MulticlassF1Score

    from acc_trainer.config import make_config
    from acc_trainer.workload.components import build_data, build_model

    for size in EVAL["sizes"]:
        cfg = make_config({"model": "mlp", "eval_size": size, "train_size": 64, "batch_size": 6})
        data = build_data(cfg)
        torch.manual_seed(0)
        model = build_model(cfg, data).eval()
        with torch.no_grad():
            scores = model(torch.stack([data.eval[i][0] for i in range(size)]))
        labels = torch.tensor([int(data.eval[i][1]) for i in range(size)])
        predicted, probabilities = scores.argmax(1), scores.double().softmax(1)
        present = [c for c in range(10) if (labels == c).any()]
        expected = {
            "f1": f1_score(labels, predicted, average="macro"),
            "precision": precision_score(labels, predicted, average="macro", zero_division=0),
            "recall": recall_score(labels, predicted, average="macro", zero_division=0),
            "auroc": sum(roc_auc_score(labels == c, probabilities[:, c]) for c in present) / len(present),
            "tm_f1": MulticlassF1Score(num_classes=10, average="macro")(scores, labels).item(),
        }
        matrix = confusion_matrix(labels, predicted, labels=list(range(10))).tolist()
        for world in (1, 2, 3):
            results = json.loads((runs[world] / "eval.json").read_text())
            for batch in EVAL["batches"]:
                got = results[f"{size}/{batch}"]
                for name, value in expected.items():
                    assert got[name] == pytest.approx(value, abs=1e-6), f"{name}, {world} processes, {size}/{batch}"
                assert got["tables"]["confusion_matrix"] == matrix, f"{world} processes, {size}/{batch}"


def test_early_stopping_is_decided_alike_on_every_process(runs):
    one = summary(runs[1] / "early")
    assert one["stopped_early"] is not None and 3 <= one["stopped_early"]["epoch"] < 30
    for world in (2, 3):
        other = summary(runs[world] / "early")
        assert other["stopped_early"]["step"] == one["stopped_early"]["step"] == one["steps"] == other["steps"], world
        assert other["stopped_early"]["best"] == pytest.approx(one["stopped_early"]["best"], rel=1e-5), world


def test_every_step_sees_the_same_samples_and_epochs_reshuffle(runs):
    one = json.loads((runs[1] / "order.json").read_text())["epochs"]
    two = json.loads((runs[2] / "order.json").read_text())["epochs"]
    steps_per_epoch = ORDER["train_size"] // ORDER["batch_size"]
    assert [len(epoch) for epoch in one] == [steps_per_epoch] * ORDER["epochs"]
    for epoch_one, epoch_two in zip(one, two):
        for step_one, step_two in zip(epoch_one, epoch_two):
            assert sorted(step_one) == sorted(step_two)
        seen = [i for step in epoch_one for i in step]
        assert len(set(seen)) == len(seen) == steps_per_epoch * ORDER["batch_size"]  # no sample twice
    assert one[0] != one[1]  # each epoch has its own order...
    assert [i for step in one[0] for i in step] != sorted(i for step in one[0] for i in step)  # ...and it is shuffled


def test_ranks_are_checked_to_agree(runs):
    """Every run compares the weights of all processes after training, and reports what it measured: a 1e-6
    change of one bias on one process is reported as a disagreement, naming the process; one process has
    nothing to compare and says so instead of claiming agreement."""
    assert all(summary(runs[2] / name)["ranks_agree"] is True for name in RUNS)
    assert all(summary(runs[1] / name)["ranks_agree"] is None for name in RUNS)
    assert summary(runs[1] / "sgd_mlp")["ranks_check"] == "not checked: one process"
    result = json.loads((runs[2] / "disagree.json").read_text())
    assert result["same"]["agree"] is True
    assert result["different"] == {"agree": False, "detail": "the weights of process(es) 1 differ from process 0's"}


def test_the_same_seed_gives_the_same_run(runs):
    first = [r["loss"] for r in metrics(runs[1] / "sgd_mlp") if "loss" in r]
    again = [r["loss"] for r in metrics(runs[1] / "sgd_mlp_again") if "loss" in r]
    assert len(first) == 6 and first == again
    assert max_difference(runs[1] / "sgd_mlp", runs[1] / "sgd_mlp_again") == 0


def test_logged_loss_is_the_mean_over_ranks(runs):
    one = [r for r in metrics(runs[1] / "sgd_mlp") if "loss" in r]
    two = [r for r in metrics(runs[2] / "sgd_mlp") if "loss" in r]
    assert [r["step"] for r in one] == [r["step"] for r in two]
    rank_differs_from_global = False
    for single, pair in zip(one, two):
        assert len(pair["loss_per_rank"]) == 2
        assert pair["loss"] == pytest.approx(sum(pair["loss_per_rank"]) / 2, rel=1e-9)
        # One process sees both halves of each batch: its loss is the global loss the pair must log.
        assert pair["loss"] == pytest.approx(single["loss"], rel=1e-5)
        rank_differs_from_global |= abs(pair["loss_per_rank"][0] - single["loss"]) > 1e-4
    assert rank_differs_from_global  # so logging rank 0's loss alone would have failed the check above


def test_bf16_follows_fp32(runs):
    fp32 = [r["loss"] for r in metrics(runs[1] / "sgd_mlp") if "loss" in r]
    bf16 = [r["loss"] for r in metrics(runs[1] / "sgd_mlp_bf16") if "loss" in r]
    assert summary(runs[1] / "sgd_mlp_bf16")["mixed_precision"] == "bf16"
    differences = [abs(a - b) for a, b in zip(fp32, bf16)]
    print(f"bf16 vs fp32 logged losses: max |difference| {max(differences):.4f}")
    assert 0 < max(differences) <= 0.05  # tolerance stated in the README; 0 would mean bf16 never ran
    accuracy = summary(runs[1] / "sgd_mlp_bf16")["eval"]["accuracy"], summary(runs[1] / "sgd_mlp")["eval"]["accuracy"]
    assert abs(accuracy[0] - accuracy[1]) <= 0.03


def test_sync_bn_statistics_match_one_process(runs):
    """BatchNorm statistics over the whole global batch, as one process computes them."""
    one = load_file(runs[1] / "convnet" / "model.safetensors")
    synced = load_file(runs[2] / "convnet_sync_bn" / "model.safetensors")
    unsynced = load_file(runs[2] / "convnet" / "model.safetensors")
    stats = [k for k in one if k.endswith(("running_mean", "running_var"))]
    assert len(stats) == 4
    synced_difference = max((synced[k] - one[k]).abs().max().item() for k in stats)
    unsynced_difference = max((unsynced[k] - one[k]).abs().max().item() for k in stats)
    print(f"running statistics vs 1 process: --sync-bn {synced_difference:.2e}, without {unsynced_difference:.2e}")
    assert synced_difference <= 1e-5
    assert unsynced_difference > 1e-4  # each process's own half-batch statistics: the check can fail
    # Gradients flow through the synchronised statistics too: the weights after the step match.
    assert max((synced[k] - one[k]).abs().max().item() for k in one) <= 1e-5
