"""A trained model in the formats other tools load, each checked against the PyTorch model on samples.

    acc-trainer export RUN_DIR --format onnx|pt2|safetensors [--output FILE] [--samples N] [options]
    acc_trainer.export(RUN_DIR, model=..., data=..., format="onnx")   # a run fit() made: its model given again
    acc_trainer.export(model, dataset, format="pt2", output="model.pt2")

From a run folder the model is rebuilt as `evaluate` and `predict` rebuild it (inference.py: the run's config.yaml,
its weights verified and loaded; a LoRA run's adapter on its base), then merged when it holds LoRA adapters. The
inputs it is exported for are what the run's own forward function hands the model for the first samples of the
evaluation set, batched by the run's collate function (the labels left out: the exported model computes outputs,
not the loss); every dimension that the model lets vary (the batch, a sequence's length) stays variable. The file
written is then read back and run on those samples: ONNX through onnxruntime (onnx's reference evaluator where
onnxruntime is not installed), pt2 through `torch.export.load`, safetensors loaded into a copy of the model whose
every tensor was first set to NaN. The largest difference from the PyTorch model's outputs is printed and returned;
beyond 1e-3 of the outputs' scale the export counts as failed (exit 1).
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import sys
from pathlib import Path

import torch

from ..config import ConfigError, TrainConfig, did_you_mean, first_line
from ..language import adapters
from ..workload import components, losses
from ..workload.first_batch import first_samples

FORMATS = {"onnx": "ONNX", "pt2": "torch.export (pt2)", "safetensors": "safetensors"}
TOLERANCE = 1e-3  # of the outputs' largest magnitude (at least 1): float32 kernels in another order stay far below
_LARGE = 1 << 30  # bytes of weights past which ONNX keeps them beside the graph (protobuf holds at most 2 GiB)


def export(model_or_run, /, dataset=None, *, format: str, output: str | os.PathLike | None = None, model=None,
           data=None, weights=None, samples: int = 8, collate_fn=None, forward=None, config: TrainConfig | None = None,
           **options) -> dict:
    """`model` written as `format` (onnx, pt2, safetensors) to `output`, checked on the first `samples` samples of
    `dataset`; returns what `acc-trainer export` prints: `output`, `files`, `samples`, `max_abs_diff`,
    `checked_with`, `matches`. `export(RUN_DIR, model=..., data=..., format=...)`: a finished run's weights loaded
    into `model` as `evaluate` loads them, written to RUN_DIR/export/model.<format> unless `output` says where."""
    from ..training.api import fit_config
    from .inference import _given, _trained

    _check_format(format)
    given = _given(model_or_run, dataset, model, data, weights, config, "export", options.get("accept_unverified", False))
    model, dataset, config = given.model, given.dataset, given.config
    if given.weights is not None:
        model = _trained(model, given.weights, config)
    if output is None:
        if not isinstance(model_or_run, (str, os.PathLike)):
            raise ConfigError("export: give output= (a file) for a model given as an object")
        output = Path(model_or_run) / "export" / f"model.{format}"
    cfg = fit_config(model, dataset, config, options, collate_fn, forward)
    job = components.from_objects(model, dataset, None, None, {}, collate_fn or cfg.collate, forward or cfg.forward,
                                  cfg.pack, cfg.data_pipeline, cfg)
    training, device = model.training, next(model.parameters(), torch.empty(0)).device
    try:
        return export_job(job, format, Path(output), samples, owned=False)
    finally:
        model.train(training).to(device)  # the caller's model as it was given


def _check_format(format: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every process would write and read back the same files
        raise ConfigError("export runs as one process: run it without a launcher (the weights are whole in the run)")
    if format not in FORMATS:
        raise ConfigError(f"export: unknown format {format!r}; choose from {', '.join(FORMATS)}"
                          + did_you_mean(str(format), FORMATS))


def export_job(job: components.Workload, format: str, output: Path, samples: int = 8, owned: bool = True) -> dict:
    """`job.model` written as `format` to `output` and checked on the first `samples` samples of the workload's set.
    `owned`: the model is this export's to change (a LoRA model merged in place, else in a copy)."""
    if samples < 1:
        raise ConfigError(f"export: samples must be positive, got {samples}")
    merged = adapters.is_peft(job.model)
    model = _plain(job.model, owned)
    batch = _first_batch(job, samples)
    args, kwargs = _model_inputs(job, model, batch)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, a read-only file system
        raise ConfigError(f"export: --output {output}: its folder cannot be made ({type(e).__name__}: "
                          f"{e.strerror or first_line(e)})") from None
    files, got, checker = WRITERS[format](model, args, kwargs, output)
    difference, scale = _largest_difference(expected, got)
    count = next((len(t) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.dim()), samples)
    return {"format": format, "output": str(output), "files": files, "samples": count, "max_abs_diff": difference,
            "checked_with": checker, "matches": difference <= TOLERANCE * max(1.0, scale), "lora_merged": merged}


def _plain(model, owned: bool):
    """The model to export: in evaluation mode, on the CPU, its LoRA adapters merged into its weights."""
    if adapters.is_peft(model):
        model = (model if owned else copy.deepcopy(model)).merge_and_unload()
    return model.eval().cpu()


def _first_batch(job: components.Workload, samples: int):
    try:
        return first_samples(job.data.train, job.data.kind.train, samples, job.collate, job.data.heads)
    except (OSError, *components.MISFITS) as e:
        raise ConfigError(f"export: the first {samples} samples of {job.dataset_name} cannot be read or batched: "
                          f"{type(e).__name__}: {first_line(e)}") from None


def _model_inputs(job: components.Workload, model, batch) -> tuple[tuple, dict]:
    """The positional and keyword arguments the run's forward function passes the model for `batch` (seen by a
    forward pre-hook, so that any forward function and batch shape work), without `labels`; a transformers model
    is exported without its key/value cache (`use_cache=False`): one forward pass, its logits."""
    calls = []

    def seen(module, args, kwargs):
        calls.append((args, kwargs))

    hook = model.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        with torch.no_grad():
            (job.forward or losses.forward)(model, batch)
    except components.MISFITS as e:
        raise ConfigError(f"export: model {job.model_name} does not take the samples of {job.dataset_name}: "
                          f"{type(e).__name__}: {first_line(e)}") from None
    finally:
        hook.remove()
    if not calls:
        raise ConfigError(f"export: the forward function {getattr(job.forward, '__name__', job.forward)} never calls "
                          f"the model itself, so there is no call of {job.model_name} to export")
    args, kwargs = calls[0]
    kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs["use_cache"] = False
    return args, kwargs


def _exported(model, args: tuple, kwargs: dict):
    """torch.export's program of the model: the batch dimension of every input left to vary, and every dimension of
    integer inputs (token ids, masks, positions: a sequence's length varies too) where the model allows it; the other
    dimensions of a float input (an image's channels, height and width) stay what the model was trained on."""
    from torch.export import Dim

    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except TypeError as e:
        raise ConfigError(f"export: {type(model).__name__}'s forward does not take its inputs by name: {e}") from None
    def varying(v):
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return None
        return {i: Dim.AUTO for i in range(v.dim() if not v.is_floating_point() else 1)}

    shapes = {name: torch.utils._pytree.tree_map(varying, value) for name, value in bound.items()}
    try:
        return torch.export.export(model, args, kwargs, dynamic_shapes=shapes)
    except Exception as e:  # noqa: BLE001 - code torch.export cannot capture is the user's model, said in one line
        raise ConfigError(f"export: torch.export cannot capture {type(model).__name__}: {type(e).__name__}: "
                          f"{first_line(e)}") from None


def _pt2(model, args: tuple, kwargs: dict, output: Path) -> tuple:
    torch.export.save(_exported(model, args, kwargs), output)
    with torch.no_grad():
        return [str(output)], torch.export.load(output).module()(*args, **kwargs), "torch.export.load"


def _onnx_installed() -> None:
    try:
        import onnx  # noqa: F401 - torch's exporter needs both
        import onnxscript  # noqa: F401
    except ImportError:
        raise ConfigError('--format onnx needs onnx and onnxscript: pip install onnx onnxscript onnxruntime (or pip '
                          'install -e ".[onnx]")') from None


def _onnx(model, args: tuple, kwargs: dict, output: Path) -> tuple:
    _onnx_installed()
    program = _exported(model, args, kwargs)
    large = sum(t.numel() * t.element_size() for t in model.state_dict().values()) > _LARGE
    for old in (output, output.with_name(output.name + ".data")):  # an earlier export's weights file would stay
        old.unlink(missing_ok=True)
    outputs = len(program.graph_signature.user_outputs)
    # Named for what they are, not for the layer that made them ("linear_2"): a model's one output, a language model's
    # logits.
    names = (["logits"] if hasattr(model, "config") and hasattr(model, "generate") else ["output"]) if outputs == 1 \
        else None
    torch.onnx.export(program, f=str(output), external_data=large, verbose=False, output_names=names)
    files = [str(p) for p in (output, output.with_name(output.name + ".data")) if p.exists()]
    inputs = [t.numpy() for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    got, checker = _run_onnx(output, inputs)
    return files, got, checker


def _run_onnx(path: Path, inputs: list) -> tuple[list, str]:
    """The ONNX file's outputs for `inputs` (in the order of the exported program's inputs): onnxruntime, else onnx's
    reference evaluator."""
    try:
        import onnxruntime
    except ImportError:
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(str(path))
        outputs = evaluator.run(None, dict(zip(evaluator.input_names, inputs, strict=True)))
        return outputs, "onnx.reference (onnxruntime is not installed)"
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise ConfigError(f"export: the ONNX file takes {len(names)} inputs ({', '.join(names)}), the model was given "
                          f"{len(inputs)} tensors")
    return session.run(None, dict(zip(names, inputs, strict=True))), f"onnxruntime {onnxruntime.__version__}"


def _safetensors(model, args: tuple, kwargs: dict, output: Path) -> tuple:
    """The weights through safetensors' save_model (a tied tensor kept once), loaded back into a copy of the model
    whose tensors are all NaN first: a tensor the file lacks shows in the outputs."""
    from safetensors.torch import load_model, save_model

    save_model(model, str(output))
    blank = copy.deepcopy(model)
    with torch.no_grad():
        for tensor in blank.state_dict().values():
            if tensor.is_floating_point():
                tensor.fill_(math.nan)
        load_model(blank, str(output), strict=True)
        return [str(output)], blank(*args, **kwargs), "safetensors.torch.load_model"


WRITERS = {"onnx": _onnx, "pt2": _pt2, "safetensors": _safetensors}


def _largest_difference(expected, got) -> tuple[float, float]:
    """(the largest absolute difference between the two outputs' tensors, taken in order, NaN counting as
    infinite; the largest magnitude of the expected ones)."""
    want = [t for t in torch.utils._pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    have = [torch.as_tensor(t) for t in torch.utils._pytree.tree_leaves(got)
            if isinstance(t, torch.Tensor) or hasattr(t, "__array__")]
    if len(want) != len(have) or any(w.shape != h.shape for w, h in zip(want, have, strict=True)):
        return math.inf, 0.0
    difference, scale = 0.0, 0.0
    for w, h in zip(want, have, strict=True):
        w, h = w.detach().double(), h.detach().double()
        gap = (w - h).abs().nan_to_num(nan=math.inf)
        difference = max(difference, float(gap.max()) if gap.numel() else 0.0)
        scale = max(scale, float(w.abs().max()) if w.numel() else 0.0)
    return difference, scale


def describe(result: dict) -> str:
    """The line `acc-trainer export` prints."""
    files = " and ".join(result["files"])
    return (f"{FORMATS[result['format']]}{', its LoRA adapters merged' if result['lora_merged'] else ''}: {files}; "
            f"on {result['samples']} evaluation samples its outputs differ from "
            f"the PyTorch model's by at most {result['max_abs_diff']:.2g} ({result['checked_with']})"
            + ("" if result["matches"] else f": more than {TOLERANCE:g} of their scale, the export does not match"))


def main(argv: list[str]) -> None:
    """`acc-trainer export RUN_DIR --format onnx|pt2|safetensors [--output FILE] [--samples N] [options]`."""
    from ..distributed import processes
    from ..flags import Parser
    from .inference import _run_options, _workload

    own = Parser(prog="acc-trainer export", add_help=False)
    own.add_argument("--format", choices=list(FORMATS), help="what to write (needed): ONNX, torch.export's pt2, or "
                     "safetensors")
    own.add_argument("--samples", type=int, default=8, metavar="N",
                     help="how many of the evaluation set's first samples check the file (default 8)")
    known, rest = own.parse_known_args(argv)
    cfg, given = _run_options(
        rest, "export", "A finished run's model as ONNX, torch.export's pt2 or safetensors, read back and checked on "
        "the evaluation set's first samples.", "where to write it (default: RUN_DIR/export/model.<format>)",
        parents=(own,))
    if known.format is None:
        raise ConfigError(f"acc-trainer export needs --format {'|'.join(FORMATS)}")
    _check_format(known.format)
    if known.format == "onnx":
        _onnx_installed()  # before the model is rebuilt
    output = given.output or given.run / "export" / f"model.{known.format}"
    processes.start(cfg)
    job, _ = _workload(cfg, given.weights, given.split)
    result = export_job(job, known.format, output, known.samples)
    print(f"{cfg.model} ({given.weights}) as {describe(result)}")
    if not result["matches"]:
        sys.exit(1)
