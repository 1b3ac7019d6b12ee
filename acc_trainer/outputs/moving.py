"""The old place of a checkpoint continued under another engine than the one that wrote it: each engine's room
(distributed/engines/) now reads its own files, and `Engine.move_in` puts them into another engine's model. What stays
here: a checkpoint's model or optimizer read into a model by the engine that wrote it (`_load_model`,
`_load_optimizer`), and `whole_weights`, for code written against this module."""

from __future__ import annotations

from pathlib import Path

from ..distributed.engines import whole_weights, writer

__all__ = ["whole_weights"]


def _load_model(model, path: Path, partial: bool) -> None:
    writer(path).read_model(model, path, partial)


def _load_optimizer(model, optimizer, path: Path) -> None:
    writer(path).read_optimizer(model, optimizer, path)
