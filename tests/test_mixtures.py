"""Mixtures (docs/data.md#mixtures): several datasets sampled with weights, named by a repeated --dataset, a YAML list
or fit()'s list of (dataset, weight). The shares follow the weights; 1 and 2 processes and accumulation train on the
same samples in the same order; a resumed run (map-style or streams) is the same run; text sets are tokenized each as
it would be alone, then mixed; bad input is one line.

The sets below are this module's factories: the command lines run with tests/ as their folder (`test_mixtures:wide`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, check, forked_cli, run_here, summary, weights
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from acc_trainer.config import ConfigError
from acc_trainer.data.mixtures import Mixture, Part, mix

TESTS = REPO / "tests"
JOB = ["--model", "test_mixtures:net", "--dataset", "test_mixtures:wide=0.7", "--dataset", "test_mixtures:narrow=0.3",
       "--batch-size", "32", "--epochs", "2", "--optimizer", "sgd", "--lr", "0.1", "--seed", "3", "--no-plots",
       "--progress", "plain"]  # 400 samples: 12 steps an epoch, 24 in all
SHARE = re.compile(r"(\d+\.\d)% \(([\d,]+)")


class Samples(Dataset):
    """A user's map-style set (not a TensorDataset, so the mixture is served a sample at a time): 8 features, a class."""

    def __init__(self, n: int, seed: int, shift: float):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g) + shift
        self.y = (self.x[:, :4].sum(1) > self.x[:, 4:].sum(1)).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Stream(IterableDataset):
    """The same samples as a stream (no length)."""

    def __init__(self, n: int, seed: int, shift: float):
        self.samples = Samples(n, seed, shift)

    def __iter__(self):
        return (self.samples[i] for i in range(len(self.samples)))


def wide():
    return Samples(300, 1, 0.0), Samples(60, 2, 0.0)


def narrow():
    return Samples(100, 3, 1.0), Samples(40, 4, 1.0)


def net(num_classes: int = 2):
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, num_classes))


def shares(notes: list[str]) -> list[tuple[float, int]]:
    """(share in %, count) of each set, from the start line's mixture note."""
    line = next(n for n in notes if n.startswith("mixture:"))
    return [(float(p), int(c.replace(",", ""))) for p, c in SHARE.findall(line)]


def distance(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The job on 1 process (with checkpoints), with --grad-accum 2, from a YAML list, resumed mid-epoch from the
    first run's step-15 checkpoint, and on 2 processes (forked: conftest.forked_cli)."""
    out = tmp_path_factory.mktemp("mixtures")
    folders = {name: out / name for name in ("one", "accum", "yaml", "resumed", "two")}
    check(run_here(*JOB, "--checkpoint-every", "5", "--output-dir", folders["one"], cwd=TESTS))
    check(run_here(*JOB, "--grad-accum", "2", "--output-dir", folders["accum"], cwd=TESTS))
    config = out / "mixture.yaml"
    config.write_text("dataset:\n  - test_mixtures:wide: 0.7\n  - test_mixtures:narrow: 0.3\n")
    check(run_here(*[a for a in JOB if "=" not in a and a != "--dataset"], "--config", config,
                   "--output-dir", folders["yaml"], cwd=TESTS))
    step = folders["resumed"] / "checkpoints" / "step-00000015"
    shutil.copytree(folders["one"] / "checkpoints" / "step-00000015", step)  # in the 2nd epoch, 3 steps in
    check(run_here(*JOB, "--output-dir", folders["resumed"], "--resume", "auto", cwd=TESTS))
    forked_cli(*JOB, "--output-dir", folders["two"], cwd=TESTS)
    return folders


def test_the_measured_shares_follow_the_weights():
    sets = [Samples(3000, 1, 0.0), Samples(1000, 2, 0.0), Samples(4000, 3, 0.0)]
    mixture = Mixture(sets, [0.5, 0.2, 0.3], seed=0, names=["a", "b", "c"])
    assert len(mixture) == 8000  # the sets' sizes together
    print(mixture.shares())
    for count, weight in zip(mixture.counts, [0.5, 0.2, 0.3]):
        assert abs(count / 8000 - weight) < 0.015  # 3 standard deviations at 8,000 draws
    # A set drawn beyond its size is cycled evenly: each of b's samples as often as any other, to within one.
    drawn_b = mixture.index[mixture.which == 1]
    assert mixture.counts[1] > 1000 and torch.bincount(drawn_b).aminmax() == (1, 2)
    # Another seed, another draw; the same seed, the same one.
    assert not torch.equal(Mixture(sets, [0.5, 0.2, 0.3], seed=1).which, mixture.which)
    assert torch.equal(Mixture(sets, [5, 2, 3], seed=0).which, mixture.which)  # the weights are normalised
    # Plain tensors are mixed into one TensorDataset (the batched path), holding the Mixture's samples.
    a, b = (TensorDataset(s.x, s.y) for s in sets[:2])
    train, _, note = mix([Part("a", a, None, 0.7), Part("b", b, None, 0.3)], seed=5)
    reference = Mixture([a, b], [0.7, 0.3], seed=5)
    assert type(train) is TensorDataset and all(torch.equal(train[i][0], reference[i][0]) for i in range(0, 4000, 7))
    assert [c for _, c in shares([note])] == reference.counts


def test_one_and_two_processes_and_accumulation_train_on_the_same_mixture(runs):
    one, accum, two = (summary(runs[n]) for n in ("one", "accum", "two"))
    assert (one["world_size"], two["world_size"], one["steps"], two["steps"]) == (1, 2, 24, 24)
    assert shares(one["notes"]) == shares(two["notes"]) == shares(accum["notes"])
    print("shares:", shares(one["notes"]))
    reference = weights(runs["one"])
    for name in ("accum", "two"):
        difference = distance(reference, weights(runs[name]))
        print(f"{name}: max |difference| from 1 process = {difference:.2e}")
        assert difference <= 1e-5
    assert distance(reference, net().state_dict()) > 100 * 1e-5  # it trained


def test_a_run_resumed_mid_epoch_is_the_same_run(runs):
    assert summary(runs["resumed"])["resumed_from"].endswith("step-00000015")
    a, b = weights(runs["one"]), weights(runs["resumed"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_yaml_list_repeated_flags_and_fits_list_are_the_same_mixture(runs, tmp_path):
    from accelerate.utils import set_seed

    from acc_trainer import fit

    reference = weights(runs["one"])
    assert (runs["yaml"] / "config.yaml").read_text().startswith("model: test_mixtures:net\ndataset:\n- "
                                                                 "test_mixtures:wide=0.7\n- test_mixtures:narrow=0.3\n")
    assert shares(summary(runs["yaml"])["notes"]) == shares(summary(runs["one"])["notes"])
    assert distance(reference, weights(runs["yaml"])) == 0
    set_seed(3)  # as the command line seeds before it builds the model
    model = net()
    (wide_train, wide_eval), (narrow_train, _) = wide(), narrow()
    result = fit(model, [(wide_train, 0.7), (narrow_train, 0.3)], wide_eval, batch_size=32, epochs=2, optimizer="sgd",
                 lr=0.1, seed=3, plots=False, progress="none", output_dir=str(tmp_path / "fit"))
    assert shares(result["notes"]) == shares(summary(runs["one"])["notes"])
    assert distance(reference, weights(tmp_path / "fit")) == 0


def test_a_mixture_of_streams_resumes_exactly(tmp_path):
    from acc_trainer import fit

    def run(out: Path, resume: str | None = None) -> dict:
        torch.manual_seed(0)
        return fit(net(), [(Stream(300, 1, 0.0), 0.7), (Stream(100, 3, 1.0), 0.3)], batch_size=16, max_steps=8,
                   checkpoint_every="3", optimizer="sgd", lr=0.1, plots=False, progress="none", output_dir=str(out),
                   resume=resume)

    whole = run(tmp_path / "whole")
    assert any(n.startswith("mixture of streams: Stream (1) 70.0%, Stream (2) 30.0%") for n in whole["notes"])
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-00000003", tmp_path / "cut" / "checkpoints" / "step-00000003")
    assert run(tmp_path / "cut", resume="auto")["resumed_from"].endswith("step-00000003")  # 3 steps into the epoch
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_text_sets_are_each_tokenized_then_mixed(tmp_path):
    pytest.importorskip("transformers")
    import lm_probe

    from acc_trainer import fit

    chats = lm_probe.conversations(60, seed=1), lm_probe.conversations(20, seed=2)
    result = fit(lm_probe.base_model(), [(chats[0], 0.75), (chats[1], 0.25)], tokenizer=lm_probe.chat_tokenizer(),
                 batch_size=8, max_steps=3, optimizer="sgd", lr=0.2, plots=False, progress="none",
                 output_dir=str(tmp_path / "chat"))
    tokenized = [n for n in result["notes"] if "chat samples tokenized" in n]
    assert [n.split(":")[0] for n in tokenized] == ["list (1)", "list (2)"]  # each set alone, 60 and 20 samples
    assert [int(re.search(r": (\d+) chat", n)[1]) for n in tokenized] == [60, 20]
    assert sum(c for _, c in shares(result["notes"])) == 80 and result["steps"] == 3
    texts = [{"text": "the cat sat on the mat"}] * 20
    with pytest.raises(ConfigError, match=r"^mixture: list \(1\) holds messages and list \(2\) text: a mixture's sets "
                                          "are of one kind$"):
        fit(lm_probe.base_model(), [(chats[0], 1), (texts, 1)], tokenizer=lm_probe.chat_tokenizer(), max_steps=1,
            output_dir=str(tmp_path / "never"))


@pytest.mark.parametrize("given, message", [
    (["--dataset", "test_mixtures:wide=0.7", "--dataset", "test_mixtures:narrow=-1"],
     "--dataset test_mixtures:narrow=-1: a mixture's sets are NAME=WEIGHT, each weight a positive number"),
    (["--dataset", "test_mixtures:wide=0.7", "--dataset", "test_mixtures:narrow=a lot"],
     "--dataset test_mixtures:narrow=a lot: a mixture's sets are NAME=WEIGHT"),
    (["--dataset", "test_mixtures:wide=0", "--dataset", "test_mixtures:narrow"], "--dataset test_mixtures:wide=0: "),
    (["--dataset", "test_mixtures:wide=1", "--dataset", "no_such.jsonl=1"], "--dataset no_such.jsonl: no such file"),
    (["--dataset", "test_mixtures:wide=1", "--dataset", "test_mixtures:streams=1"],
     "mixture: test_mixtures:wide is map-style and test_mixtures:streams a stream"),
])
def test_bad_mixtures_are_one_line(given, message):
    result = run_here("--model", "test_mixtures:net", *given, "--max-steps", "1", cwd=TESTS)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


def test_fit_refuses_a_bad_weight_in_one_line(tmp_path):
    from acc_trainer import fit

    with pytest.raises(ConfigError, match=r"=-0\.5: a mixture's sets are NAME=WEIGHT"):
        fit(net(), [(Samples(40, 1, 0.0), 1.0), (Samples(40, 2, 0.0), -0.5)], output_dir=str(tmp_path / "never"))


def streams():
    return Stream(100, 3, 1.0), None
