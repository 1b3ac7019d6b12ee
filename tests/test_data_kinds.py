"""The data's kind, decided once where a run's data is built (data/kinds.py: `Data.kind`) and read by the loaders,
the checks and the training steps instead of asking the datasets again; the run folder's lock let go when the run
ends."""

from __future__ import annotations

import fcntl
from dataclasses import replace

import pytest
import streams_data
import torch
from torch.utils.data import Dataset, TensorDataset

from acc_trainer.config import make_config
from acc_trainer.data import kinds
from acc_trainer.data.datasets import Data, IndexBatches, SetKind
from acc_trainer.data.loaders import build_loaders
from acc_trainer.data.packing import Packed
from acc_trainer.workload.components import build_data, from_objects

pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


class Files(Dataset):
    """A map-style set of the user's own, read a sample at a time (as from files)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int):
        return torch.full((4,), float(index)), index % 2


def test_the_kind_is_settled_where_the_data_is_built():
    cfg = make_config({"dataset": "synthetic", "train_size": 64, "eval_size": 32, "batch_size": 16})
    data = build_data(cfg)
    assert data.kind.train == SetKind(stream=False, in_memory=True, batched=True, guarded=False, length=64)
    assert data.kind.eval.length == 32 and not data.kind.packed and not data.kind.streams
    per_sample = build_data(replace(cfg, data_pipeline="per-sample"))
    assert per_sample.kind.train.in_memory and not per_sample.kind.train.batched
    model = torch.nn.Linear(4, 2)
    with_collate = from_objects(model, TensorDataset(torch.zeros(40, 4), torch.zeros(40, dtype=torch.long)), None,
                                None, None, collate=lambda samples: samples).data.kind
    assert with_collate.train.in_memory and not with_collate.train.batched and with_collate.eval is None
    own = from_objects(model, Files(), Files(), None, None).data.kind
    assert own.train == SetKind(stream=False, in_memory=False, batched=False, guarded=True, length=40)
    stream = from_objects(model, streams_data.Numbers(), streams_data.in_memory(31, 2), None, None).data.kind
    assert stream.train.stream and not stream.train.guarded and stream.streams and not stream.eval.stream
    documents = [torch.arange(1, 1 + n) for n in (5, 9, 3, 12, 7, 4, 8, 6)]
    packed = from_objects(torch.nn.Embedding(16, 4), documents, None, None, None, pack=16).data
    assert isinstance(packed.train, Packed) and packed.kind.packed and packed.kind.train.guarded


def test_the_loaders_follow_the_kind_not_the_dataset():
    """The same tensors in memory, settled as the batched path or the per-sample one: the loader is built as the kind
    says (whole batches gathered at once, or samples collated), and it yields the same batches."""
    cfg = make_config({"train_size": 48, "batch_size": 12, "seed": 3})
    tensors = TensorDataset(torch.randn(48, 4), torch.randint(0, 2, (48,)))
    batched = kinds.settle(Data(tensors, None, "classification", 2, (4,)), "batched")
    per_sample = kinds.settle(Data(tensors, None, "classification", 2, (4,)), "per-sample")
    one, _ = build_loaders(cfg, batched, 1, torch.device("cpu"))
    other, _ = build_loaders(cfg, per_sample, 1, torch.device("cpu"))
    assert isinstance(one.batch_sampler, IndexBatches) and not isinstance(other.batch_sampler, IndexBatches)
    torch.manual_seed(0)  # the shuffle (Accelerate's seedable sampler reseeds it in a run; these are not prepared)
    first = list(one)
    torch.manual_seed(0)
    for (x, y), (x2, y2) in zip(first, other, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(AttributeError):  # a Data built by hand and never settled: no kind to read
        build_loaders(cfg, Data(tensors, None, "classification", 2, (4,)), 1, torch.device("cpu"))


def test_a_finished_run_lets_its_folder_go(tmp_path):
    """The run folder's lock is held while the run trains and let go when fit() returns: another process may take
    the folder at once (before, the lock stayed with the process until it ended)."""
    import acc_trainer

    out = tmp_path / "run"
    acc_trainer.fit(torch.nn.Linear(4, 2), Files(), None, epochs=1, batch_size=8, progress="none", plots=False,
                    output_dir=str(out))
    with open(out / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while a run holds it


def test_a_start_that_fails_after_locking_lets_the_folder_go(tmp_path, monkeypatch):
    """A failure between locking the folder and the first step (here the start line) leaves no lock behind: the
    same process can start a run on the folder again at once."""
    import acc_trainer
    from acc_trainer.outputs import run_folder

    def broken(r):
        raise RuntimeError("the start line failed")

    monkeypatch.setattr(run_folder, "announce", broken)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="the start line failed") as failed:
        acc_trainer.fit(torch.nn.Linear(4, 2), Files(), None, epochs=1, batch_size=8, progress="none", plots=False,
                        output_dir=str(out))
    # The traceback is kept (as a notebook keeps the last one): its frames hold the run's objects, the lock's too.
    assert failed.traceback
    with open(out / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
