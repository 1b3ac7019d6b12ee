"""The forward hooks of `acc-trainer check`'s job processes (check.py): a fingerprint of every training sample the
model is given and whether the call drew random numbers, and the test that tells the loop's training steps from the
model's other calls (the checks at start, the FLOP count).
"""

from __future__ import annotations

import sys

import torch


def _recorder(record: dict):
    """Forward hooks: a fingerprint of every sample of every training call (micro-batch), and whether
    the call drew from torch's global random number generators (dropout, torch.rand)."""
    state = {}

    def before(module, args, kwargs):
        if not module.training or not _in_training_steps():
            return
        rows = _sample_rows([*args, *kwargs.values()])
        if rows is not None:
            record["samples"].append([_fingerprint(row) for row in rows])
        state["rng"] = _rng_states()

    def after(module, args, output):
        if module.training and _in_training_steps() and "rng" in state and not record["draws"]:
            record["draws"] = any(not torch.equal(a, b) for a, b in zip(state["rng"], _rng_states(), strict=True))

    return before, after


@torch.compiler.disable  # a stack walk: not something --compile's graphs can hold
def _in_training_steps() -> bool:
    """Whether the model is called by the loop's training steps (loop.train_epoch is on the stack), not by the
    checks at start (components.check_fit) or the FLOP count, which pass the first samples through it."""
    from ..training.loop import train_epoch

    # sys._getframe (CPython's frame access, documented as implementation-specific): the recorder asks where
    # it is called from instead of the core setting a flag for it.
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is train_epoch.__code__:
            return True
        frame = frame.f_back
    return False


def _sample_rows(values: list) -> list[torch.Tensor] | None:
    """Each sample of the model's first input, flattened: the rows of a batched tensor, or the tensors of a
    list of samples (images for a detector). Padding is left out where an attention mask of 0s and 1s
    marks it (a sample padded to one length on 1 process and to another on 2 is the same sample);
    padding with 0s adds nothing to the fingerprint anyway."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim():
            x = value.detach().double().cpu()
            mask = next((m for m in tensors[1:] if m.shape == value.shape and m.dim() == 2 and not m.is_floating_point()
                         and bool(((m == 0) | (m == 1)).all())), None)
            if mask is not None and value.dim() == 2:
                return [row[keep.bool()] for row, keep in zip(x, mask.cpu(), strict=True)]
            return list(x.reshape(len(x), -1))
        if isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
            return [t.detach().flatten().double().cpu() for t in value]
    return None


def _fingerprint(row: torch.Tensor) -> list[float]:
    weights = torch.arange(1, len(row) + 1, dtype=torch.float64)
    return [round(row.sum().item(), 6), round((row * weights).sum().item(), 6)]


def _rng_states() -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])]
