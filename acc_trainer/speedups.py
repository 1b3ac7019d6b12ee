"""Work removed from every training step: measured with `acc-trainer bench` against hand-written
loops (see the README's Performance section). Each fix is at the place the time was lost and leaves
behaviour unchanged.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import sys

import accelerate.optimizer
from accelerate import Accelerator
from accelerate.utils import DistributedType


def apply() -> None:
    cache_accelerate_lookups()
    no_division_by_one()
    keep_freed_memory()


def keep_freed_memory() -> None:
    """glibc hands large freed blocks back to the operating system and faults them in again on the
    next allocation: a training step frees and reallocates the same batch-sized tensors every time,
    and on a CPU that cost a small CNN a third of its speed here (and grows as a process ages).
    Keep freed memory for reuse instead (mallopt: mmap threshold at glibc's 32 MiB maximum, no trim)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def cache_accelerate_lookups() -> None:
    """Removes work Accelerate (1.15) repeats on every step, which costs a small model half its speed.

    AcceleratedOptimizer.step asks `is_lomo_available()` twice: a search of sys.path for the
    `lomo_optim` package. AcceleratedOptimizer.zero_grad calls `inspect.signature` on the optimizer's
    zero_grad to see if it takes `set_to_none`. Neither answer can change while the process runs, so
    each is computed once; Accelerate's own code path is otherwise unchanged.
    """
    lookup = getattr(accelerate.optimizer, "is_lomo_available", None)
    if lookup is not None and not hasattr(lookup, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(lookup)
    if getattr(accelerate.optimizer, "inspect", None) is inspect:
        accelerate.optimizer.inspect = _CachedSignatures()


class _CachedSignatures:
    """The `inspect` module, with `signature` of a (bound) method computed once per function."""

    def __getattr__(self, name):
        return getattr(inspect, name)

    @staticmethod
    def signature(method):
        return _signature(getattr(method, "__func__", method))


@functools.lru_cache(maxsize=None)
def _signature(function):
    return inspect.signature(function)


def no_division_by_one() -> None:
    """Accelerator.backward (1.15) divides the loss by the gradient accumulation steps even when that
    is 1: one more operation forward and one more node backward in every step, 5 % of a small
    model's step here (`acc-trainer bench`, linear regression). Division by 1 is exact, so the loss
    goes straight to `loss.backward()` where Accelerate would do exactly that after dividing; every
    other case (accumulation, a grad scaler, DeepSpeed, Megatron-LM, LOMO) runs Accelerate's own code.
    """
    original = Accelerator.backward
    if getattr(original, "__qualname__", "") != "Accelerator.backward" or original.__module__ != "accelerate.accelerator":
        return  # already wrapped here, or replaced by someone else (a test, a profiler): theirs runs as it is

    @functools.wraps(original)
    def backward(self, loss, **kwargs):
        if (self.gradient_accumulation_steps == 1 and self.scaler is None and "learning_rate" not in kwargs
                and self.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)):
            loss.backward(**kwargs)
            return
        return original(self, loss, **kwargs)

    backward.__qualname__ = "no_division_by_one.<locals>.backward"  # functools.wraps copied Accelerate's
    Accelerator.backward = backward
