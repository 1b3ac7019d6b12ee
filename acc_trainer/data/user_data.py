"""A user's own datasets as `Data` (`fit()`'s objects, and a dataset factory's pair): map-style or a stream, the task
and the number of classes read off the samples, the class labels checked where the datasets hold them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ..config import ConfigError, first_line
from . import streams
from .datasets import Data, Heads, RawImages
from .kinds import is_stream
from .text_streams import JsonLines, json_line


def read_files(path: str, args: dict) -> tuple:
    """`--dataset PATH`: (train, eval) from files of samples. A .jsonl/.json file is read as it is, one sample a
    line (or a JSON list); a .parquet file, a folder of such files and a folder written by `save_to_disk` through
    Hugging Face `datasets` (a folder's `train` split, and its `validation` or `test` split for evaluation).
    `--dataset-args '{eval: PATH}'` names the evaluation set's files; `{stream: true}` reads .jsonl files as streams
    (text_streams.JsonLines: nothing held, tokenized as they are read)."""
    unknown = sorted(set(args) - {"eval", "stream"})
    if unknown:
        raise ConfigError(f"--dataset {path}: --dataset-args takes eval (the evaluation set's files) and stream (true: "
                          f"read a .jsonl file as a stream) for files of samples, not {unknown[0]!r}")
    if args.get("stream"):
        return _stream(path), _stream(str(args["eval"])) if args.get("eval") is not None else None
    train, eval_ = _read_files(path)
    if args.get("eval") is not None:
        eval_ = _read_files(str(args["eval"]))[0]
    return train, eval_


def _stream(path: str) -> JsonLines:
    if not Path(path).is_file() or Path(path).suffix != ".jsonl":
        raise ConfigError(f"--dataset {path}: --dataset-args stream: true reads a .jsonl file (one sample a line) as a "
                          "stream; parquet or JSON shards stream through Hugging Face datasets (load_dataset(..., "
                          "streaming=True) in a dataset factory: docs/large-data.md)")
    return JsonLines(path)


def _read_files(path: str) -> tuple:
    import json

    file = Path(path)
    if not file.exists():
        raise ConfigError(f"--dataset {path}: no such file or folder")
    try:
        if file.is_file() and file.suffix in (".jsonl", ".json"):
            text = file.read_text()
            if file.suffix == ".json" and text.lstrip().startswith("["):
                return json.loads(text), None
            if file.suffix == ".json" and "\n" in text.strip() and _one_object(text):
                raise ConfigError(f"--dataset {path} holds one JSON object: a .json dataset is a list of samples, or "
                                  "one sample a line (JSON Lines)")
            return [json_line(line, n, path) for n, line in enumerate(text.splitlines(), 1) if line.strip()], None
        import datasets

        if file.is_dir() and any((file / n).is_file() for n in ("dataset_dict.json", "state.json")):
            made = datasets.load_from_disk(str(file))
        elif file.is_file():
            made = datasets.load_dataset(file.suffix.lstrip("."), data_files=str(file), split="train")
        else:
            made = datasets.load_dataset(str(file))
    except ConfigError:
        raise
    except (OSError, ValueError, ImportError) as e:  # json's errors are ValueErrors; datasets' are too
        raise ConfigError(f"--dataset {path} cannot be read: {type(e).__name__}: {first_line(e)}") from None
    if isinstance(made, Mapping):  # a DatasetDict: its splits
        if "train" not in made:
            raise ConfigError(f"--dataset {path} has no train split (it has {', '.join(made)})")
        return made["train"], next((made[k] for k in ("validation", "test", "eval") if k in made), None)
    return made, None


def _one_object(text: str) -> bool:
    import json

    try:
        return isinstance(json.loads(text), Mapping)
    except ValueError:
        return False


def data_from(train, eval_, name: str) -> Data:
    """A user's datasets as `Data`: the task and the number of classes are read off the samples."""
    if train is None:
        raise ConfigError(f"the training data of {name} is None: give a dataset (map-style, or an iterable one)")
    streams_ = (is_stream(train), is_stream(eval_))  # asked once; the run then reads Data.kind (kinds.settle)
    for split, dataset, stream in (("training", train, streams_[0]), ("evaluation", eval_, streams_[1])):
        if dataset is not None and not stream and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise ConfigError(f"the {split} data of {name} is a {type(dataset).__name__}, neither a map-style Dataset "
                              "(__getitem__ and __len__) nor an iterable one (__iter__)")
        if stream and hasattr(type(dataset), "__next__"):  # a generator, a cursor: read once, then empty
            raise ConfigError(f"the {split} data of {name} is an iterator ({type(dataset).__name__}), which can be read "
                              "only once (the checks at start, every epoch and a resume read it again): give an object "
                              "whose __iter__ starts it anew, such as an IterableDataset whose __iter__ is a generator")
    heads = Heads()
    if streams_[0]:
        try:
            head = streams.first(train, 1, heads=heads)
        except Exception as e:
            if not streams.is_read_error(e):
                raise  # a bug in the stream's code: its traceback is the user's
            raise ConfigError(f"the training stream of {name} cannot be read ({streams.describe_error(e, [])})") from None
        if not head:
            raise ConfigError(f"the training stream of {name} is empty")
        sample = head[0]
    else:
        if len(train) == 0:
            raise ConfigError(f"the training set of {name} is empty")
        sample = train[0]
    if isinstance(sample, Mapping):
        inputs, targets = None, sample.get("labels")
    elif isinstance(sample, (tuple, list)) and len(sample) == 2:
        inputs, targets = sample
    else:
        raise ConfigError(f"samples of {name} must be (inputs, targets) pairs or dicts of tensors, "
                          f"not {type(sample).__name__}")
    targets = torch.as_tensor(targets) if isinstance(targets, (int, float)) else targets
    task, num_classes, notes = None, None, []
    if isinstance(targets, torch.Tensor):
        task = "regression" if targets.is_floating_point() else "classification"
        if task == "classification" and targets.dim() == 0:  # one class label per sample
            num_classes, notes = _checked_classes(train, eval_, name, streams_)
        elif task == "classification":
            num_classes = _num_classes(train, streams_[0])
    shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else None
    images = shape is not None and len(shape) == 3 and isinstance(targets, torch.Tensor) and not streams_[0]
    return Data(train, eval_, task, num_classes, shape, RawImages(train, None) if images else None, heads, notes)


def _checked_classes(train, eval_, name: str, streams_: tuple[bool, bool]) -> tuple[int | None, list[str]]:
    """The number of classes of a labelled set, with its labels checked where the datasets hold them (`targets`,
    a TensorDataset's last tensor): a negative label, or one at or past a declared number of classes, is one line
    instead of an IndexError inside the loss at some later step; a count inferred from the largest label while
    fewer distinct labels appear (a stray label making a larger head) gets a note. `streams_`: whether each set
    is a stream, whose labels are not held."""
    num_classes = _num_classes(train, streams_[0])
    declared = _declared_classes(train)
    notes = []
    for split, dataset, stream in (("training", train, streams_[0]), ("evaluation", eval_, streams_[1])):
        labels = _labels(dataset) if dataset is not None and not stream else None
        if labels is None or not len(labels):
            continue
        low, high = int(labels.min()), int(labels.max())
        if low < 0:
            raise ConfigError(f"the {split} labels of {name} include {low} (sample {int((labels == low).nonzero()[0])}): "
                              "class labels run from 0 to the number of classes - 1")
        if num_classes is not None and high >= num_classes:
            said = f"declares {num_classes} classes" if declared else f"has {num_classes} classes in its training labels"
            raise ConfigError(f"the {split} labels of {name} include {high} (sample "
                              f"{int((labels == high).nonzero()[0])}), and {name} {said} (labels 0 to {num_classes - 1})")
        distinct = len(torch.unique(labels))
        if split == "training" and not declared and distinct < high + 1:
            notes.append(f"note: {high + 1} classes inferred from the largest training label ({high}), but only "
                         f"{distinct} distinct labels appear; give the dataset `classes` or `num_classes` to declare them")
    return num_classes, notes


def _declared_classes(dataset) -> bool:
    """Whether the dataset says its number of classes rather than leaving it to be inferred from its labels."""
    if isinstance(getattr(dataset, "num_classes", None), int) or getattr(dataset, "classes", None) is not None:
        return True
    features = getattr(dataset, "features", None)
    if isinstance(features, Mapping) and hasattr(features.get("labels", features.get("label")), "num_classes"):
        return True
    return hasattr(dataset, "dataset") and not hasattr(dataset, "targets") and _declared_classes(dataset.dataset)


def _labels(dataset) -> torch.Tensor | None:
    """A map-style labelled set's class labels where it holds them without reading its samples, else None."""
    targets = getattr(dataset, "targets", None)
    if targets is None and hasattr(dataset, "tensors"):
        targets = dataset.tensors[-1]
    if targets is None and isinstance(getattr(dataset, "indices", None), (list, range, torch.Tensor)) and \
            hasattr(dataset, "dataset"):  # a Subset
        whole = _labels(dataset.dataset)
        return whole[torch.as_tensor(list(dataset.indices), dtype=torch.long)] if whole is not None else None
    if targets is None:
        return None
    targets = torch.as_tensor(targets)
    return targets if not targets.is_floating_point() and targets.dim() == 1 else None


def _num_classes(dataset, stream: bool = False) -> int | None:
    """From what datasets usually carry (`num_classes`, `classes`, `targets`, a TensorDataset's labels),
    without reading every sample (a `stream`'s targets are not held: only what it declares)."""
    if isinstance(getattr(dataset, "num_classes", None), int):
        return dataset.num_classes
    features = getattr(dataset, "features", None)  # a Hugging Face dataset's ClassLabel
    if isinstance(features, Mapping):
        label = features.get("labels", features.get("label"))
        if isinstance(getattr(label, "num_classes", None), int):
            return label.num_classes
    if stream:  # never read the whole stream for its targets
        return None
    if getattr(dataset, "classes", None) is not None:
        return len(dataset.classes)
    targets = getattr(dataset, "targets", None)
    if targets is None and hasattr(dataset, "tensors"):
        targets = dataset.tensors[-1]
    if targets is not None and len(targets):
        targets = torch.as_tensor(targets)
        if not targets.is_floating_point():
            return int(targets.max()) + 1
    if hasattr(dataset, "dataset"):  # Subset and similar wrappers
        return _num_classes(dataset.dataset)
    return None
