"""The per-step work acc_trainer removes from Accelerate (acc_trainer/patches.py) changes no result."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import accelerate.optimizer
import accelerate.utils.other
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, extract_model_from_parallel
from torch.overrides import TorchFunctionMode

from acc_trainer import patches


class _Divisions(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in ("__truediv__", "div")
        return func(*args, **(kwargs or {}))


def _gradient(backward) -> tuple[torch.Tensor, int]:
    """The weight's gradient after `backward(loss)`, and the divisions it made."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    loss = ((model(torch.randn(8, 3)) - 1) ** 2).mean()
    with _Divisions() as divisions:
        backward(loss)
    return model.weight.grad.clone(), divisions.count


@pytest.fixture
def accelerate_as_installed(monkeypatch):
    """Accelerate's module attributes that the patches replace, restored after the test."""
    for module, name in ((accelerate.optimizer, "is_lomo_available"), (accelerate.optimizer, "inspect"),
                         (accelerate.utils.other, "is_deepspeed_available")):
        monkeypatch.setattr(module, name, getattr(module, name))


def test_backward_skips_only_a_division_by_one_and_gives_the_same_gradients():
    one = Accelerator(cpu=True)
    reference, divided = _gradient(one.backward)
    assert divided == 1  # Accelerate's backward: loss / 1, then loss.backward()
    patches.no_division_by_one(one)
    patches.no_division_by_one(one)  # applied twice: still one wrapper around Accelerate's own
    assert one.backward.__func__ is patches._backward
    gradient, divided = _gradient(one.backward)
    assert divided == 0 and torch.equal(gradient, reference)  # bit-identical, without the division
    # Bound to that accelerator only: the class, and so every other Accelerator, runs Accelerate's own.
    assert Accelerator.backward.__module__ == "accelerate.accelerator"
    assert _gradient(Accelerator(cpu=True).backward)[1] == 1
    # With accumulation the loss is still divided, by Accelerate's own code.
    two = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    patches.no_division_by_one(two)
    halved, divided = _gradient(two.backward)
    assert divided == 1 and torch.equal(halved, reference / 2)


def test_someone_elses_backward_is_left_alone(monkeypatch):
    """A replacement of Accelerator.backward made before the trainer starts (a test's, a profiler's) runs."""
    calls = []

    def theirs(self, loss, **kwargs):
        calls.append(loss)
        loss.backward(**kwargs)

    monkeypatch.setattr(Accelerator, "backward", theirs)
    accelerator = Accelerator(cpu=True)
    patches.no_division_by_one(accelerator)
    assert "backward" not in vars(accelerator)
    _gradient(accelerator.backward)
    assert len(calls) == 1


class _NoSetToNone(torch.optim.SGD):
    def zero_grad(self):  # an optimizer whose zero_grad takes no set_to_none (as some third-party ones)
        super().zero_grad(set_to_none=False)


def test_cached_lookups_keep_each_optimizers_own_answer(accelerate_as_installed):
    """zero_grad's signature is kept per function, not per call site: two optimizer classes with different
    zero_grad signatures behave as with Accelerate's own lookups (gradients freed, or zeroed in place)."""
    patches.cache_accelerate_lookups()
    patches.cache_accelerate_lookups()
    assert hasattr(accelerate.optimizer.is_lomo_available, "cache_info")
    assert accelerate.optimizer.is_lomo_available() == accelerate.utils.is_lomo_available()
    for kind, after in ((torch.optim.SGD, None), (_NoSetToNone, 0.0), (torch.optim.SGD, None)):
        weight = torch.nn.Parameter(torch.ones(2))
        optimizer = accelerate.optimizer.AcceleratedOptimizer(kind([weight], lr=0.5), device_placement=False)
        (weight * 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert torch.equal(weight.detach(), torch.zeros(2))  # 1 - 0.5 * 2
        assert (weight.grad is None) if after is None else torch.equal(weight.grad, torch.zeros(2))


def test_unwrapping_imports_deepspeed_only_once_something_has(accelerate_as_installed, monkeypatch):
    own = accelerate.utils.other.is_deepspeed_available
    patches.import_deepspeed_only_when_used()
    patches.import_deepspeed_only_when_used()  # applied twice: one wrapper
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    model = torch.nn.Linear(2, 2)
    assert extract_model_from_parallel(model) is model and "deepspeed" not in sys.modules
    assert accelerate.utils.other.is_deepspeed_available() is False
    # Once deepspeed is imported (a DeepSpeed run), Accelerate's own answer.
    imported = types.ModuleType("deepspeed")
    imported.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed", imported)
    assert accelerate.utils.other.is_deepspeed_available() is own()


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_the_built_in_optimizers_give_torchs_own_update(tmp_path, name):
    """A built-in optimizer gives bit for bit the update of torch's own optimizer as a user builds it (on a CPU torch's
    default, its loop over parameters; on a GPU foreach, the same update); --fused-optimizer its fused kernel, the same
    to rounding on one process."""
    from safetensors.torch import load_file

    import acc_trainer

    def data():
        g = torch.Generator().manual_seed(3)
        return torch.utils.data.TensorDataset(torch.randn(128, 8, generator=g), torch.randint(0, 3, (128,), generator=g))

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))

    job = dict(batch_size=32, max_steps=8, lr=0.01, weight_decay=0.01, progress="none", plots=False)
    torch_own = {"sgd": lambda groups: torch.optim.SGD(groups, lr=0.01, momentum=0.9, weight_decay=0.01),
                 "adam": lambda groups: torch.optim.Adam(groups, lr=0.01, weight_decay=0.01),
                 "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.01)}[name]
    runs = {}
    for run, options in (("ours", {"optimizer": name}), ("fused", {"optimizer": name, "fused_optimizer": True}),
                         ("torch", {"optimizer": torch_own})):
        acc_trainer.fit(net(), data(), output_dir=str(tmp_path / run), **job, **options)
        runs[run] = load_file(tmp_path / run / "model.safetensors")
    assert all(torch.equal(runs["ours"][k], runs["torch"][k]) for k in runs["torch"])
    assert max((runs["fused"][k] - runs["torch"][k]).abs().max().item() for k in runs["torch"]) < 1e-6
