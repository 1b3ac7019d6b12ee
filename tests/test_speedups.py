"""The per-step work acc_trainer removes from Accelerate (acc_trainer/speedups.py) changes no result."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from torch.overrides import TorchFunctionMode

from acc_trainer import speedups


class _Divisions(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in ("__truediv__", "div")
        return func(*args, **(kwargs or {}))


def _gradient(accelerator: Accelerator, backward) -> tuple[torch.Tensor, int]:
    """The weight's gradient after `backward(accelerator, loss)`, and the divisions it made."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    loss = ((model(torch.randn(8, 3)) - 1) ** 2).mean()
    with _Divisions() as divisions:
        backward(accelerator, loss)
    return model.weight.grad.clone(), divisions.count


def test_backward_skips_only_a_division_by_one_and_gives_the_same_gradients():
    speedups.no_division_by_one()
    speedups.no_division_by_one()  # applied twice: still one wrapper around Accelerate's own
    accelerates_own = Accelerator.backward.__wrapped__
    assert accelerates_own.__qualname__ == "Accelerator.backward" and not hasattr(accelerates_own, "__wrapped__")

    one = Accelerator(cpu=True)
    reference, divided = _gradient(one, accelerates_own)
    assert divided == 1  # Accelerate's backward: loss / 1, then loss.backward()
    gradient, divided = _gradient(one, Accelerator.backward)
    assert divided == 0 and torch.equal(gradient, reference)  # bit-identical, without the division
    # With accumulation the loss is still divided, by Accelerate's own code.
    two = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    halved, divided = _gradient(two, Accelerator.backward)
    assert divided == 1 and torch.equal(halved, reference / 2)


def test_someone_elses_backward_is_left_alone(monkeypatch):
    """A replacement of Accelerator.backward made before the trainer starts (a test's, a profiler's) runs."""
    calls = []

    def theirs(self, loss, **kwargs):
        calls.append(loss)
        loss.backward(**kwargs)

    monkeypatch.setattr(Accelerator, "backward", theirs)
    speedups.no_division_by_one()
    assert Accelerator.backward is theirs
    _gradient(Accelerator(cpu=True), Accelerator.backward)
    assert len(calls) == 1
