"""The one place where names become objects: a run's model, data, loss and metrics.

`--model`, `--dataset`, `--loss` and `--metrics` take a built-in name (the registries: datasets.DATASETS,
models.MODELS, losses.LOSSES, metrics.METRICS), `torchvision:<name>` / `timm:<name>` for models, or an
import path `pkg.module:attr` (a module in the current folder works too). Every process resolves the
same strings itself, so nothing is pickled. `fit()` hands objects directly; both end in a `Workload`,
the only thing the training loop takes.

Factories are called with `--model-args` / `--dataset-args` as keyword arguments, plus what the run
knows, for each parameter the factory declares and the arguments do not set: a model factory gets
`num_classes`, `input_shape` and `data` (the `Data` of the run); a dataset factory gets `seed` and
`config` (the `TrainConfig`). The built-in factories take `data` and `config` this way.

Where the data is built, its kind is decided once (data/kinds.py: `Data.kind`). Before anything is written, the
first-sample check (first_batch.py) passes two samples through the model, the loss and the metrics.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from torch import nn

from ..config import IMPORT_PATH, ConfigError, TrainConfig, dataset_sets, first_line, is_data_path
from ..data import mixtures, packing
from ..data.datasets import DATASETS, Data, check_data, one_at_a_time, torchvision
from ..data.kinds import settle
from ..data.token_cache import TextSets, text_sets
from ..data.user_data import data_from, read_files
from . import losses, quantized
from . import metrics as builtin_metrics
from .models import MODELS

# Exceptions that mean "these pieces do not fit together" when one sample passes through them; others
# (NameError, ZeroDivisionError, ...) are bugs in the user's code and keep their traceback.
MISFITS = (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError, NotImplementedError)


@dataclass
class Workload:
    """What the training loop trains: objects, already built. `loss`/`metrics` None: chosen by
    `check_fit` from the model's outputs and the data's targets."""

    model: nn.Module
    data: Data
    loss: Callable | None
    metrics: dict[str, Callable] | None
    model_name: str
    dataset_name: str
    loss_name: str | None = None
    collate: Callable | None = None  # list of samples -> batch; None: torch's default_collate
    forward: Callable | None = None  # (model, batch) -> (outputs, targets); None: losses.forward
    optimizer: Callable | None = None  # factory(param_groups) -> Optimizer (fit); None: --optimizer
    scheduler: Callable | None = None  # factory(optimizer, total_steps) -> scheduler (fit); None: --scheduler
    objects: bool = False  # given as objects (fit): model_name and dataset_name are their classes, not factories
    tokenizer: Any = None  # --tokenizer's (or fit's): saved with the weights, used for --prompts (generation.py)
    on_evaluation: Callable | None = None  # fit's: called with each evaluation (loop.keep_evaluation)
    unnamed: tuple[str, ...] = ()  # what fit() was given that config.yaml cannot name (its first line says it)
    objective: Any = None  # what the run trains (objectives.of): set by setup, or by fit() with its reward functions
    init: dict | None = None  # --load-in-4bit: what loaded from --init-from (quantized.load), the model in 4 bits


def import_object(path: str, what: str) -> Any:
    """`pkg.module:attr.sub` -> the object. The current folder is importable, as with `python -m`."""
    module_name, _, attr = path.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script's sys.path lacks it
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ConfigError(f"{what} {path}: no module named {e.name!r} (looked in {os.getcwd()} and the installed "
                              "packages)") from None
        raise ConfigError(f"{what} {path}: importing {module_name} failed: {type(e).__name__}: {first_line(e)}") from None
    except (ImportError, SyntaxError) as e:
        raise ConfigError(f"{what} {path}: importing {module_name} failed: {type(e).__name__}: {first_line(e)}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {path}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def call_factory(factory: Callable, args: dict, known: dict, what: str) -> Any:
    """factory(**args, plus the `known` values its signature asks for); its failure is one line."""
    kwargs = dict(args)
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins and C types have no signature
        parameters = {}
    for name, value in known.items():
        if name in parameters and name not in kwargs and value is not None:
            kwargs[name] = value
    shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
    try:
        return factory(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{what}({shown}) raised {type(e).__name__}: {first_line(e)}") from None


# ---------------------------------------------------------------------------------------- from names


def build_workload(cfg: TrainConfig, trains: bool = True) -> Workload:
    """Everything `cfg` names, built in this process (every process calls this after seeding). Text samples become
    tokens with the run's tokenizer (data/token_cache.py's `TextSets`, --tokenizer's) before they are packed, unless a
    collate function of the user's takes the samples as they are (the main process tokenizes first and keeps the
    tokens in the token cache, which the others then read). `trains`: False for evaluate and predict, which only read
    a set."""
    from accelerate import PartialState

    # The main process builds the data first (and downloads, if it must); the others then read its
    # files. An error is raised only after the context, so that no process is left at its barrier.
    error, text = None, text_of(cfg)
    with PartialState().main_process_first():
        try:
            data = build_data(cfg, trains, text)
        except ConfigError as e:
            error = e
    if error is not None:
        raise error
    # --load-in-4bit: the factory names the architecture only (built on the meta device); --init-from's weights load
    # into it in 4 bits (quantized.py), never a whole model in its dtype first.
    model, init = quantized.load(cfg, lambda: build_model(cfg, data), cfg.model) if cfg.load_in_4bit else \
        (build_model(cfg, data), None)
    loss = build_loss(cfg.loss) if cfg.loss else None
    metrics = build_metrics(cfg.metrics) if cfg.metrics is not None else None
    collate, forward = build_batching(cfg.collate, cfg.forward)
    return Workload(model, data, loss, metrics, cfg.model, mixtures.label(cfg.dataset), cfg.loss,
                    _text_collate(collate, text), forward, tokenizer=getattr(text, "tokenizer", None), init=init)


def _text_collate(collate: Callable | None, text: TextSets) -> Callable | None:
    """The user's collate function; else, for unpacked text data, the padding one the text's kind asks for."""
    return collate if collate is not None else text.collate()


def build_batching(collate, forward) -> tuple[Callable | None, Callable | None]:
    """The collate and forward functions: objects, import paths, or a built-in forward's name."""
    if isinstance(collate, str):
        collate = _callable(import_object(collate, "--collate"), collate, "--collate")
    elif collate is not None:
        collate = _callable(collate, repr(collate), "fit: collate_fn")
    if isinstance(forward, str):
        forward = losses.FORWARDS[forward] if forward in losses.FORWARDS else _callable(
            import_object(forward, "--forward"), forward, "--forward")
    elif forward is not None:
        forward = _callable(forward, repr(forward), "fit: forward")
    return collate, None if forward is losses.forward else forward


def text_of(cfg: TrainConfig, tokenizer=None) -> TextSets:
    """How the run's text samples become tokens: with `tokenizer` (fit's object), else the one --tokenizer names."""
    return text_sets(cfg, tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None)


def build_data(cfg: TrainConfig, trains: bool = True, text: TextSets | None = None) -> Data:
    """The run's `Data` from --dataset, its text tokenized (`text`: the run's TextSets, made here when not given;
    `trains`: see build_workload)."""
    text = text if text is not None else text_of(cfg)
    spec, args = cfg.dataset, cfg.dataset_args or {}
    known = {"config": cfg, "seed": cfg.seed}
    if isinstance(spec, list):  # a mixture: each set built and tokenized as it would be alone, then mixed
        parts = [mixtures.Part(name, *_set_of(cfg, name, args), weight) for name, weight in dataset_sets(spec)]
        spec = mixtures.label(spec)
        train, eval_, notes = _mixed(parts, cfg.seed, text, cfg.collate is None)
        data = data_from(*packing.pack_sets(train, eval_, cfg.pack, spec), spec)
        data.notes += notes
    else:
        made = _made(spec, args, known)
        if isinstance(made, Data):
            data = made
        else:
            train, eval_ = text(*_pair(made, spec), spec) if cfg.collate is None else _pair(made, spec)
            data = data_from(*packing.pack_sets(train, eval_, cfg.pack, spec), spec)
    if cfg.pack and not packing.is_packed(data.train):  # a built-in set: refused there, naming its samples
        data = data_from(*packing.pack_sets(data.train, data.eval, cfg.pack, spec), spec)
    data.notes += text.notes
    data = settle(data, cfg.data_pipeline, cfg.collate)
    check_data(data, cfg.batch_size if trains else None, spec)
    return data


def _set_of(cfg: TrainConfig, name: str, args: dict) -> tuple:
    """One set of a mixture as (train, eval): what `--dataset NAME` alone makes (a factory's `config` names it alone),
    a built-in set's tensors served one sample at a time, prepared as its batches are."""
    made = _made(name, args, {"config": replace(cfg, dataset=name), "seed": cfg.seed})
    if isinstance(made, Data):
        return one_at_a_time(made.train), one_at_a_time(made.eval)  # None stays None
    return _pair(made, name)


def _made(name: str, args: dict, known: dict):
    """What --dataset NAME makes: a built-in set's Data, the (train, eval) of files of samples, or a factory's return."""
    if name in DATASETS:
        return call_factory(DATASETS[name], args, known, f"dataset {name}")
    if is_data_path(name):
        return read_files(name, args)
    return call_factory(import_object(name, "--dataset"), args, known, f"dataset factory {name}")


def _pair(made, name: str) -> tuple:
    """A factory's (train_dataset, eval_dataset), or one line saying what it returned instead."""
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise ConfigError(f"dataset factory {name} returned {type(made).__name__}; it must return a pair "
                          "(train_dataset, eval_dataset)")
    return tuple(made)


def _mixed(parts: list, seed: int, text: TextSets, tokenize: bool) -> tuple:
    """A mixture's sets (mixtures.Part), each tokenized as it would be alone (`tokenize`: unless a collate function of
    the user's takes the samples as they are), then mixed: (train, eval, the start line's notes: the mixture's shares,
    then each set's tokens but the last set's, which `text.notes` still holds for the caller to add)."""
    notes, names = [], mixtures.unique([p.name for p in parts])
    for i, part in enumerate(parts):
        parts[i] = part = part._replace(name=names[i])
        if tokenize:
            notes += text.notes if i else []
            train, eval_ = text(part.train, part.eval, part.name)
            parts[i] = part._replace(train=train, eval=eval_)
    train, eval_, note = mixtures.mix(parts, seed)
    return train, eval_, [note, *notes]


def build_model(cfg: TrainConfig, data: Data) -> nn.Module:
    spec, args = cfg.model, dict(cfg.model_args or {})
    known = {"num_classes": data.num_classes, "input_shape": data.input_shape, "data": data}
    if spec in MODELS and not cfg.pretrained:
        model = call_factory(MODELS[spec], args, known, f"model {spec}")
    elif spec.startswith("torchvision:"):
        model = _zoo_model(spec, args, data, _torchvision_models(cfg.pretrained), cfg.pretrained)
    elif spec.startswith("timm:"):
        model = _zoo_model(spec, args, data, _timm_models(cfg.pretrained), cfg.pretrained)
    elif cfg.pretrained:
        raise ConfigError(f"--pretrained applies to torchvision:<name> and timm:<name> models; for {spec}, load your "
                          "weights with --init-from FILE")
    else:
        model = call_factory(import_object(spec, "--model"), args, known, f"model factory {spec}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model factory {spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _torchvision_models(pretrained: bool = False) -> tuple[Callable, list[str]]:
    models = torchvision().models

    def create(name: str, num_classes: int | None = None, **kw):
        if not pretrained:
            return models.get_model(name, weights=None, **({"num_classes": num_classes} if num_classes else {}), **kw)
        # The weights fix the head's size (1000 ImageNet classes): built with it, then given a fresh head.
        return _new_head(models.get_model(name, weights="DEFAULT", **kw), num_classes)

    return create, models.list_models(module=models)


def _timm_models(pretrained: bool = False) -> tuple[Callable, list[str]]:
    if importlib.util.find_spec("timm") is None:
        raise ConfigError('timm models need the timm package: pip install "acc_trainer[timm]" (or pip install timm)')
    import timm

    return (lambda name, **kw: timm.create_model(name, pretrained=pretrained, **kw)), timm.list_models()


def _zoo_model(spec: str, args: dict, data: Data, zoo: tuple[Callable, list[str]], pretrained: bool = False) -> nn.Module:
    create, names = zoo
    library, _, name = spec.partition(":")
    if name not in names:
        close = [n for n in names if name.split("_")[0] in n][:8]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ConfigError(f"--model {spec}: {library} has no classification model {name!r}{hint}")
    if "num_classes" not in args:
        if data.num_classes is None:
            raise ConfigError(f"--model {spec} needs num_classes: the dataset does not say how many classes it has; "
                              "set it with --model-args '{num_classes: N}'")
        args["num_classes"] = data.num_classes
    if not pretrained:
        return call_factory(lambda **kw: create(name, **kw), args, {}, f"{spec}")
    from accelerate import PartialState

    # The main process downloads the weights (once, into the cache) while the others wait, then they read them;
    # an error is raised after the context, so that no process is left at its barrier.
    error = None
    with PartialState().main_process_first():
        try:
            model = create(name, **args)
        except Exception as e:  # noqa: BLE001 - reported below in one line
            error = e
    if isinstance(error, OSError):  # URLError, HTTPError, a file that is not there
        raise ConfigError(_offline(spec, library, name, error)) from None
    if error is not None:
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
        raise ConfigError(f"{spec}({shown}) raised {type(error).__name__}: {first_line(error)}") from None
    return model


def _new_head(model: nn.Module, num_classes: int | None) -> nn.Module:
    """The model with its last Linear layer (torchvision's classifiers' head) made for `num_classes`."""
    heads = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if num_classes is None or not heads or heads[-1][1].out_features == num_classes:
        return model
    path, old = heads[-1]
    parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    setattr(parent, path.rpartition(".")[2], nn.Linear(old.in_features, num_classes, bias=old.bias is not None))
    return model


def _offline(spec: str, library: str, name: str, error: Exception) -> str:
    """Where to put the pretrained weights when they cannot be downloaded."""
    if library == "torchvision":
        import torch.hub

        url = torchvision().models.get_model_weights(name).DEFAULT.url
        return (f"--pretrained: the weights of {spec} cannot be downloaded ({type(error).__name__}: {first_line(error)}); "
                f"put {url.rpartition('/')[2]} (from {url}) in {Path(torch.hub.get_dir()) / 'checkpoints'}, or give "
                "--init-from FILE")
    return (f"--pretrained: timm cannot load the weights of {name} ({type(error).__name__}: {first_line(error)}); with no "
            "network, put them in the Hugging Face cache (HF_HOME) or give --init-from FILE")


def build_loss(spec: str) -> Callable:
    if spec in losses.LOSSES:
        return losses.LOSSES[spec]
    if ":" not in spec:
        raise ConfigError(f"unknown loss {spec!r}; choose from {', '.join(losses.LOSSES)}, or give an import path "
                          "pkg.module:function")
    return _callable(import_object(spec, "--loss"), spec, "--loss")


def build_metrics(specs: list[str]) -> dict[str, Callable]:
    metrics = {}
    for spec in specs:
        if spec in builtin_metrics.METRICS:
            metrics[spec] = builtin_metrics.METRICS[spec]
        elif spec in builtin_metrics.FROM_LOSS:
            metrics[spec] = builtin_metrics.FROM_LOSS[spec]
        elif spec in builtin_metrics.STATEFUL:
            metrics[spec] = builtin_metrics.STATEFUL[spec]  # a class: built for the outputs by check_fit
        elif ":" in spec:
            metrics[spec.rpartition(":")[2].rpartition(".")[2]] = _metric(import_object(spec, "--metrics"), spec,
                                                                        "--metrics")
        else:
            names = [*builtin_metrics.METRICS, *builtin_metrics.STATEFUL, *builtin_metrics.FROM_LOSS]
            raise ConfigError(f"unknown metric {spec!r}; choose from {', '.join(names)}, or give an import path "
                              "pkg.module:function (or an object with update, compute and reset)")
    return metrics


def _metric(obj: Any, spec: str, what: str):
    """A metric: a function of (outputs, targets), or an object with update, compute and reset."""
    if builtin_metrics.is_stateful(obj):
        return obj
    if any(hasattr(obj, name) for name in ("update", "compute")) and not callable(obj):
        raise ConfigError(f"{what} {spec} is a {type(obj).__name__} without update, compute and reset; a metric is a "
                          "function metric(outputs, targets) or an object with all three")
    if not callable(obj):
        raise ConfigError(f"{what} {spec} is a {type(obj).__name__}, not a function metric(outputs, targets) or an "
                          "object with update, compute and reset")
    return obj


def _callable(obj: Any, spec: str, what: str) -> Callable:
    if not callable(obj):
        raise ConfigError(f"{what} {spec} is a {type(obj).__name__}, not a function")
    return obj


def load_tokenizer(spec: str, what: str = "--tokenizer"):
    """The tokenizer `spec` names: a folder saved with `save_pretrained` (AutoTokenizer), a tokenizers library's
    tokenizer.json (PreTrainedTokenizerFast), or `pkg.module:factory` returning one; one line when it does not load.
    Never a download: a Hub tokenizer comes through a factory of one's own."""
    path = Path(spec)
    if IMPORT_PATH.match(spec) and not path.exists():
        tokenizer = call_factory(import_object(spec, what), {}, {}, f"{what} {spec}")
    elif not path.exists():
        raise ConfigError(f"{what} {spec}: no such folder or file (give a folder saved with save_pretrained, a "
                          "tokenizer.json, or an import path pkg.module:factory)")
    elif path.is_dir() and not any((path / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        raise ConfigError(f"{what} {spec}: the folder holds no tokenizer (no tokenizer_config.json or tokenizer.json, "
                          "which save_pretrained writes)")
    else:
        try:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path)) if path.is_file() else \
                AutoTokenizer.from_pretrained(str(path))
        except ImportError as e:
            raise ConfigError(f"{what} needs transformers (pip install transformers): {first_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - a file or folder that is not a tokenizer is the user's input
            raise ConfigError(f"{what} {spec} does not load as a tokenizer: {type(e).__name__}: {first_line(e)}") from None
    if not (callable(tokenizer) and hasattr(tokenizer, "decode") and hasattr(tokenizer, "save_pretrained")):
        raise ConfigError(f"{what} {spec} is a {type(tokenizer).__name__}, not a transformers tokenizer (callable, with "
                          "decode and save_pretrained)")
    return tokenizer


# -------------------------------------------------------------------------------------- from objects


def from_objects(model: nn.Module, train_data, eval_data, loss, metrics, collate=None, forward=None,
                 pack: int | None = None, pipeline: str = "batched", cfg: TrainConfig | None = None,
                 tokenizer=None) -> Workload:
    """`fit()`'s arguments as a Workload: the same checks the command line's objects get (`pack`: --pack,
    `pipeline`: --data-pipeline; text samples tokenized with `tokenizer`, fit's, else `cfg`'s --tokenizer)."""
    text = text_of(cfg or TrainConfig(), tokenizer)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"fit: model must be a torch.nn.Module, not {type(model).__name__}")
    quantized.steady(model)  # a model its user loaded in 4 bits: its layers kept as loaded (no-op for any other)
    from accelerate import PartialState

    name = type(train_data).__name__ if train_data is not None else "fit()"
    mixture, notes, error = mixtures.is_mixture(train_data), [], None
    # Under a launcher (fit() starts the process group first) the main process tokenizes and keeps the tokens, then the
    # others read them; an error is raised after the context, so that no process is left at its barrier.
    with PartialState().main_process_first() if PartialState._shared_state else contextlib.nullcontext():
        try:
            if mixture:  # [(dataset, weight), ...] (data/mixtures.py): fit's eval_data is the first set's evaluation split
                parts = [mixtures.Part(type(d).__name__, d, None if i else eval_data, w) for i, (d, w) in enumerate(train_data)]
                name = "+".join(p.name for p in parts)
                train, eval_, notes = _mixed(parts, (cfg or TrainConfig()).seed, text, collate is None)
            else:
                train, eval_ = text(train_data, eval_data, name) if collate is None and train_data is not None else \
                    (train_data, eval_data)
        except ConfigError as e:
            error = e
    if error is not None:
        raise error
    data = settle(data_from(*packing.pack_sets(train, eval_, pack, name), name), pipeline, collate)
    data.notes += notes + text.notes
    loss_name = loss if isinstance(loss, str) else getattr(loss, "__name__", None)
    if isinstance(loss, str):
        loss = build_loss(loss)
    elif loss is not None:
        loss = _callable(loss, repr(loss), "fit: loss")
    if isinstance(metrics, (list, tuple)):
        metrics = build_metrics(list(metrics))
    elif isinstance(metrics, Mapping):  # name -> a function, or a built-in name / import path
        metrics = {name: _metric(m, name, "fit: metric") if not isinstance(m, str)
                   else next(iter(build_metrics([m]).values())) for name, m in metrics.items()}
    elif metrics is not None:
        raise ConfigError(f"fit: metrics must be a dict of name -> metric or a list of names, not {type(metrics).__name__}")
    collate, forward = build_batching(collate, forward)
    dataset_name = name if mixture else qualified_name(train_data)
    return Workload(model, data, loss, metrics, qualified_name(model), dataset_name, loss_name,
                    _text_collate(collate, text), forward, objects=True, tokenizer=getattr(text, "tokenizer", None))


def qualified_name(obj: Any) -> str:
    """`module:Class` of an object: how a run made by fit() names its model and data."""
    kind = type(obj)
    name = kind.__qualname__ if "<" not in kind.__qualname__ else kind.__name__  # a class made inside a function
    return f"{kind.__module__}:{name}"


def function_name(fn: Callable) -> str | None:
    """`module:function` of a function defined at a module's top level (what config.yaml records), else None."""
    name = f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', '')}"
    return name if IMPORT_PATH.match(name) else None
