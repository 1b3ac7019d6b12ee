"""The learning-rate range test as a user runs it: `acc-trainer lr-find` (its files, its printed suggestion, bad
input), `acc_trainer.find_lr` (the model and the random states left as they were, a later fit() unchanged bit for
bit) and `fit(..., lr="find")`; and the suggestion on curves whose steepest point is known."""

from __future__ import annotations

import copy
import json
import math
import random
import re

import numpy as np
import pytest
import torch
import yaml
from conftest import reset_accelerate
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from acc_trainer.config import ConfigError
from acc_trainer.training import lr_range

# A small classification job: 1,024 generated images, 16 steps an epoch.
MLP = ("--model", "mlp", "--dataset", "synthetic", "--train-size", "1024", "--batch-size", "64", "--optimizer", "adamw",
       "--progress", "none")


def smoothed_by_hand(losses: list[float], beta: float = 0.98) -> list[float]:
    """The bias-corrected moving average written as its sum: step i weighs (1 - beta) beta**(i - j) on loss j, over
    the weights' total 1 - beta**i."""
    out = []
    for i in range(1, len(losses) + 1):
        weights = [(1 - beta) * beta ** (i - j) for j in range(1, i + 1)]
        out.append(sum(w * x for w, x in zip(weights, losses[:i])) / sum(weights))
    return out


@pytest.fixture
def lr_find(main_in_process):
    def run(*args):
        return main_in_process("lr-find", *args)

    return run


def test_lr_find_writes_its_curve_and_figure_and_suggests_the_steepest_descent(lr_find, tmp_path):
    code, out, err = lr_find(*MLP, "--min-lr", "1e-6", "--max-lr", "10", "--steps", "40", "--output-dir", tmp_path / "f")
    assert code == 0, err
    found = json.loads((tmp_path / "f" / "lr_find.json").read_text())
    assert (tmp_path / "f" / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    line = next(line for line in out.splitlines() if line.startswith("suggested learning rate:"))
    assert f"figure: {tmp_path / 'f' / 'lr_find.png'}" in line and "acc-trainer --lr" in out
    s = found["suggestion"]
    assert line.startswith(f"suggested learning rate: {s:.1e} (")  # the file's suggestion, checked below
    # The run took each step's rate from the exponential schedule, and its losses are the curve's.
    lrs, losses = found["lrs"], found["losses"]
    assert lrs == pytest.approx([1e-6 * 1e7 ** (k / 39) for k in range(len(lrs))], rel=1e-9)
    logged = [json.loads(line) for line in (tmp_path / "f" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged][:len(losses)] == losses and [r["step"] for r in logged] == list(range(1, 41))
    # Smoothed and cut as fastai does, computed here another way.
    smoothed = smoothed_by_hand(losses)
    assert found["smoothed"] == pytest.approx(smoothed, rel=1e-9)
    assert found["stop_reason"] == "diverged" and found["stopped_at"] == len(lrs) < 40  # adamw up to lr 10 diverges
    assert smoothed[-1] > 4 * min(smoothed[:-1]) and all(v <= 4 * min(smoothed[:i + 1]) for i, v in enumerate(smoothed[:-1]))
    # The suggestion: the most negative central slope of the smoothed loss against log(lr), past the first tenth and
    # before the last point.
    x = [math.log(lr) for lr in lrs]
    first = max(1, min(10, len(lrs) // 10))
    slopes = {i: (smoothed[i + 1] - smoothed[i - 1]) / (x[i + 1] - x[i - 1]) for i in range(first, len(lrs) - 1)}
    steepest = min(slopes, key=slopes.get)
    assert s == lrs[steepest], (lrs.index(s), steepest)


def test_the_suggestion_is_where_a_known_curve_falls_fastest_and_a_short_curve_is_refused():
    lrs = [1e-7 * 1e7 ** (k / 99) for k in range(100)]
    for centre in (1e-5, 3e-3, 1e-1):  # the loss falls as -tanh around log10(centre), steepest there
        losses = [2 - math.tanh((math.log10(lr) - math.log10(centre)) / 0.4) for lr in lrs]
        found = lrs[lr_range.steepest(lrs, losses)]
        assert abs(math.log10(found) - math.log10(centre)) <= 7 / 99 / 2 + 1e-9, (found, centre)  # the nearest point
        # fp16's skipped steps leave the rate as it was: a repeated rate is left out of the gradient, not divided by 0.
        at = lrs.index(found)
        repeated = lrs[:at - 5] + [lrs[at - 5]] * 3 + lrs[at - 4:]
        losses = [2 - math.tanh((math.log10(lr) - math.log10(centre)) / 0.4) for lr in repeated]
        assert repeated[lr_range.steepest(repeated, losses)] == found
    # A curve that falls then rises to 4x its lowest is cut at that point; a NaN ends it before itself.
    curve = [3.0] * 5 + [1.0] * 5 + [2.0, 5.0, 9.0, 20.0]
    assert lr_range.cut(curve) == (12, "diverged")
    assert lr_range.cut([3.0, 2.0, float("nan"), 1.0]) == (2, "not finite")
    with pytest.raises(ConfigError, match="too few to suggest"):
        lr_range.steepest(lrs[:4], [3.0, 2.0, 1.0, 9.0])


class Line(nn.Module):
    """y = w x: the loss falls as w nears the data's 2.0; past |w| = 3 its outputs are NaN (as an overflow would
    make them), which ends the range test where it happens."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x * self.w * (1.0 if self.w.abs().item() <= 3 else float("nan"))


def line_data() -> TensorDataset:
    x = torch.linspace(-1, 1, 256).unsqueeze(1)
    return TensorDataset(x, 2 * x)


@pytest.fixture
def fresh():
    reset_accelerate()
    yield
    reset_accelerate()


def test_on_a_known_workload_the_loss_falls_then_diverges_and_the_suggestion_lies_before_its_lowest(lr_find, tmp_path):
    """Linear regression with SGD: learns at moderate rates and diverges past about lr 1 (the curve's end)."""
    code, _, err = lr_find("--model", "linreg", "--dataset", "linear", "--optimizer", "sgd", "--momentum", "0",
                           "--batch-size", "32", "--min-lr", "1e-4", "--max-lr", "1e3", "--steps", "50",
                           "--progress", "none", "--output-dir", tmp_path / "f")
    assert code == 0, err
    found = json.loads((tmp_path / "f" / "lr_find.json").read_text())
    lrs, losses, smoothed = found["lrs"], found["losses"], found["smoothed"]
    lowest = int(np.argmin(smoothed))
    assert losses[0] > 4 * min(losses) and smoothed[lowest] < smoothed[0] / 2  # it falls...
    assert found["stop_reason"] == "diverged" and smoothed[-1] > 4 * smoothed[lowest] and lrs[-1] < 1e3  # ...then diverges
    assert lrs[0] < found["suggestion"] < lrs[lowest]


def test_a_nan_loss_ends_the_curve_where_it_happens(fresh, tmp_path):
    import acc_trainer

    test = acc_trainer.find_lr(Line(), line_data(), batch_size=32, optimizer="sgd", momentum=0.0, min_lr=1e-3,
                               max_lr=30.0, steps=40, output_dir=str(tmp_path / "f"), progress="none")
    assert test.stop_reason == "not finite" and test.stopped_at == len(test.lrs) + 1 < 40
    assert all(math.isfinite(v) for v in test.losses) and test.lrs[0] < test.suggestion < test.lrs[-1]
    assert json.loads((tmp_path / "f" / "lr_find.json").read_text())["stopped_at"] == test.stopped_at


def digits_like():
    """1,024 samples of 16 features in 4 classes, separable by a linear map: a job that learns in a few steps."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    return TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(1))


def small_net():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))


def test_find_lr_leaves_the_model_and_random_states_and_a_later_fit_unchanged(fresh, tmp_path):
    import acc_trainer

    torch.manual_seed(1)
    model, data = small_net(), digits_like()
    untouched = copy.deepcopy(model)
    options = {"batch_size": 64, "optimizer": "adamw", "progress": "none"}
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()

    test = acc_trainer.find_lr(model, data, steps=30, output_dir=str(tmp_path / "f"), **options)
    assert test.figure.is_file() and test.folder == tmp_path / "f" and len(test.lrs) == len(test.losses)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), untouched.state_dict().values()))
    assert random.getstate() == states[0] and torch.equal(torch.get_rng_state(), states[2])
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), states[1]))
    # fit() after find_lr ends where fit() alone does, bit for bit.
    reset_accelerate()
    acc_trainer.fit(model, data, epochs=2, lr=test.suggestion, output_dir=str(tmp_path / "after"), **options)
    reset_accelerate()
    acc_trainer.fit(untouched, data, epochs=2, lr=test.suggestion, output_dir=str(tmp_path / "alone"), **options)
    weights, alone = model.state_dict(), untouched.state_dict()
    assert all(torch.equal(weights[k], alone[k]) for k in weights)
    assert not torch.equal(weights["0.weight"], copy.deepcopy(small_net()).state_dict()["0.weight"])  # it trained


def test_fit_lr_find_trains_with_the_suggestion(fresh, tmp_path, capsys):
    import acc_trainer

    run = tmp_path / "run"
    job = dict(lr="find", epochs=1, batch_size=64, optimizer="adamw", output_dir=str(run), progress="none",
               checkpoint_every="8", plots=False)
    torch.manual_seed(1)
    acc_trainer.fit(small_net(), digits_like(), **job)
    suggestion = json.loads((run / "lr-find" / "lr_find.json").read_text())["suggestion"]
    config = yaml.safe_load((run / "config.yaml").read_text())
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert config["lr"] == suggestion and {r["lr"] for r in logged if "lr" in r} == {suggestion}
    assert f'lr="find": suggested learning rate {suggestion:.1e}' in capsys.readouterr().out
    # Into the same folder again: refused, naming it, before a second test runs; the first test's files untouched.
    curve = (run / "lr-find" / "lr_find.json").read_bytes()
    with pytest.raises(ConfigError, match=f"--output-dir {re.escape(str(run))} already holds a run"):
        acc_trainer.fit(small_net(), digits_like(), **job)
    assert (run / "lr-find" / "lr_find.json").read_bytes() == curve
    # Resumed: the run goes on with the rate it was started with (no second test), and ends on the same weights.
    first = load_file(run / "model.safetensors")
    torch.manual_seed(1)
    acc_trainer.fit(small_net(), digits_like(), **job, resume=str(run / "checkpoints" / "step-00000008"))
    assert "resuming with the learning rate the run was started with" in capsys.readouterr().out
    assert yaml.safe_load((run / "config.yaml").read_text())["lr"] == suggestion
    resumed = load_file(run / "model.safetensors")
    assert all(torch.equal(first[name], resumed[name]) for name in first)
    # A folder holding a run trained at a rate of its own: no test runs there.
    other = tmp_path / "other"
    acc_trainer.fit(small_net(), digits_like(), lr=0.01, max_steps=2, batch_size=64, output_dir=str(other),
                    progress="none", plots=False)
    with pytest.raises(ConfigError, match=f"--output-dir {re.escape(str(other))} already holds a run"):
        acc_trainer.fit(small_net(), digits_like(), lr="find", output_dir=str(other), progress="none")
    assert not (other / "lr-find").exists()
    # Resumed where the test suggested nothing (it diverged; the run never started): one line.
    (tmp_path / "diverged" / "lr-find").mkdir(parents=True)
    (tmp_path / "diverged" / "lr-find" / "lr_find.json").write_text('{"suggestion": null}')
    with pytest.raises(ConfigError, match="suggested no learning rate"):
        acc_trainer.fit(small_net(), digits_like(), lr="find", output_dir=str(tmp_path / "diverged"), resume="auto")
    with pytest.raises(ConfigError, match="optimizer factory"):
        acc_trainer.fit(small_net(), digits_like(), lr="find", optimizer=lambda groups: torch.optim.SGD(groups, lr=0.1))


@pytest.mark.parametrize("args, message", [
    (("--min-lr", "1e-2", "--max-lr", "1e-3"), "--min-lr 0.01 must be below --max-lr 0.001"),
    (("--steps", "5"), "--steps takes a whole number of optimizer steps, at least 10"),
    (("--min-lr", "-1"), "--min-lr must be a positive number"),
    (("--max-lr", "inf"), "--max-lr must be a positive number"),
    (("--step", "20"), "unknown option --step; did you mean --steps"),
])
def test_bad_input_is_one_line_and_exit_2(lr_find, args, message):
    code, out, err = lr_find(*MLP, *args)
    assert code == 2 and err.count("\n") == 1 and err.startswith("acc-trainer: error: "), err
    assert message in err and "Traceback" not in err + out
