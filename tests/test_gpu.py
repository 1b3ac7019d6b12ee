"""On a CUDA GPU: mixed precision, TF32, compile and channels-last, exact evaluation and resume.

`pytest -m gpu` runs these on a machine with a GPU; elsewhere they are skipped, saying why.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENET = {"model": "lenet", "train_size": 4096, "eval_size": 1001, "batch_size": 128, "max_steps": 96, "log_every": 8}


def _max_difference(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _first_loss(summary: dict) -> float:
    """The training loss over the first --log-every steps, from the run's metrics.jsonl."""
    with open(f"{summary['output_dir']}/metrics.jsonl") as lines:
        return next(json.loads(line)["loss"] for line in lines if "loss" in json.loads(line))


def _weights(summary: dict) -> dict:
    return load_file(f"{summary['output_dir']}/model.safetensors")


class _Overflow(torch.autograd.Function):
    """Identity forward; in backward, infinite gradients in the `at`-th training call, as a real fp16
    overflow makes them."""

    calls = 0
    at = 3

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Overflow.calls += 1
        return grad * float("inf") if _Overflow.calls == _Overflow.at else grad


def test_fp16_loss_scaling_skips_an_overflowing_step_and_recovers(train_in_process, monkeypatch):
    from acc_trainer.workload.models import MLP

    forward = MLP.forward
    monkeypatch.setattr(MLP, "forward", lambda self, x: _Overflow.apply(forward(self, x)))
    _Overflow.calls = 0
    s = train_in_process(model="mlp", train_size=2048, eval_size=512, batch_size=128, max_steps=32,
                         mixed_precision="fp16")
    assert s["device"] == "cuda" and s["mixed_precision"] == "fp16"
    # The grad scaler skipped that one step (and may skip early ones while it finds its scale), then trained on.
    assert 1 <= s["loss_scale_skipped_steps"] <= 4
    assert all(torch.isfinite(w).all() for w in _weights(s).values())
    assert s["eval"]["accuracy"] > 0.5


def test_bf16_and_fp16_train_like_fp32(train_in_process):
    fp32 = train_in_process(**LENET, mixed_precision="no")
    bf16 = train_in_process(**LENET, mixed_precision="bf16")
    fp16 = train_in_process(**LENET, mixed_precision="fp16")
    for run in (bf16, fp16):
        assert abs(run["eval"]["accuracy"] - fp32["eval"]["accuracy"]) < 0.05
        assert abs(run["eval"]["loss"] - fp32["eval"]["loss"]) < 0.1
        assert run["eval_samples"] == 1001


def test_tf32_compile_and_channels_last_change_results_only_within_rounding(train_in_process):
    plain = train_in_process(**LENET, tf32=False)
    variants = {"tf32": train_in_process(**LENET, tf32=True),
                "channels_last": train_in_process(**LENET, tf32=False, channels_last=True),
                "compile": train_in_process(**LENET, tf32=False, compile=True)}
    for name, run in variants.items():
        # The final weights load into the plain model, by its own parameter names (compiled too).
        difference = _max_difference(_weights(plain), _weights(run))
        print(f"{name}: max weight difference from plain fp32 {difference:.1e}, "
              f"eval loss {run['eval']['loss']:.4f} vs {plain['eval']['loss']:.4f}")
        # Over the first 8 steps a variant may differ from plain fp32 by rounding only (TF32 keeps 10 mantissa
        # bits of a matmul's inputs, compile fuses and reorders sums): the training losses agree closely.
        assert abs(_first_loss(run) - _first_loss(plain)) < 2e-3, name
        # 96 Adam steps on LeNet then amplify any rounding (weights end 5e-2 to 7e-2 apart for every variant, and
        # compile's evaluation loss was 0.0125 away on an H100): the end is judged by what it can promise.
        assert abs(run["eval"]["loss"] - plain["eval"]["loss"]) < 0.03, name
        assert abs(run["eval"]["accuracy"] - plain["eval"]["accuracy"]) < 0.015, name


def test_evaluation_is_exact_and_a_resumed_run_is_bit_identical_on_cuda(train_in_process, monkeypatch, tmp_path):
    """With deterministic algorithms on (cuBLAS needs its workspace setting for that; LeNet's max-pool has
    no deterministic CUDA backward, so the MLP)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        job = {**LENET, "model": "mlp", "max_steps": 64, "checkpoint_every": "16",
               "output_dir": str(tmp_path / "whole")}
        whole = train_in_process(**job)
        cut = tmp_path / "cut" / "checkpoints"
        cut.mkdir(parents=True)
        (tmp_path / "whole" / "checkpoints" / "step-00000032").rename(cut / "step-00000032")
        resumed = train_in_process(**{**job, "output_dir": str(tmp_path / "cut"), "resume": "auto"})
    finally:
        torch.use_deterministic_algorithms(False)
    assert whole["eval_samples"] == resumed["eval_samples"] == 1001
    a, b = _weights(whole), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["eval"] == whole["eval"]


def test_a_batch_made_on_the_side_stream_is_waited_for_where_it_is_used():
    """The next batch is made on a side stream; the step that uses it must wait for it on the device. The side
    stream is held up first (a sleeping kernel): read without that wait, the batch would be memory not yet written."""
    from acc_trainer.data.augment import Augment
    from acc_trainer.data.datasets import InMemory, overlapped

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (512, 3, 32, 32), dtype=torch.uint8, generator=g).cuda()
    data = InMemory(images, torch.randint(0, 10, (512,), generator=g).cuda(),
                    augment=Augment("standard", seed=1, crop="pad", size=None))
    # Pinned: a copy from pageable memory would make the host wait for the side stream, and the test could not fail.
    index = torch.arange(256, 512).pin_memory()
    expected = [t.clone() for t in data.__getitems__(index)]
    torch.cuda.synchronize()

    def held_up():
        with torch.cuda.stream(data.side):
            torch.cuda._sleep(200_000_000)  # about a tenth of a second of the side stream's time
        yield data.__getitems__(index)

    for batch in overlapped(held_up(), data, torch.device("cuda")):
        got = [t.float().clone() for t in batch]  # on the default stream, as the step reads it
    torch.cuda.synchronize()
    assert data.side is None  # the epoch over, batches are made on the default stream again
    assert all(torch.equal(a.float(), b) for a, b in zip(expected, got))


def test_an_augmented_run_trains_the_same_with_its_batches_made_beside_the_steps(train_in_process, monkeypatch):
    from acc_trainer.training import loop

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    job = {"model": "mlp", "dataset": "synthetic", "augment": "standard", "train_size": 2048, "eval_size": 512,
           "batch_size": 128, "max_steps": 40}
    made, real = [], loop.overlapped

    def counted(batches, dataset, device):  # that every batch was made on the side stream
        for batch in real(batches, dataset, device):
            made.append(getattr(batch[0], "made_on_side", None) is not None)
            yield batch

    try:
        monkeypatch.setattr(loop, "overlapped", counted)
        beside = train_in_process(**job)
        monkeypatch.setattr(loop, "overlapped", lambda batches, dataset, device: batches)
        between = train_in_process(**job)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(made) == 40 and all(made)
    a, b = _weights(beside), _weights(between)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert beside["eval"] == between["eval"]
