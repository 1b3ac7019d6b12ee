"""`--micro-batch N|auto`: the per-process micro-batch, the rest of the global batch accumulated. `auto` goes down
from the global batch's share on torch's out-of-memory error (a model here raises it above a size, as a GPU would),
keeps the math (the final weights of the global batch it was asked for), leaves the model and the random numbers as
they were, agrees between processes, and a resume keeps its choice."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import forked, run_cli, summary
from torch import nn
from torch.utils.data import TensorDataset

import acc_trainer

pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


class Limited(nn.Module):
    """An MLP that runs out of memory on more than `limit` samples (torch's own error, as CUDA raises it), with
    dropout and BatchNorm when asked (random numbers and buffers that a size's try must leave as they were)."""

    def __init__(self, limit: int | None = None, noisy: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.limit, self.tries = limit, []
        layers = [nn.Linear(8, 32)] + ([nn.BatchNorm1d(32), nn.Dropout(0.2)] if noisy else []) + [nn.Tanh(), nn.Linear(32, 3)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        if self.training and len(x) > 2:
            self.tries.append(len(x))
        if self.limit and len(x) > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(x)} samples' activations")
        return self.net(x)


def data(n: int = 256):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


JOB = dict(batch_size=64, max_steps=6, optimizer="sgd", lr=0.1, progress="none", plots=False)


def weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")


def test_auto_finds_the_largest_micro_batch_that_fits_and_keeps_the_math(tmp_path):
    model = Limited(limit=16)
    run = acc_trainer.fit(model, data(), data(64), micro_batch="auto", output_dir=str(tmp_path / "auto"), **JOB)
    count = sum(p.numel() for p in Limited().parameters())
    said = "--micro-batch: 16 samples per process, accumulated 4 times to the 64 of each process's share of the " \
           f"global batch (the largest that fits: 64 out of memory, 32 out of memory, 16 fits; tried on {count:,} of " \
           f"{count:,} parameters with gradients and optimizer state, gradient checkpointing off)"
    assert said in run["notes"]
    assert (run["grad_accum"], run["per_process_batch_size"], run["global_batch_size"]) == (4, 16, 64)
    assert model.tries[:3] == [64, 32, 16] and set(model.tries[3:]) == {16}  # then every step on 16
    # The global batch of 64 with enough memory: the same weights to rounding.
    plenty = acc_trainer.fit(Limited(), data(), data(64), output_dir=str(tmp_path / "plenty"), **JOB)
    assert plenty["grad_accum"] == 1
    a, b = weights(tmp_path / "auto"), weights(tmp_path / "plenty")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    # config.yaml keeps the options as given: the run's config trains again the same way.
    import yaml

    written = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())
    assert written["micro-batch"] == "auto" and written.get("grad-accum", 1) == 1


def test_trying_sizes_changes_nothing_and_a_resume_keeps_the_choice(tmp_path):
    """With dropout and BatchNorm, `auto` ends bit-identical to --grad-accum 4 given by hand (its tries drew no
    random number and left the running statistics alone); resumed from its step-3 checkpoint it tries nothing and
    ends bit-identical to the uninterrupted run."""
    auto = acc_trainer.fit(Limited(16, noisy=True), data(), data(64), micro_batch="auto", checkpoint_every=3,
                           output_dir=str(tmp_path / "auto"), **JOB)
    acc_trainer.fit(Limited(16, noisy=True), data(), data(64), grad_accum=4, output_dir=str(tmp_path / "hand"), **JOB)
    a, b = weights(tmp_path / "auto"), weights(tmp_path / "hand")
    assert all(torch.equal(a[k], b[k]) for k in a)
    model = Limited(16, noisy=True)
    resumed = acc_trainer.fit(model, data(), data(64), micro_batch="auto", checkpoint_every=3,
                              resume=str(tmp_path / "auto" / "checkpoints" / "step-00000003"),
                              output_dir=str(tmp_path / "resumed"), **JOB)
    assert any("(kept from the checkpoint)" in note for note in resumed["notes"]) and resumed["grad_accum"] == 4
    assert 64 not in model.tries and 32 not in model.tries
    c = weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert auto["grad_accum"] == 4


def _uneven(out) -> None:
    from accelerate import PartialState

    import acc_trainer

    model = Limited(limit=32 if PartialState(cpu=True).process_index == 0 else 16)
    acc_trainer.fit(model, data(), data(64), micro_batch="auto", output_dir=out, **JOB)


def test_two_processes_agree_on_the_size_that_fits_both(tmp_path):
    """Process 0 fits 32 samples, process 1 only 16: both take 16 (a share of 32 each, accumulated twice)."""
    forked(_uneven, tmp_path / "run", processes=2)
    run = summary(tmp_path / "run")
    assert (run["world_size"], run["grad_accum"], run["per_process_batch_size"]) == (2, 2, 16)
    assert any("(the largest that fits: 32 out of memory, 16 fits; tried on" in note for note in run["notes"])


def test_auto_tries_the_model_that_will_train(tmp_path):
    """The sizes are tried on the model as it trains: with --lora and --gradient-checkpointing, the try holds
    gradients and optimizer state for the adapters that train (not for every weight) and runs with checkpointing on."""
    pytest.importorskip("peft")
    from lm_probe import base_model, documents, pad
    from peft import LoraConfig, get_peft_model

    run = acc_trainer.fit(base_model(), documents(32, 0), collate_fn=pad, lora=4, lora_targets=["q_proj", "v_proj"],
                          gradient_checkpointing=True, micro_batch="auto", batch_size=8,
                          max_steps=1, progress="none", plots=False, output_dir=str(tmp_path / "run"))
    adapted = get_peft_model(base_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trains = sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n)
    total = sum(p.numel() for p in adapted.parameters())
    said = [note for note in run["notes"] if note.startswith("--micro-batch")]
    assert said == ["--micro-batch: 8 samples per process, accumulated 1 times to the 8 of each process's share of the "
                    f"global batch (the largest that fits: 8 fits; tried on {trains:,} of {total:,} parameters with "
                    "gradients and optimizer state, gradient checkpointing on)"]


@pytest.mark.parametrize("args, message", [
    (["--micro-batch", "0"], "--micro-batch takes a positive number of samples or auto, not '0'"),
    (["--micro-batch", "half"], "--micro-batch takes a positive number of samples or auto, not 'half'"),
    (["--micro-batch", "16", "--grad-accum", "2"], "give --micro-batch or --grad-accum, not both"),
    (["--micro-batch", "5", "--batch-size", "64"], "--micro-batch 5 does not divide the 64 samples of --batch-size 64"),
])
def test_bad_micro_batches_are_one_line(tmp_path, args, message):
    result = run_cli("--model", "linreg", "--dataset", "linear", "--max-steps", "1", *args, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and not (tmp_path / "runs").exists()


def test_a_number_sets_the_accumulation(tmp_path):
    run = acc_trainer.fit(Limited(), data(), data(64), micro_batch=8, output_dir=str(tmp_path / "run"), **JOB)
    assert (run["grad_accum"], run["per_process_batch_size"]) == (8, 8)
    assert any("--micro-batch: 8 samples per process, accumulated 8 times" in n and "(as asked)" in n
               for n in run["notes"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
