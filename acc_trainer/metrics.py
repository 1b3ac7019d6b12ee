"""What a run writes to its output folder, and the small measurements the loop takes."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch
import yaml

from .config import TrainConfig


class RunFiles:
    """config.yaml, metrics.jsonl and summary.json of one run; written by the main process only."""

    OUTPUTS = ("metrics.jsonl", "summary.json", "model.safetensors")

    def __init__(self, folder: Path, enabled: bool, resumed_step: int | None = None):
        """`resumed_step`: the run continues from a checkpoint at that step; records after it,
        logged before the interruption, are dropped because the resumed run logs them again."""
        self.folder, self.enabled = folder, enabled
        if enabled:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / "metrics.jsonl"
            if resumed_step is not None and path.exists():
                kept = [line for line in path.read_text().splitlines(keepends=True)
                        if _complete_record_before(line, resumed_step)]
                _write_atomically(path, "".join(kept))
            self._metrics = open(path, "a", buffering=1)  # line-buffered: survives a kill

    def write_config(self, cfg: TrainConfig) -> None:
        """The resolved options, in the form `--config` reads back."""
        if self.enabled:
            (self.folder / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    def log(self, record: dict) -> None:
        if self.enabled:
            self._metrics.write(json.dumps(record) + "\n")

    def write_summary(self, summary: dict) -> None:
        if self.enabled:
            self._metrics.close()
            _write_atomically(self.folder / "summary.json", json.dumps(summary, indent=2) + "\n")


def _complete_record_before(line: str, step: int) -> bool:
    try:
        return json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):  # a line cut short by a kill
        return False


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """Sum and sum of squares of every parameter, in float64: equal models give equal fingerprints."""
    params = [p.detach().double() for p in model.parameters()]
    return torch.stack([p.sum() for p in params] + [p.square().sum() for p in params])


def library_versions() -> dict:
    import accelerate

    from . import __version__

    versions = {"acc_trainer": __version__, "python": platform.python_version(), "torch": torch.__version__,
                "accelerate": accelerate.__version__}
    try:
        import torchvision
        versions["torchvision"] = torchvision.__version__
    except Exception:  # reported as missing; the run did not need it
        versions["torchvision"] = None
    return versions
