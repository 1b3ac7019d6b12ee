"""Data too large for memory: parquet shards streamed by Hugging Face `datasets` (docs/large-data.md).

    cd examples
    python large_data.py shards
    acc-trainer --model large_data:model --dataset large_data:stream --dataset-args '{folder: shards}' \
        --collate large_data:pairs --batch-size 64 --epochs 2 --checkpoint-every 100 --output-dir runs/stream

The first command writes 8 training shards of 3,000 samples each and an evaluation file of 2,000 (16
features, 4 classes: the class is the largest of 4 fixed linear scores). `stream(folder)` opens them with
`load_dataset("parquet", ..., streaming=True)`, so nothing is read before training asks for it;
`stream(folder, buffer=1000)` shuffles them (the shards' order and a buffer of 1,000 samples, reseeded every
epoch). Samples are dicts {"x": 16 floats, "label": class}; `pairs` batches them as (inputs, labels).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

FEATURES, CLASSES = 16, 4


def samples(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, (x @ weights).argmax(dim=1)


def write(folder: str | Path, shards: int = 8, per_shard: int = 3000, eval_size: int = 2000) -> list[Path]:
    """train-0000N.parquet (one per shard) and eval.parquet in `folder`; returns the files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i, (x, y) in enumerate([samples(per_shard, 1 + i) for i in range(shards)] + [samples(eval_size, 99)]):
        path = folder / (f"train-{i:05d}.parquet" if i < shards else "eval.parquet")
        features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1).numpy()), FEATURES)
        pq.write_table(pa.table({"x": features, "label": pa.array(y.numpy())}), path)
        files.append(path)
    return files


def stream(folder: str = "shards", buffer: int = 0, seed: int = 0):
    """(training stream, evaluation stream) of the shards in `folder`; buffer > 0 shuffles the training one."""
    from datasets import load_dataset

    def load(files: list[str]):
        return load_dataset("parquet", data_files=files, split="train", streaming=True).with_format("torch")

    train = load(sorted(str(p) for p in Path(folder).glob("train-*.parquet")))
    if buffer:
        train = train.shuffle(seed=seed, buffer_size=buffer)
    return train, load([str(Path(folder) / "eval.parquet")])


def pairs(batch: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The collate function: dict samples as (inputs [B, 16], labels [B])."""
    return torch.stack([s["x"] for s in batch]), torch.stack([s["label"] for s in batch])


def model(hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))


if __name__ == "__main__":
    written = write(sys.argv[1] if len(sys.argv) > 1 else "shards")
    print(f"wrote {len(written)} files in {written[0].parent}")
