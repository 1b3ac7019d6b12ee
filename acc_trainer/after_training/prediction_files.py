"""The predictions file of `predict` / `acc-trainer predict --output`: rows written to .jsonl or .csv line by line, or
to .npz arrays filled as they come, in a folder of their own moved into place when complete; rows checked against the
format first.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from ..config import ConfigError


def check_rows(rows: list[dict], path: Path) -> None:
    """Whether the rows fit the output's format: .csv and .npz take numbers (one, or a list of them), .csv texts too."""
    if path.suffix == ".jsonl" or not rows:
        return
    for value in rows[0].values():
        numbers = isinstance(value, (int, float)) or isinstance(value, list) and all(isinstance(v, (int, float))
                                                                                     for v in value)
        if not (numbers or path.suffix == ".csv" and isinstance(value, str)):
            kind = "rows of numbers" + (" or texts" if path.suffix == ".csv" else "")
            raise ConfigError(f"predict: these outputs are not {kind}; write them as .jsonl, not {path.suffix}")


def _columns(row: dict):
    """A row's CSV columns: a list spreads into name_0, name_1, ... (`output` always does: output_0)."""
    for name, value in row.items():
        if isinstance(value, list) or name == "output":
            yield from ((f"{name}_{i}", v) for i, v in enumerate(value if isinstance(value, list) else [value]))
        else:
            yield name, value


class Writer:
    """Rows to a .jsonl or .csv file line by line, or to .npz arrays filled as they come (memory-mapped
    .npy files, zipped at the end): a large set never sits in memory whole. Written in a folder of its own
    beside the output, moved into place when complete."""

    def __init__(self, path: Path | None, size: int):
        self.path, self.size, self.done = path, size, 0
        if path is None:
            return
        self.folder = Path(tempfile.mkdtemp(prefix=".predict-", dir=path.parent))
        self.file = None if path.suffix == ".npz" else open(self.folder / path.name, "w", newline="")
        self.arrays = {}

    def write(self, rows: list[dict]) -> None:
        if self.path is None or not rows:
            return
        if self.path.suffix == ".jsonl":
            self.file.write("".join(json.dumps(r) + "\n" for r in rows))
        elif self.path.suffix == ".csv":
            self._csv(rows)
        else:
            self._npz(rows)
        self.done += len(rows)

    def _csv(self, rows: list[dict]) -> None:
        flat = [dict(_columns(r)) for r in rows]
        if self.done == 0:
            self.csv = csv.writer(self.file)
            self.csv.writerow(list(flat[0]))
        for values in flat:
            self.csv.writerow(list(values.values()))

    def _npz(self, rows: list[dict]) -> None:
        import numpy as np

        columns = {name: [r[name] for r in rows] for name in rows[0]}  # one array a column
        if self.done + len(rows) > self.size:
            raise ConfigError(f"predict: the dataset gave more than the {self.size:,} samples its __len__ says")
        for name, values in columns.items():
            values = np.asarray(values)
            if name not in self.arrays:
                self.arrays[name] = np.lib.format.open_memmap(self.folder / f"{name}.npy", mode="w+", dtype=values.dtype,
                                                              shape=(self.size, *values.shape[1:]))
            self.arrays[name][self.done: self.done + len(values)] = values

    def close(self) -> None:
        if self.path is None:
            return
        if self.file is not None:
            self.file.close()
            os.replace(self.folder / self.path.name, self.path)
        else:
            if self.done != self.size:
                raise ConfigError(f"predict: the dataset gave {self.done:,} samples, its __len__ says {self.size:,}")
            for array in self.arrays.values():
                array.flush()
            with zipfile.ZipFile(self.folder / self.path.name, "w", zipfile.ZIP_STORED) as archive:
                for name in self.arrays:
                    archive.write(self.folder / f"{name}.npy", f"{name}.npy")
            os.replace(self.folder / self.path.name, self.path)
        self.discard()

    def discard(self) -> None:
        if self.path is None:
            return
        if self.file is not None and not self.file.closed:
            self.file.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def check_replaceable(path: Path) -> None:
    """An output that exists is replaced only when it holds predictions (rows with an `index`, as predict writes
    them): any other file of that name (a config, a dataset, someone's notes) is refused, in one line."""
    if not path.exists():
        return
    if path.is_dir():
        raise ConfigError(f"predict --output {path} is a folder; give a file")
    try:
        if path.suffix == ".jsonl":
            with open(path) as file:
                first = file.readline()
            rows = not first or "index" in json.loads(first)
        elif path.suffix == ".csv":
            with open(path, newline="") as file:
                rows = next(csv.reader(file), ["index"])[:1] == ["index"]
        else:
            with zipfile.ZipFile(path) as archive:
                rows = "index.npy" in archive.namelist()
    except (OSError, ValueError, TypeError, zipfile.BadZipFile, UnicodeDecodeError):
        rows = False
    if not rows:
        raise ConfigError(f"predict --output {path} exists and holds no predictions (rows with an index) that this "
                          "command wrote: it would be replaced; give another file, or remove it first")
