"""On a CUDA GPU: mixed precision, TF32, compile and channels-last, exact evaluation and resume.

`pytest -m gpu` runs these on a machine with a GPU; elsewhere they are skipped, saying why.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENET = {"model": "lenet", "train_size": 4096, "eval_size": 1001, "batch_size": 128, "max_steps": 96, "log_every": 8}


def _max_difference(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


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
        # TF32 rounds matmul inputs to 10 mantissa bits and 96 Adam steps amplify any rounding (the weights
        # end ~7e-2 apart): the run is judged by its evaluation, which must not move.
        assert abs(run["eval"]["loss"] - plain["eval"]["loss"]) < 0.01, name
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
