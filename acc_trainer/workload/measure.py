"""Small measurements of a run: FLOPs per sample and the device's peak (for MFU: a data sheet's, or a CPU's
measured matrix-multiply rate), the device's wait between steps, weight fingerprints (equal weights, equal prints),
peak memory and the versions of the libraries that ran."""

from __future__ import annotations

import copy
import platform
import resource
import warnings
from collections.abc import Mapping

import torch
from accelerate.utils import send_to_device

from .. import patches
from .first_batch import first_samples


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


# Dense peaks (FLOP/s) from the vendors' data sheets, by the precision the matrix multiplies run in: "bf16" (also
# fp16), "tf32" (float32 on tensor cores, --tf32) and "fp32" (float32 without). SXM parts, matched as
# whole words ("L4" is not "L40S"); a PCIe or NVL part, slower, gets no peak.
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100": {"bf16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
}


def device_peak_flops(device: torch.device, precision: str = "bf16") -> float | None:
    """One GPU's dense peak for `precision` (bf16, fp16, tf32 or fp32), from PEAK_FLOPS; None for a device it does
    not list (and on a CPU: measured_matmul_flops measures one)."""
    if device.type != "cuda":
        return None
    import re

    name = torch.cuda.get_device_name(device)
    if re.search(r"\b(PCIe|NVL)\b", name):  # an H100 PCIe or NVL: other peaks than the SXM part's listed here
        return None
    peaks = next((peaks for key, peaks in PEAK_FLOPS.items() if re.search(rf"\b{key}\b", name)), None)
    return peaks and peaks["bf16" if precision == "fp16" else precision]


def run_precision(mixed_precision: str | None, tf32: bool, device_type: str = "cuda") -> str:
    """The precision a run's matrix multiplies take: bf16/fp16 under mixed precision, else tf32 (--tf32 on a GPU)
    or fp32."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    return "tf32" if tf32 and device_type == "cuda" else "fp32"


def measured_matmul_flops(precision: str = "fp32", size: int = 1024, repeats: int = 5) -> float:
    """This CPU's matrix-multiply rate (FLOP/s, all of torch's threads), the best of `repeats` products of two
    size x size matrices in `precision` (bf16, else float32): the CPU's peak for MFU, where no data sheet applies."""
    import time

    dtype = torch.bfloat16 if precision in ("bf16", "fp16") else torch.float32
    a, b = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(dtype), \
        torch.randn(size, size, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch.mm(a, b)  # the first call sets up the kernel
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


class StepGaps:
    """How long the device waited between training steps: the data time of a step, as the device saw it.

    On a GPU the host runs ahead of the device, so the host's wait for a batch says little of what the GPU did: a
    CUDA event is recorded where a step's work is queued to end (`ended`) and where the next one's begins (`began`,
    once its batch is on the device), and the time between them on the device is that step's data time, read back
    when the device is waited for anyway (the log step). No synchronisation in the steps. Elsewhere the device is the
    host: its wait for the batch, as `began` is given it. `forget` drops the gap across a pause (an evaluation, a
    log line, a checkpoint): the step after one counts no data time on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last_end = None
        self.pairs: list = []  # (end event, begin event) not yet read
        self.host_wait = 0.0

    def began(self, host_wait: float) -> None:
        if not self.cuda:
            self.host_wait += host_wait
            return
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        if self.last_end is not None:
            self.pairs.append((self.last_end, begin))
        self.last_end = None

    def ended(self) -> None:
        if self.cuda:
            self.last_end = torch.cuda.Event(enable_timing=True)
            self.last_end.record()

    def forget(self) -> None:
        self.last_end = None

    def read(self) -> float:
        """Seconds of data time since the last read."""
        if not self.cuda:
            waited, self.host_wait = self.host_wait, 0.0
            return waited
        if not self.pairs:
            return 0.0
        self.pairs[-1][1].synchronize()
        waited = sum(end.elapsed_time(begin) for end, begin in self.pairs) / 1000
        self.pairs.clear()
        return waited


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


def run_flops(job, model, accelerator) -> float:
    """FLOPs per training sample, counted on one sample by the main process only (0 on the others)."""
    if not accelerator.is_main_process:
        return 0
    return flops_per_sample(model, first_samples(job.data.train, job.data.kind.train, 1, job.collate, job.data.heads),
                            job.forward)


def device_notes(accelerator) -> list[str]:
    """A patch left off on a version it was not tested on; bf16 emulated on a CPU without bf16 instructions."""
    notes = patches.notes()
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "bf16" and cpu_bf16_instructions() is False:
        notes.append("note: this CPU has no bf16 instructions (AVX512-BF16, AMX or Arm's BF16): bf16 is emulated and "
                     "runs several times slower than --mixed-precision no (docs/language-models.md#precision-on-a-cpu)")
    return notes
