"""Small measurements of a run: FLOPs per sample and the device's peak (for MFU), weight fingerprints
(equal weights, equal prints), peak memory and the versions of the libraries that ran."""

from __future__ import annotations

import platform
import resource

import torch


def fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """Sum and sum of squares of every parameter, in float64: equal models give equal fingerprints."""
    params = [p.detach().double() for p in model.parameters()]
    return torch.stack([p.sum() for p in params] + [p.square().sum() for p in params])


def library_versions() -> dict:
    """From the installed packages' metadata: importing torchvision only to read its version cost a run
    that does not use it 0.3 s."""
    from importlib.metadata import PackageNotFoundError, version

    import accelerate

    from . import __version__

    versions = {"acc_trainer": __version__, "python": platform.python_version(), "torch": torch.__version__,
                "accelerate": accelerate.__version__}
    try:
        versions["torchvision"] = version("torchvision")
    except PackageNotFoundError:  # reported as missing; the run did not need it
        versions["torchvision"] = None
    return versions


def flops_per_sample(model: torch.nn.Module, batch, forward_fn=None) -> int:
    """Training FLOPs of one sample (forward + backward) in matrix multiplies and convolutions; `batch`
    holds one sample, as the loader collates it.

    The same count torch.utils.flop_counter.FlopCounterMode gives (a test checks it on every model),
    from one forward pass of hooks on Linear and Conv layers: FlopCounterMode's first use costs a
    second of start-up. Per layer: forward F, weight gradient F, input gradient F unless the input
    needs none (the first layer). `forward_fn(model, batch)`: the run's own, else losses.forward."""
    from .losses import forward

    total = 0

    def count(module, inputs, output):
        nonlocal total
        if isinstance(module, torch.nn.Linear):
            forward_flops = 2 * module.in_features * output.numel()
        else:  # ConvNd: every output value sums in_channels/groups x kernel products
            kernel = 1
            for k in module.kernel_size:
                kernel *= k
            forward_flops = 2 * (module.in_channels // module.groups) * kernel * output.numel()
        total += forward_flops * (3 if inputs[0].requires_grad else 2)

    layers = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, layers)]
    was_training = model.training
    try:
        model.eval()  # BatchNorm statistics stay untouched; the FLOPs are the same
        # Only the main process counts: the random numbers a model may draw must stay in step.
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            (forward_fn or forward)(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return total


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
