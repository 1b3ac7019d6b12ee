"""acc_trainer's patches (acc_trainer/patches.py): each finds what it patches where it was written for, runs
only on the versions it was tested on (elsewhere the package's own code runs, with a note), is switched off by
ACC_TRAINER_PATCHES=0, and reaches no further than it says."""

from __future__ import annotations

import inspect

import accelerate
import accelerate.optimizer
import accelerate.utils.other
import pytest
import torch
from accelerate import Accelerator, PartialState, launchers
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState
from accelerate.utils import extract_model_from_parallel
from conftest import reset_accelerate
from torch.utils.data import get_worker_info
from torch.utils.data._utils import worker

from acc_trainer import patches


@pytest.fixture
def accelerate_as_installed(monkeypatch):
    """Accelerate's module attributes that the patches replace, as Accelerate sets them, restored after."""
    import accelerate.utils.imports

    monkeypatch.setattr(accelerate.optimizer, "is_lomo_available", accelerate.utils.imports.is_lomo_available)
    monkeypatch.setattr(accelerate.optimizer, "inspect", inspect)
    monkeypatch.setattr(accelerate.utils.other, "is_deepspeed_available",
                        accelerate.utils.imports.is_deepspeed_available)


def _untested(monkeypatch, package: str, version: str) -> None:
    """The guard sees `version` of `package` installed (the others as they are)."""
    installed = patches._version
    monkeypatch.setattr(patches, "_version", lambda name: version if name == package else installed(name))


def _unpatched(accelerator: Accelerator) -> bool:
    return (accelerate.optimizer.inspect is inspect and not hasattr(accelerate.optimizer.is_lomo_available, "cache_info")
            and accelerate.utils.other.is_deepspeed_available.__module__ == "accelerate.utils.imports"
            and "backward" not in vars(accelerator))


def test_what_each_patch_relies_on_is_where_it_was_written_for():
    """Fails when Accelerate, torch or torchmetrics move or change a symbol a patch replaces or reads: the
    patch must then be looked at again (and TESTED widened) before it runs on that version."""
    assert str(inspect.signature(Accelerator.backward)) == "(self, loss, **kwargs)"
    backward = inspect.getsource(Accelerator.backward)
    assert "loss = loss / self.gradient_accumulation_steps" in backward and "loss.backward(**kwargs)" in backward
    assert {"gradient_accumulation_steps", "scaler", "distributed_type"} <= set(dir(Accelerator(cpu=True)))
    assert str(inspect.signature(AcceleratedOptimizer.step)) == "(self, closure=None)"
    assert str(inspect.signature(AcceleratedOptimizer.zero_grad)) == "(self, set_to_none=None)"
    assert "is_lomo_available()" in inspect.getsource(AcceleratedOptimizer.step)
    assert "inspect.signature(self.optimizer.zero_grad)" in inspect.getsource(AcceleratedOptimizer.zero_grad)
    assert {"is_lomo_available", "inspect"} <= set(vars(accelerate.optimizer))
    assert {"is_deepspeed_available", "extract_model_from_parallel"} <= set(vars(accelerate.utils.other))
    assert "is_deepspeed_available()" in inspect.getsource(extract_model_from_parallel)
    # the original (the module attribute may be this process's patched one, from an earlier test)
    assert str(inspect.signature(accelerate.utils.imports.is_deepspeed_available)) == "()"
    assert isinstance(PartialState._shared_state, dict) and isinstance(AcceleratorState._shared_state, dict)
    assert "self.distributed_type = DistributedType.FSDP" in inspect.getsource(AcceleratorState.__init__)
    assert "fsdp_plugin" in inspect.getsource(AcceleratorState.__init__)
    from accelerate.utils import fsdp_utils  # sharded_trainable_only: the two functions FSDP's save and load call

    assert str(inspect.signature(fsdp_utils._prepare_sd_options)) == "(fsdp_plugin)"
    assert str(inspect.signature(fsdp_utils._get_model_state_dict)) == "(model, adapter_only=False, sd_options=None)"
    for function in (fsdp_utils.save_fsdp_model, fsdp_utils.load_fsdp_model):
        assert {"_prepare_sd_options(fsdp_plugin)", "_get_model_state_dict("} <= {
            text for text in ("_prepare_sd_options(fsdp_plugin)", "_get_model_state_dict(")
            if text in inspect.getsource(function)}
    assert "_worker_info" in vars(worker) and "return _worker_info" in inspect.getsource(get_worker_info)
    # bitsandbytes_not_refused: the check notebook_launcher calls by its module's name
    assert 'are_libraries_initialized("bitsandbytes")' in inspect.getsource(launchers.notebook_launcher)
    metric = pytest.importorskip("torchmetrics").Metric
    assert "distributed_available_fn" in inspect.getsource(metric.__init__)
    assert "self.distributed_available_fn" in inspect.getsource(metric.sync)
    assert "distributed_available" in inspect.signature(metric.sync).parameters


def test_the_installed_versions_are_the_tested_ones():
    """The suite runs on the versions TESTED names: no note, every patch on."""
    assert patches.notes() == []
    assert all(patches.tested(package) for package in ("accelerate", "torch"))


def test_on_an_untested_accelerate_its_own_code_runs_and_a_note_says_so(accelerate_as_installed, monkeypatch):
    _untested(monkeypatch, "accelerate", "1.16.0")
    accelerator = Accelerator(cpu=True)
    patches.apply_to_process()
    patches.apply_to(accelerator)
    assert _unpatched(accelerator)
    state = dict(PartialState._shared_state)
    assert patches.fsdp_on_cpu(accelerator, plugin=None) is False and PartialState._shared_state == state
    [note] = patches.notes()
    assert note.startswith("accelerate 1.16.0 is untested with acc_trainer's patches (written for 1.15): ")
    assert "without the speed-ups of docs/performance.md" in note


def test_on_the_tested_accelerate_the_patches_apply(accelerate_as_installed, monkeypatch):
    """The counterpart of the test above: the same calls, with the guard seeing a tested version."""
    _untested(monkeypatch, "accelerate", "1.15.9")
    accelerator = Accelerator(cpu=True)
    patches.apply_to_process()
    patches.apply_to(accelerator)
    assert accelerate.optimizer.inspect is not inspect and "backward" in vars(accelerator)
    assert hasattr(accelerate.optimizer.is_lomo_available, "cache_info")
    assert accelerate.utils.other.is_deepspeed_available.__module__ == "acc_trainer.patches"


def test_acc_trainer_patches_0_leaves_accelerate_alone(accelerate_as_installed, monkeypatch):
    monkeypatch.setenv("ACC_TRAINER_PATCHES", "0")
    accelerator = Accelerator(cpu=True)
    patches.apply_to_process()
    patches.apply_to(accelerator)
    assert _unpatched(accelerator)


def test_worker_info_is_hidden_within_the_block_only(monkeypatch):
    seen = object()  # torch's WorkerInfo in a DataLoader worker
    monkeypatch.setattr(worker, "_worker_info", seen)
    with pytest.raises(KeyError):
        with patches.worker_info_hidden():
            assert get_worker_info() is None
            raise KeyError  # restored on the way out of an error too
    assert get_worker_info() is seen
    _untested(monkeypatch, "torch", "2.15.0")
    with patches.worker_info_hidden():
        assert get_worker_info() is seen  # an untested torch: the stream is told, as torch does
    assert [note.split(" is untested")[0] for note in patches.notes()] == ["torch 2.15.0"]


def _synchronising_metric(calls: list):
    """A torchmetrics sum that believes it runs in several processes and records each synchronisation."""
    torchmetrics = pytest.importorskip("torchmetrics")

    def gather(tensor, group=None):
        calls.append(tensor)
        return [tensor, tensor]  # as another process with the same states would give

    def distributed() -> bool:
        return True

    metric = torchmetrics.SumMetric(dist_sync_fn=gather, distributed_available_fn=distributed)
    metric.update(torch.tensor([1.0, 2.0]))
    return metric, distributed


def test_a_metric_computes_unsynchronised_within_the_block_only(monkeypatch):
    calls = []
    metric, users_own = _synchronising_metric(calls)
    with patches.unsynced(metric):
        assert metric.compute() == 3 and calls == []
    assert metric.distributed_available_fn is users_own
    metric.reset()
    metric.update(torch.tensor([1.0, 2.0]))
    assert metric.compute() == 6 and len(calls) == 1  # torchmetrics' own synchronisation, as the user set it


def test_fit_replaces_three_accelerate_attributes_and_no_class_nor_the_allocator(accelerate_as_installed, monkeypatch,
                                                                                tmp_path, torch_on_one_thread):
    """A user's `fit` leaves three module attributes of Accelerate replaced, for the rest of the process (the cached
    lookups and the DeepSpeed import of apply_to_process), and changes neither any class of Accelerate nor glibc's
    allocator; the command line keeps freed memory (docs/performance.md)."""
    import acc_trainer
    import acc_trainer.training.api
    from acc_trainer import cli

    calls = []
    monkeypatch.setattr(patches, "keep_freed_memory", lambda: calls.append("mallopt"))
    backward = Accelerator.backward
    reset_accelerate()
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    try:
        acc_trainer.fit(torch.nn.Linear(4, 2), data, epochs=1, batch_size=32, progress="none", plots=False,
                        output_dir=str(tmp_path / "run"))
    finally:
        reset_accelerate()
    assert calls == [] and Accelerator.backward is backward
    assert accelerate.optimizer.inspect is not inspect and hasattr(accelerate.optimizer.is_lomo_available, "cache_info")
    assert accelerate.utils.other.is_deepspeed_available.__module__ == "acc_trainer.patches"
    monkeypatch.setattr(acc_trainer.training.api, "train", lambda cfg: calls.append("train"))
    cli.main(["--epochs", "1"])
    assert calls == ["mallopt", "train"]
