"""Small measurements of a run: FLOPs per sample and the device's peak (for MFU), weight fingerprints
(equal weights, equal prints), peak memory and the versions of the libraries that ran."""

from __future__ import annotations

import copy
import platform
import resource
import warnings
from collections.abc import Mapping

import torch
from accelerate.utils import send_to_device


def fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """Sum and sum of squares of every parameter, in float64: equal models give equal fingerprints."""
    params = [p.detach().double() for p in model.parameters()]
    return torch.stack([p.sum() for p in params] + [p.square().sum() for p in params])


def library_versions() -> dict:
    """From the installed packages' metadata: importing torchvision only to read its version cost a run
    that does not use it 0.3 s."""
    from importlib.metadata import PackageNotFoundError, version

    import accelerate

    from .. import __version__

    versions = {"acc_trainer": __version__, "python": platform.python_version(), "torch": torch.__version__,
                "accelerate": accelerate.__version__}
    try:
        versions["torchvision"] = version("torchvision")
    except PackageNotFoundError:  # reported as missing; the run did not need it
        versions["torchvision"] = None
    return versions


def flops_per_sample(model: torch.nn.Module, batch, forward_fn=None) -> int:
    """Training FLOPs of one sample, forward + backward, as torch.utils.flop_counter.FlopCounterMode counts
    them: 2 per multiply-add of every matrix multiply, convolution and attention, and of the gradients
    autograd computes (of the weights that train and of every input that needs one: not the first
    layer's input). `batch` holds one sample, as the loader collates it; `forward_fn(model, batch)`: the
    run's own, else losses.forward.

    Counted in evaluation mode (the same FLOPs; BatchNorm takes one sample) on a copy of the model whose
    parameters and buffers are on the meta device: shapes only, no arithmetic, nothing of the model
    touched. A forward that reads values (`.item()`, a padding mask, NMS) cannot run there: then the
    sample runs through the model itself, forward and `autograd.grad` (no `.grad` changes). 0, with a
    warning, when it cannot run there either."""
    from .losses import forward

    forward_fn = forward_fn or forward
    try:
        return _counted(_on_meta(model), send_to_device(batch, "meta"), forward_fn)
    except Exception:  # the forward needs values: count on the model itself
        pass
    try:
        return _counted(model, batch, forward_fn)
    except Exception as error:  # the count is a figure of the run, not a reason to stop it
        warnings.warn(f"model FLOPs not counted ({type(error).__name__}: {error}): the summary gives no "
                      "flops_per_s or mfu", stacklevel=2)
        return 0


def _on_meta(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with its parameters and buffers on the meta device (no data copied), so that
    whatever its forward caches or changes stays in the copy."""
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in model.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
    return copy.deepcopy(model, memo)


def _counted(model: torch.nn.Module, batch, forward_fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode  # 0.1 s of imports, for runs only

    was_training = model.training
    model.eval()
    try:
        with (torch.enable_grad(), torch.random.fork_rng(devices=[]),
              FlopCounterMode(display=False, custom_mapping=ATTENTION) as counter):
            result = forward_fn(model, batch)
            ends = [t for t in _tensors(result) if t.requires_grad]
            trained = [p for p in model.parameters() if p.requires_grad]
            if ends and trained:
                torch.autograd.grad(ends, trained, [torch.ones_like(t) for t in ends], allow_unused=True)
    finally:
        model.train(was_training)
    return counter.get_total_flops()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Q K^T and the weights times V, of shapes (batch, heads, positions, head size)."""
    batch, heads, queries, size = query
    return 2 * batch * heads * queries * key[-2] * (size + value[-1])


def _attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """The gradients of both products' two inputs: twice the forward, as for any matrix multiply and as the
    attention decomposed into matrix multiplies (on the meta device) counts."""
    return 2 * _attention(query, key, value)


# torch 2.14 counts nothing for the CPU's fused attention kernel (what nn.functional.scaled_dot_product_attention
# runs on a CPU), and counts the backward of its fused CUDA kernels with the scores they compute again.
_aten = torch.ops.aten
ATTENTION = {_aten._scaled_dot_product_flash_attention_for_cpu: _attention,
             **dict.fromkeys([_aten._scaled_dot_product_flash_attention_for_cpu_backward,
                              _aten._scaled_dot_product_flash_attention_backward,
                              _aten._scaled_dot_product_efficient_attention_backward,
                              _aten._scaled_dot_product_cudnn_attention_backward], _attention_backward)}


# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets, for model FLOPs utilisation.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_mb(device: torch.device | None = None) -> float:
    """Peak memory of this process: the GPU allocator's on CUDA, else the resident set size."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def cpu_bf16_instructions(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes bf16 in hardware (x86: AVX512-BF16 or AMX-BF16; Arm: the BF16 extension), read
    from /proc/cpuinfo; None where that cannot be read (another system)."""
    try:
        text = open(cpuinfo).read()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) if flags else None
