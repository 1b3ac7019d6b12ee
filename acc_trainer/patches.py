"""Every change acc_trainer makes to the code of Accelerate and torch, and to the process.

Each patch is applied only on the minor versions of its package it was written and tested for (TESTED);
on any other version the package's own code runs, and `notes()` says, in one line per package, what is
off. A test (tests/test_patches.py) fails when a symbol a patch relies on moves or changes its signature.
`import acc_trainer` applies none of them. What each one reaches (docs/performance.md has the table):

- the trainer's own Accelerator: `backward` without a division by one (`apply_to`);
- the process: Accelerate's optimizer wrapper asks two questions once instead of every step, and its
  unwrap_model imports DeepSpeed only when something has (`apply_to_process`). These speed-ups and the one
  above are left off with ACC_TRAINER_PATCHES=0;
- a block of code (context managers, the previous state restored): a torchmetrics object's own
  synchronisation while acc_trainer computes it (`unsynced`), torch's worker info while acc_trainer's
  reader worker runs a stream (`worker_info_hidden`), Accelerate's note on tied weights while acc_trainer saves
  (`shared_tensors_unsaid`), the frozen parameters of a partly frozen model under FSDP left out of its
  checkpoints (`sharded_trainable_only`), Accelerate's notebook launcher's refusal of an imported bitsandbytes once
  CUDA is known to be untouched (`bitsandbytes_not_refused`);
- the run's own Accelerate state: FSDP on CPU processes (`fsdp_on_cpu`, docs/scaling.md);
- glibc's allocator, from the command line only (`keep_freed_memory`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import inspect
import logging
import os
import re
import sys
import types

import accelerate.optimizer
import accelerate.utils.other
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType

# The first and last minor version of each package that the patches were written and the suite run on.
TESTED = {"accelerate": ((1, 15), (1, 15)), "torch": ((2, 14), (2, 14))}

_OFF = {  # what runs as the package's own code on an untested version, and what that changes
    "accelerate": "Accelerate's own code runs, without the speed-ups of docs/performance.md, and FSDP is not set "
                  "up on CPU processes",
    "torch": "a stream read by acc_trainer's worker process (--num-workers 1) is told it runs in a DataLoader "
             "worker (a `datasets` stream may then read in another order than with --num-workers 0)",
}


@functools.cache
def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def tested(package: str) -> bool:
    """Whether the installed version of `package` is one the patches were tested on."""
    found = re.match(r"(\d+)\.(\d+)", _version(package) or "")
    first, last = TESTED[package]
    return found is not None and first <= (int(found[1]), int(found[2])) <= last


def written_for(package: str) -> str:
    """The tested minor versions of `package`, as text: "1.15", or "1.14 to 1.15"."""
    first, last = (".".join(map(str, minor)) for minor in TESTED[package])
    return first if first == last else f"{first} to {last}"


def notes() -> list[str]:
    """One line for each package in use (imported) whose patches are off because its version was not tested."""
    return [f"{package} {_version(package)} is untested with acc_trainer's patches (written for "
            f"{written_for(package)}): {_OFF[package]}"
            for package in TESTED if package in sys.modules and not tested(package)]


def enabled() -> bool:
    """ACC_TRAINER_PATCHES=0 leaves Accelerate's code as it is (docs/performance.md)."""
    return os.environ.get("ACC_TRAINER_PATCHES", "1") != "0"


def apply_to_process() -> None:
    """The speed-ups that reach the whole process (module attributes of Accelerate); applying them twice
    changes nothing."""
    if enabled() and tested("accelerate"):
        cache_accelerate_lookups()
        import_deepspeed_only_when_used()


def apply_to(accelerator: Accelerator) -> None:
    """The speed-ups bound to a run's `accelerator` alone."""
    if enabled() and tested("accelerate"):
        no_division_by_one(accelerator)


def cache_accelerate_lookups() -> None:
    """AcceleratedOptimizer.step (1.15) asks `is_lomo_available()` twice, a search of sys.path for the
    `lomo_optim` package, and AcceleratedOptimizer.zero_grad `inspect.signature`s the optimizer's zero_grad
    to see if it takes `set_to_none`: half a small model's speed. Neither answer can change while the
    process runs, so each is computed once; Accelerate's code path is otherwise unchanged."""
    lookup = accelerate.optimizer.is_lomo_available
    if not hasattr(lookup, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(lookup)
    if accelerate.optimizer.inspect is inspect:
        accelerate.optimizer.inspect = _CachedSignatures()


class _CachedSignatures:
    """The `inspect` module, with `signature` of a (bound) method computed once per function."""

    def __getattr__(self, name):
        return getattr(inspect, name)

    @staticmethod
    def signature(method):
        return _signature(getattr(method, "__func__", method))


@functools.cache
def _signature(function):
    return inspect.signature(function)


def import_deepspeed_only_when_used() -> None:
    """Accelerate's unwrap_model (1.15) imports deepspeed, when it is installed, only to test whether a model
    is a DeepSpeedEngine: a warning about the accelerator and a second. No model can be one before deepspeed
    is imported, so until then the answer is "not available": the same unwrapped model, without the import."""
    own = accelerate.utils.other.is_deepspeed_available
    if getattr(own, "__module__", None) != "accelerate.utils.imports":
        return  # already done here, or replaced by someone else: theirs runs as it is

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and own()

    accelerate.utils.other.is_deepspeed_available = is_deepspeed_available


def no_division_by_one(accelerator: Accelerator) -> None:
    """Accelerator.backward (1.15) divides the loss by the gradient accumulation steps even when that is 1:
    one more operation forward and one more node backward in every step, 5 % of a small model's step
    (`acc-trainer bench`, linear regression). Division by 1 is exact, so this accelerator's backward hands
    the loss straight to `loss.backward()`, where Accelerate would do exactly that after dividing; every other
    case (accumulation, a grad scaler, DeepSpeed, Megatron-LM, LOMO) runs Accelerate's own code."""
    own = type(accelerator).backward
    if "backward" in vars(accelerator) or (own.__module__, own.__qualname__) != ("accelerate.accelerator",
                                                                                 "Accelerator.backward"):
        return  # already done here, or replaced by someone else (a subclass, a profiler): theirs runs as it is
    accelerator.backward = types.MethodType(_backward, accelerator)


def _backward(self: Accelerator, loss, **kwargs):
    if (self.gradient_accumulation_steps == 1 and self.scaler is None and "learning_rate" not in kwargs
            and self.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)):
        loss.backward(**kwargs)
        return None
    return type(self).backward(self, loss, **kwargs)


def fsdp_on_cpu(accelerator: Accelerator, plugin) -> bool:
    """torch's FSDP2 shards over gloo (CPU) as well as NCCL, but Accelerate (1.15) switches FSDP on only for
    GPU process groups. For CPU processes this makes the assignments Accelerate's `AcceleratorState.__init__`
    makes for a GPU group, with `plugin`; preparation, sharding, clipping and checkpoints are then
    Accelerate's own FSDP2 code. False, with nothing changed, on an untested Accelerate."""
    if not tested("accelerate"):
        return False
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    # Accelerate keeps the two states in step the same way (an AcceleratorState() created later, as
    # prepare() does, copies PartialState's distributed_type).
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


@contextlib.contextmanager
def unsynced(metric):
    """Within the block, a torchmetrics object computes from its own states only: acc_trainer has already
    updated it with every process's samples. Its documented `distributed_available_fn` option (a public
    constructor argument since torchmetrics 0.11, read in every `compute`) answers "not distributed" there;
    the object's own is restored after. Not version-guarded: it uses torchmetrics' public API, and an
    unguarded fallback would count every sample once per process. Anything without the option runs as it is."""
    if not hasattr(metric, "distributed_available_fn"):
        yield metric
        return
    own = metric.distributed_available_fn
    metric.distributed_available_fn = _not_distributed
    try:
        yield metric
    finally:
        metric.distributed_available_fn = own


def _not_distributed() -> bool:
    return False


@contextlib.contextmanager
def worker_info_hidden():
    """Within the block, torch's `get_worker_info()` answers None, as in the main process. Used in
    acc_trainer's reader worker, which must give the same samples as a thread: `datasets` (5.2) splits its
    shards among DataLoader workers and reorders a shuffled stream when it sees one, and a user's stream may
    split itself alike. torch (2.14) keeps the answer in a module attribute, restored after the block."""
    if not tested("torch"):
        yield
        return
    from torch.utils.data._utils import worker

    own, worker._worker_info = worker._worker_info, None
    try:
        yield
    finally:
        worker._worker_info = own


@contextlib.contextmanager
def bitsandbytes_not_refused():
    """Within the block, Accelerate's notebook_launcher does not refuse to launch because bitsandbytes is imported.
    Accelerate (1.15) refuses whenever the module is in sys.modules, for fear its import initialized CUDA, which a
    forked process cannot use; peft imports it wherever it is installed, so a LoRA run in a notebook would stop every
    later launch, CUDA or not. acc_trainer's launch_in_notebook asks CUDA itself (torch.cuda.is_initialized) before
    the block. The launcher module's own reference to its check, replaced, is restored after."""
    if not tested("accelerate"):
        yield
        return
    import accelerate.launchers as launchers

    own = launchers.are_libraries_initialized
    launchers.are_libraries_initialized = lambda *names: [n for n in own(*names) if n != "bitsandbytes"]
    try:
        yield
    finally:
        launchers.are_libraries_initialized = own


@contextlib.contextmanager
def shared_tensors_unsaid():
    """Within the block, Accelerate's note "Removed shared tensor {...} while saving" is not logged: Accelerate (1.15)
    says it at every save of a model with tied weights (a causal LM's output layer and its embedding), on every
    process, though the file holding a tied tensor once is what safetensors needs, and acc_trainer's loaders tie it
    again (tested in tests/test_language_models.py). A filter on Accelerate's logger of that module, removed after."""
    logger = logging.getLogger(accelerate.utils.other.__name__)
    unsaid = _Unsaid("Removed shared tensor")
    logger.addFilter(unsaid)
    try:
        yield
    finally:
        logger.removeFilter(unsaid)


@contextlib.contextmanager
def sharded_trainable_only(active: bool = True):
    """Within the block, Accelerate's FSDP2 checkpoint of a model saves and loads the parameters that train (and the
    buffers), not the frozen ones: a LoRA or --freeze checkpoint under FSDP then holds the adapter and its optimizer
    state as under DDP, not the whole base model again. Accelerate 1.15 has no such option for `save_state` (its
    `adapter_only` is peft's alone and not passed on); torch's state-dict options have one, `ignore_frozen_params`,
    which this adds to the options Accelerate's FSDP save and load build (`_prepare_sd_options`), with `strict=False`
    for the load (the frozen tensors are the ones the run built). torch 2.14 drops a frozen parameter under its first
    name only: a tied one's other name (a causal LM's output layer, tied to its frozen embedding) is dropped here too
    (`_get_model_state_dict`). Only on the tested Accelerate; elsewhere (or `active` False) the checkpoint holds the
    whole model, which resumes as well."""
    import dataclasses

    from accelerate.utils import fsdp_utils

    if not (active and tested("accelerate")):
        yield
        return
    own_options, own_state = fsdp_utils._prepare_sd_options, fsdp_utils._get_model_state_dict

    def options(plugin):
        found = own_options(plugin)
        return found and dataclasses.replace(found, ignore_frozen_params=True, strict=False)

    def state(model, adapter_only=False, sd_options=None):
        frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {k: v for k, v in own_state(model, adapter_only, sd_options).items() if k not in frozen}

    fsdp_utils._prepare_sd_options, fsdp_utils._get_model_state_dict = options, state
    try:
        yield
    finally:
        fsdp_utils._prepare_sd_options, fsdp_utils._get_model_state_dict = own_options, own_state


class _Unsaid(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def leave_without_teardown(code: int) -> None:
    """Ends a finished process of a multi-process command with `code`, without the interpreter's teardown:
    torch 2.14's gloo now and then aborts a finished process there ("terminate called without an active
    exception", SIGABRT), after every file is written, which the launcher reports as a failed run. The
    command's files are closed and its process group destroyed by then; the output streams are flushed here.
    On another torch the interpreter ends as usual. The command line only (cli.main)."""
    if not tested("torch"):
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def keep_freed_memory() -> None:
    """glibc hands large freed blocks back to the operating system and faults them in again on the next
    allocation: a training step frees and reallocates the same batch-sized tensors every time, and on a CPU
    that cost a small CNN a third of its speed here (and grows as a process ages). Keep freed memory for
    reuse instead (mallopt: mmap threshold at glibc's 32 MiB maximum, no trim). It changes the whole
    process's allocator, so only the command line (cli.main) and the hand-written baselines call it."""
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
