"""Any task: batches of any shape (collate functions), models that take their targets (forward functions),
a dict of losses (detection), losses over tokens exact on every topology, parameters the forward never uses.

Most proofs go through `acc_trainer.check` (short runs in forked processes: 1 process, 2 processes,
--grad-accum 2, a resume, a 1-ulp nudge), on objects this file builds as a user would.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, metrics, run_here, summary
from torch import nn

EXAMPLES = REPO / "examples"
# SGD on a small GPT-2 is not chaotic here: a 1-ulp nudge of the initial weights moves 4 steps by 1.2e-7.
GPT = {"batch_size": 16, "optimizer": "sgd", "lr": 0.1, "steps": 4}


@pytest.fixture(scope="module")
def lm():
    sys.path.insert(0, str(EXAMPLES))
    import language_model

    yield language_model
    sys.path.remove(str(EXAMPLES))


def _rows(rows: list[dict]) -> dict:
    return {r["check"]: r for r in rows}


def _difference(row: dict) -> float:
    return float(re.search(r"max parameter difference (\S+)", row["measured"]).group(1))


def next_token_mean(outputs, labels):
    """A user's loss over tokens as a mean per micro-batch: what every loss was before losses over items."""
    return F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def next_token_sum(outputs, labels):
    """The same loss by the contract for items: (sum, count)."""
    target = labels[:, 1:]
    total = F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    return total, (target != -100).sum()


@pytest.mark.parametrize("loss", [None, next_token_sum, next_token_mean], ids=["own", "sum_count", "mean"])
def test_gpt2_on_padded_sequences_trains_the_same_on_every_topology(lm, loss, tmp_path):
    """Sequences of 6 to 24 tokens padded in the dataset (labels -100 on the padding). The model's own
    loss (counted per token) and a user's (sum, count) end within 1e-5 on 2 processes and with
    --grad-accum 2; a user's mean per micro-batch does not, and check names that cause."""
    torch.manual_seed(0)
    train, evaluation = lm.counting(256, 50, padded=True)
    rows = _rows(acc_trainer_check(lm.gpt2(), train, evaluation, loss=loss, output_dir=str(tmp_path), **GPT))
    topology, accumulation = rows["2 processes vs 1"], rows["--grad-accum 2 vs 1 process"]
    assert rows["same start, same samples at every step"]["result"] == "PASS"
    assert rows["evaluation counts every sample once"]["measured"] == "50 samples on 1 process, 50 on 2"
    logged = {job: metrics(tmp_path / job)[0]["loss"] for job in ("base", "two", "accum")}
    if loss is next_token_mean:  # each micro-batch weighs the same, whatever its number of tokens
        for row in (topology, accumulation):
            assert row["result"] == "FAIL" and _difference(row) > 1e-4
            assert "mean over each micro-batch's positions" in row["cause"] and "samples" not in row["cause"]
            assert "(sum, count)" in row["fix"]
        assert abs(logged["two"] - logged["base"]) > 1e-4
        assert summary(tmp_path / "base")["loss_per"] == "position"
    else:
        for row in (topology, accumulation):
            assert row["result"] == "PASS" and _difference(row) <= 1e-5, row
        # The logged loss is the mean over every token of the global batch: the same on every topology,
        # though each process's own mean differs.
        assert logged["two"] == pytest.approx(logged["base"], abs=1e-6)
        assert logged["accum"] == pytest.approx(logged["base"], abs=1e-6)
        per_rank = metrics(tmp_path / "two")[0]["loss_per_rank"]
        assert abs(per_rank[0] - per_rank[1]) > 1e-4
        assert summary(tmp_path / "base")["loss_per"] == "item"
        # Stopped at step 2 mid-interval: the checkpoint keeps the sums and token counts of steps 1-2.
        assert [r["loss"] for r in metrics(tmp_path / "resumed") if "loss" in r] == [logged["base"]]
    assert all(r["result"] != "FAIL" for name, r in rows.items() if name not in ("2 processes vs 1",
                                                                                  "--grad-accum 2 vs 1 process"))


def test_a_loss_over_tokens_is_the_mean_over_every_token_of_the_global_batch(lm, tmp_path, torch_on_one_thread):
    """One SGD step on one global batch (the whole training set, in 2 accumulation micro-batches of different
    numbers of tokens): the update is lr x the gradient of the mean over all the batch's tokens, computed
    here by hand; the logged loss is that mean."""
    import copy

    from safetensors.torch import load_file
    from torch.utils.data import default_collate

    import acc_trainer

    torch.manual_seed(0)
    train, _ = lm.counting(16, 1, padded=True)
    model = lm.gpt2()
    start = copy.deepcopy(model)
    acc_trainer.fit(model, train, batch_size=16, grad_accum=2, max_steps=1, optimizer="sgd", momentum=0.0, lr=0.5,
                    output_dir=str(tmp_path / "run"), progress="none", plots=False)
    batch = default_collate([train[i] for i in range(16)])
    mean = start(**batch).loss  # the model's own: the mean over every predicted token of the 16 sequences
    mean.backward()
    trained = load_file(tmp_path / "run" / "model.safetensors")
    for name, p in start.named_parameters():
        assert torch.allclose(trained[name], p.detach() - 0.5 * p.grad, atol=1e-6, rtol=0), name
    assert metrics(tmp_path / "run")[0]["loss"] == pytest.approx(mean.item(), abs=1e-6)


def acc_trainer_check(*args, **kwargs):
    import acc_trainer

    return acc_trainer.check(*args, **kwargs)


def test_the_language_model_example_passes_check_from_the_command_line(tmp_path):
    """examples/language_model.yaml: padded per batch by its collate function (each process pads its own
    share to its own longest), an evaluation set of 99 that no batch divides."""
    result = run_here("check", "--config", "language_model.yaml", "--steps", "4", "--optimizer", "sgd", "--lr", "0.1",
                      "--batch-size", "16", "--dataset-args", "{train_size: 256, eval_size: 99}",
                      "--output-dir", tmp_path, cwd=EXAMPLES)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert "every check passed" in result.stdout
    from safetensors.torch import load_file

    base = load_file(tmp_path / "base" / "model.safetensors")
    for job in ("two", "accum"):
        weights = load_file(tmp_path / job / "model.safetensors")
        assert max((base[k] - weights[k]).abs().max().item() for k in base) <= 1e-5, job
    s, base = summary(tmp_path / "two"), summary(tmp_path / "base")
    assert s["eval_samples"] == 99 and s["loss_per"] == "item" and "next_token_accuracy" in s["eval"]
    assert s["eval"]["loss"] == pytest.approx(base["eval"]["loss"], abs=1e-5)
    # Perplexity: exactly the exponential of the token-mean loss over the whole set, on 1 and on 2 processes.
    for run in (s, base):
        assert run["eval"]["perplexity"] == math.exp(run["eval"]["loss"]) and run["eval"]["perplexity"] > 1
    assert s["eval"]["perplexity"] == pytest.approx(base["eval"]["perplexity"], rel=1e-5)


# ----------------------------------------------------------------------------------------- detection


@pytest.fixture(scope="module")
def detection():
    sys.path.insert(0, str(EXAMPLES))
    import detection

    yield detection
    sys.path.remove(str(EXAMPLES))


def test_a_detector_trains_on_one_process_with_its_losses_logged_by_name(detection, tmp_path, torch_on_one_thread):
    """torchvision's detection interface: list batches, a dict of losses in training, predictions in
    evaluation (no eval loss: the metric sees the predictions and the targets)."""
    import acc_trainer

    train, evaluation = detection.rectangles(512, 101)
    torch.manual_seed(0)
    s = acc_trainer.fit(detection.TinyDetector(), train, evaluation, collate_fn=detection.collate,
                        forward="with_targets", metrics={"recall": detection.recall}, epochs=4, batch_size=32, lr=3e-3,
                        log_every=4, output_dir=str(tmp_path / "run"), progress="none", plots=False)
    assert s["loss_function"] == "the model's own" and s["eval_samples"] == 101
    assert set(s["eval"]) == {"recall"} and s["eval"]["recall"] > 0.5
    records = [r for r in metrics(tmp_path / "run") if "loss" in r]
    parts = ("loss_objectness", "loss_classifier", "loss_box_reg")
    for record in records:
        assert record["loss"] == pytest.approx(sum(record[p] for p in parts), rel=1e-6)
    assert records[-1]["loss"] < records[0]["loss"] / 2
    assert (tmp_path / "run" / "config.yaml").read_text().count("collate: detection:collate") == 1


def test_a_detector_on_two_processes_is_the_same_run(detection, tmp_path):
    """With a per-image metric and torchmetrics' mAP (a metric object: updated with the real samples only,
    combined across the processes by torchmetrics)."""
    from torchmetrics.detection import MeanAveragePrecision

    train, evaluation = detection.rectangles(256, 37)
    torch.manual_seed(0)
    # A low score threshold: after a few steps the detector's boxes are found, and ranked by score, for mAP.
    rows = _rows(acc_trainer_check(detection.TinyDetector(threshold=0.05), train, evaluation,
                                   collate_fn=detection.collate, forward="with_targets",
                                   metrics={"recall": detection.recall, "map": MeanAveragePrecision()},
                                   steps=12, batch_size=16, optimizer="sgd", lr=0.05, output_dir=str(tmp_path)))
    for name in ("2 processes vs 1", "--grad-accum 2 vs 1 process", "same start, same samples at every step",
                 "stopped at step 6 and resumed", "the same run twice"):
        assert rows[name]["result"] == "PASS", rows[name]
    assert rows["evaluation counts every sample once"]["measured"] == "37 samples on 1 process, 37 on 2"
    one, two = summary(tmp_path / "base")["eval"], summary(tmp_path / "two")["eval"]
    assert two["recall"] == pytest.approx(one["recall"])
    assert {"map", "map_50", "map_75", "map_mar_100"} <= set(one) and 0 < one["map_50"] <= 1
    for name in ("map", "map_50", "map_mar_100"):
        assert two[name] == pytest.approx(one[name], abs=1e-6), name


# ----------------------------------------------------------------------------------------- unused parameters


class WithSpareHead(nn.Module):
    """A second head its forward never calls (left from an experiment, say)."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.spare = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def test_a_parameter_the_forward_never_uses_trains_on_two_processes(project, tmp_path):
    """Without find_unused_parameters DDP fails at the second step on every rank; acc_trainer finds the
    parameters at the first-sample check, asks DDP to look for them, and says so."""
    from my_data import load

    torch.manual_seed(0)
    rows = _rows(acc_trainer_check(WithSpareHead(), *load(), steps=4, batch_size=64, optimizer="sgd", lr=0.05,
                                   output_dir=str(tmp_path)))
    assert rows["2 processes vs 1"]["result"] == "PASS" and _difference(rows["2 processes vs 1"]) <= 1e-6
    unused = rows["every parameter gets a gradient"]  # the spare head never trains: the row fails, naming it
    assert unused["result"] == "FAIL" and "find_unused_parameters" in unused["measured"]
    assert "2 never trained (spare.weight, spare.bias): no gradient from the first samples and unchanged from step 2 " \
           "to step 4" in unused["measured"]
    notes = summary(tmp_path / "two")["notes"]
    assert any("the forward never uses spare.weight, spare.bias" in n and "find_unused_parameters" in n for n in notes)
    assert summary(tmp_path / "base")["unused_parameters"] == ["spare.weight", "spare.bias"]


# ----------------------------------------------------------------------------------------- the command line


def test_text_classification_with_a_padding_collate_from_the_command_line(tmp_path):
    """examples/text_classification.py as its docstring runs it (shorter): variable-length sequences, an
    evaluation set of 301 whose last batch Accelerate pads (and acc_trainer collates only the real samples)."""
    out = tmp_path / "run"
    result = run_here("--model", "text_classification:BagOfEmbeddings", "--dataset", "text_classification:reviews",
                      "--dataset-args", "{train_size: 2048, eval_size: 301}", "--collate", "text_classification:pad",
                      "--epochs", "3", "--batch-size", "64", "--lr", "0.01", "--output-dir", out, "--progress", "none",
                      "--no-plots", cwd=EXAMPLES)
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(out)
    assert s["eval_samples"] == 301 and s["eval"]["accuracy"] > 0.85 and s["loss_per"] == "sample"
    assert json.loads(json.dumps(s["evals"]))[0]["samples"] == 301


BAD = '''
import torch


def raises(samples):
    raise KeyError("tokens")


def not_a_pair(model, batch):
    return model(batch[0])


class NonScalarLoss(torch.nn.Module):
    def __init__(self, num_classes=4):
        super().__init__()
        self.layer = torch.nn.Linear(16, num_classes)

    def forward(self, x):
        out = self.layer(x)
        return {"loss_a": out.mean(), "loss_b": out.mean(1)}
'''


@pytest.mark.parametrize("args, message", [
    (["--collate", "bad_batching:raises"],
     "the samples of my_data:load cannot be batched by the collate function raises: KeyError: 'tokens'"),
    (["--forward", "bad_batching:not_a_pair"],
     "the forward function not_a_pair returned [2, 4] float32; it must return (outputs, targets)"),
    (["--model", "bad_batching:NonScalarLoss"],
     "model bad_batching:NonScalarLoss: the model's loss 'loss_b' is a tensor of shape [2]; each loss in its dict must "
     "be one number"),
    (["--forward", "sideways"], "unknown forward 'sideways'; choose from default, with_targets"),
    (["--collate", "bad_batching:missing"], "--collate bad_batching:missing: bad_batching has no attribute 'missing'"),
])
def test_bad_batching_is_one_line(project, args, message):
    (project / "bad_batching.py").write_text(BAD)
    options = ["--model", "my_model:build", *args] if "--model" not in args else args
    result = run_here(*options, "--dataset", "my_data:load", "--batch-size", "64", "--output-dir", project / "never",
                      cwd=project)
    sys.modules.pop("bad_batching", None)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (project / "never").exists()


def test_check_data_names_samples_the_collate_function_cannot_batch(tmp_path):
    (tmp_path / "odd.py").write_text('''
import torch


def load():
    samples = [(torch.ones(3), 0)] * 9 + [(torch.ones(3), "x")]
    return samples, None


def stack(samples):
    return torch.stack([x for x, _ in samples]), torch.tensor([int(y) for _, y in samples])
''')
    result = run_here("check-data", "--dataset", "odd:load", "--collate", "odd:stack", "--batch-size", "4", cwd=tmp_path)
    sys.modules.pop("odd", None)
    assert result.returncode == 1
    assert "unreadable training sample: sample 9 (the collate function raised ValueError: invalid literal" in result.stdout
    assert "training: 9 of 10 samples read" in result.stdout


def test_a_micro_batch_without_any_token_adds_nothing(lm):
    """Every label -100 (a prompt cut before its answer): the model's own mean is NaN; counted per token the
    micro-batch adds 0 to the loss and nothing to the gradients, and training goes on."""
    from acc_trainer.workload.losses import count_next_tokens, model_loss

    model = lm.gpt2()
    batch = lm.pad([{"input_ids": torch.arange(1, 9)}, {"input_ids": torch.arange(3, 7)}])
    batch["labels"].fill_(-100)
    outputs = model(**batch)
    assert torch.isnan(outputs.loss)
    loss = model_loss(outputs, batch["labels"], items=count_next_tokens)
    assert loss.value.item() == 0 and loss.items.item() == 0
    loss.value.backward()
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in model.parameters() if p.grad is not None)


COLLATE = '''
import torch


def stack(samples):
    return torch.stack([image for image, _ in samples]), torch.tensor([label for _, label in samples])
'''


def test_a_collate_function_with_a_built_in_dataset_held_in_memory(tmp_path):
    """The built-in datasets serve whole batches from memory; with a collate function they serve samples."""
    (tmp_path / "stacking.py").write_text(COLLATE)
    result = run_here("--model", "mlp", "--dataset", "synthetic", "--train-size", "256", "--eval-size", "77",
                      "--batch-size", "32", "--epochs", "1", "--collate", "stacking:stack", "--output-dir", tmp_path / "run",
                      "--progress", "none", "--no-plots", cwd=tmp_path)
    sys.modules.pop("stacking", None)
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(tmp_path / "run")
    assert s["eval_samples"] == 77 and s["steps"] == 8 and s["eval"]["accuracy"] > 0.2
