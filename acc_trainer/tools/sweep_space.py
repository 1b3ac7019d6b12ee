"""The space file of `acc-trainer sweep` (sweep.py), read and checked: the options every trial shares, the Optuna
distributions searched and the study's settings; and each trial's options, the shared ones with its values over them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, TrainConfig, UniqueKeys, did_you_mean, first_line, make_config, option_names

# The keys of a space file, with their defaults (None: worked out from the others).
SPACE_KEYS = {"options": {}, "search": {}, "metric": "loss", "direction": None, "trials": None, "sampler": "tpe",
              "seed": None, "pruner": "median", "pruner-args": {}, "launcher": "acc-trainer", "study": None,
              "storage": None, "sweep-dir": None}
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "successive-halving", "hyperband", "none")
TRIALS = 20  # without `trials` (a grid: its size)
NOT_SWEPT = ("output_dir", "resume")  # the sweep sets them for every trial


@dataclass
class Space:
    """A space file, read and checked (read_space)."""

    path: Path
    options: dict  # TrainConfig field -> value, shared by every trial
    search: dict  # parameter name (an option, or option.key inside a dict option) -> Optuna distribution
    metric: str  # the evaluation result the study optimises
    direction: str
    trials: int  # in the study as a whole, whichever worker runs them
    sampler: str
    seed: int | None
    pruner: str
    pruner_args: dict
    launcher: str  # the command line before the trainer's options
    study: str
    storage: str
    folder: Path


def read_space(path: Path, overrides: dict | None = None) -> Space:
    """The space file, with the command line's `overrides` (sweep keys) over it; every mistake one ConfigError."""
    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeys)
    except OSError as e:
        raise ConfigError(f"space file {path} cannot be read ({e.strerror or type(e).__name__})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"space file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"space file {path} must hold a mapping (options:, search:, metric:, ...)")
    keys = {}
    for key, value in data.items():
        name = str(key).replace("_", "-")
        if name not in SPACE_KEYS:
            raise ConfigError(f"space file {path}: unknown key {key!r}{did_you_mean(name, SPACE_KEYS)} (training options "
                              "go under options:, the searched ones under search:)")
        keys[name] = value
    keys = {**SPACE_KEYS, **keys, **(overrides or {})}
    options = _options(keys["options"], path)
    search = {str(name): _distribution(str(name), spec, path) for name, spec in (keys["search"] or {}).items()}
    if not search:
        raise ConfigError(f"space file {path}: search: names no option to search (e.g. lr: {{float: [1.0e-4, 0.1], "
                          "log: true}})")
    check_options(options, search, path)
    for key, known in (("sampler", SAMPLERS), ("pruner", PRUNERS)):
        if keys[key] not in known:
            raise ConfigError(f"space file {path}: {key} {keys[key]!r}: choose from {', '.join(known)}"
                              + did_you_mean(str(keys[key]), known))
    if keys["sampler"] == "grid" and not all(hasattr(d, "choices") for d in search.values()):
        raise ConfigError(f"space file {path}: sampler grid takes lists of values to search (lr: [0.001, 0.01]), not "
                          "ranges")
    metric = str(keys["metric"])
    direction = keys["direction"] or _direction(metric)
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f"space file {path}: direction {direction!r}: minimize or maximize")
    trials = keys["trials"] if keys["trials"] is not None else _grid_size(search) if keys["sampler"] == "grid" else TRIALS
    if not isinstance(trials, int) or trials < 0:
        raise ConfigError(f"space file {path}: trials {trials!r}: a number of trials, 0 or more")
    study = str(keys["study"] or path.stem)
    folder = Path(keys["sweep-dir"] or Path("sweeps") / study)
    storage = str(keys["storage"] or f"sqlite:///{folder.resolve() / 'study.db'}")
    return Space(path, options, search, metric, direction, trials, keys["sampler"], keys["seed"], keys["pruner"],
                 dict(keys["pruner-args"] or {}), str(keys["launcher"]), study, storage, folder)


def _options(given: Any, path: Path) -> dict:
    if not isinstance(given, dict):
        raise ConfigError(f"space file {path}: options: must map training options to values (model: mlp, epochs: 3)")
    options = option_names(given, f"space file {path}")
    for name in options:
        if name in NOT_SWEPT:
            raise ConfigError(f"space file {path}: options: {name.replace('_', '-')} is the sweep's to set: every trial "
                              "gets its own folder (<sweep-dir>/trial-N) and a stopped trial resumes from its checkpoint")
    return options


def _distribution(name: str, spec: Any, path: Path):
    """`{float: [low, high]}` and `{int: [low, high]}` (with `log: true` or `step: x`), or a list of values."""
    import optuna.distributions as d

    option = name.split(".")[0].replace("-", "_")
    if option not in {f.name for f in fields(TrainConfig)} or option in NOT_SWEPT:
        raise ConfigError(f"space file {path}: search: {name!r} is not an option to search"
                          + did_you_mean(name, sorted(f.name.replace("_", "-") for f in fields(TrainConfig))))
    if isinstance(spec, dict) and "choice" in spec:
        spec = spec["choice"]
    try:
        if isinstance(spec, list) and spec:
            return d.CategoricalDistribution(spec)
        kind = next((k for k in ("float", "int") if k in spec), None) if isinstance(spec, dict) else None
        if kind and set(spec) <= {kind, "log", "step"} and isinstance(spec[kind], list) and len(spec[kind]) == 2:
            low, high = (float(v) if kind == "float" else v for v in spec[kind])  # YAML reads 1e-5 as a text
            make = d.FloatDistribution if kind == "float" else d.IntDistribution
            return make(low, high, log=bool(spec.get("log", False)), step=spec.get("step", None if kind == "float" else 1))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"space file {path}: search: {name}: {first_line(e)}") from None
    raise ConfigError(f"space file {path}: search: {name}: give {{float: [low, high]}} or {{int: [low, high]}} (with log: "
                      f"true or step: N) or a list of values, not {spec!r}")


def trial_options(options: dict, params: dict) -> dict:
    """The shared options with a trial's values over them (`model-args.width` sets `width` in model_args)."""
    out = dict(options)
    for name, value in params.items():
        option, *keys = name.split(".")
        option = option.replace("-", "_")
        if not keys:
            out[option] = value
            continue
        inner = out.get(option)
        inner = dict(yaml.safe_load(inner) or {} if isinstance(inner, str) else inner or {})  # a flag's text form
        out[option], place = inner, inner
        for key in keys[:-1]:
            place[key] = dict(place.get(key) or {})
            place = place[key]
        place[keys[-1]] = value
    return out


def check_options(options: dict, search: dict, path: Path) -> None:
    """Every value the search can take, over the shared options, makes a valid configuration: a mistake is found
    before any trial starts, not in each trial."""
    for name, dist in search.items():
        values = dist.choices if hasattr(dist, "choices") else (dist.low, dist.high)
        for value in values:
            try:
                make_config(trial_options(options, {**{n: _any_value(d) for n, d in search.items()}, name: value}))
            except ConfigError as e:
                raise ConfigError(f"space file {path}: {name} {value!r}: {e}") from None


def _any_value(dist) -> Any:
    return dist.choices[0] if hasattr(dist, "choices") else dist.low


def _grid_size(search: dict) -> int:
    size = 1
    for dist in search.values():
        size *= len(dist.choices)
    return size


def _direction(metric: str) -> str:
    from ..workload.metrics import improves  # the one definition of "better" (torch: imported only when needed)

    return "minimize" if improves(metric, 0.0, 1.0) else "maximize"
