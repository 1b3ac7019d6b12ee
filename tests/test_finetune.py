"""Fine-tuning: start from weights (--init-from, --pretrained), freeze and unfreeze, parameter groups and
layer decay, an optimizer and scheduler of your own; and that fine-tuning helps, measured."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from conftest import run_here
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


class Net(nn.Module):
    """A backbone with BatchNorm and a head, as fine-tuned models are."""

    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.head(self.body(x))


def task(classes: int, n: int, seed: int, noise: float = 1.0):
    """Samples around 8 fixed prototypes (the same for every task); the label is the prototype's index
    modulo `classes`: tasks with 8 and with 4 classes share their features."""
    prototypes = torch.randn(8, 16, generator=torch.Generator().manual_seed(123)) * 2
    g = torch.Generator().manual_seed(seed)
    which = torch.randint(0, 8, (n,), generator=g)
    return TensorDataset(prototypes[which] + noise * torch.randn(n, 16, generator=g), which % classes)


def fit(model, train, evaluation, out, **options):
    import acc_trainer

    return acc_trainer.fit(model, train, evaluation, output_dir=str(out), progress="none", plots=False,
                           **{"batch_size": 32, "optimizer": "sgd", "lr": 0.05, **options})


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A run on the 8-class task: its folder (model.safetensors, checkpoints)."""
    import acc_trainer

    out = tmp_path_factory.mktemp("pretrained") / "run"
    acc_trainer.set_seed(0)
    fit(Net(8), task(8, 2048, 1), task(8, 256, 2), out, epochs=4, checkpoint_every="epoch")
    return out


def test_init_from_a_run_resets_the_head_of_another_size_and_says_so(pretrained, tmp_path):
    import acc_trainer

    acc_trainer.set_seed(0)
    s = fit(Net(4), task(4, 64, 3), task(4, 128, 4), tmp_path / "run", epochs=1, init_from=str(pretrained))
    init = s["init"]
    assert init["from"] == str(pretrained) and init["reset"] == ["head.bias", "head.weight"]
    # 2 Linear layers, BatchNorm (2 + 3 buffers)
    assert init["missing"] == [] and init["unexpected"] == [] and init["loaded"] == 9
    assert any(note.startswith(f"init from {pretrained}: 9 tensors loaded, 2 reset (head.bias, head.weight)")
               for note in s["notes"])


def test_init_from_a_torch_state_dict_with_wrapper_prefixes_and_strict(pretrained, tmp_path):
    import acc_trainer

    weights = load_file(pretrained / "model.safetensors")
    torch.save({"state_dict": {f"module._orig_mod.{k}": v for k, v in weights.items()}}, tmp_path / "w.pt")
    model = Net(8)
    fit(model, task(8, 64, 3), None, tmp_path / "run", max_steps=1, lr=1e-12, init_from=str(tmp_path / "w.pt"))
    assert torch.allclose(model.body[0].weight.detach(), weights["body.0.weight"], atol=1e-9)
    with pytest.raises(acc_trainer.ConfigError, match=r"does not match the model exactly \(--init-strict\): 2 of "
                                                       r"another shape, 0 missing, 0 unexpected; first: reset head.bias"):
        fit(Net(4), task(4, 64, 3), None, tmp_path / "never", init_from=str(tmp_path / "w.pt"), init_strict=True)
    (tmp_path / "notes.pt").write_text("not weights")
    with pytest.raises(acc_trainer.ConfigError, match=r"notes.pt is not a weights file: UnpicklingError"):
        fit(Net(4), task(4, 64, 3), None, tmp_path / "never", init_from=str(tmp_path / "notes.pt"))
    assert not (tmp_path / "never").exists()


def test_frozen_parameters_and_their_batchnorm_statistics_stay_bit_identical(pretrained, tmp_path):
    """--freeze for good: the frozen weights and statistics stay as --init-from gave them; checkpoints hold what
    trains and the buffers, not the frozen weights, and a run resumed from one (the frozen weights read again
    from --init-from) ends bit-identical."""
    import acc_trainer

    options = dict(epochs=2, init_from=str(pretrained), freeze=r"^body\.", optimizer="adamw", weight_decay=0.1,
                   checkpoint_every="epoch")
    acc_trainer.set_seed(0)
    start = load_file(pretrained / "model.safetensors")
    fit(Net(8), task(8, 256, 5), None, tmp_path / "run", **options)
    after = load_file(tmp_path / "run" / "model.safetensors")
    for name in after:
        if name.startswith("body."):
            assert torch.equal(after[name], start[name]), name  # weights, BatchNorm's running mean and variance
        else:
            assert not torch.equal(after[name], start[name]), name
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000008"
    assert sorted(load_file(checkpoint / "model.safetensors")) == [
        "body.1.num_batches_tracked", "body.1.running_mean", "body.1.running_var", "head.bias", "head.weight"]
    shutil.copytree(checkpoint, tmp_path / "cut" / "checkpoints" / checkpoint.name)
    acc_trainer.set_seed(0)
    fit(Net(8), task(8, 256, 5), None, tmp_path / "cut", resume="auto", **options)
    resumed = load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(after[k], resumed[k]) for k in after)


def test_unfreezing_resumed_from_before_the_unfreeze_is_the_same_run(pretrained, tmp_path):
    """--freeze the body until epoch 3 of 4 (8 steps an epoch); resumed from the checkpoint of epoch 1, the run
    ends bit-identical to the uninterrupted one. Every group is in the optimizer from the first step."""
    import acc_trainer

    options = dict(epochs=4, init_from=str(pretrained), freeze=r"^body\.", unfreeze_at=3, optimizer="adamw",
                   weight_decay=0.05, checkpoint_every="epoch", param_groups={r"^body\.": {"lr_mult": 0.1}})
    acc_trainer.set_seed(0)
    whole = fit(Net(8), task(8, 256, 5), None, tmp_path / "whole", **options)
    frozen_until = load_file(tmp_path / "whole" / "checkpoints" / "step-00000016" / "model.safetensors")
    start = load_file(pretrained / "model.safetensors")
    assert torch.equal(frozen_until["body.0.weight"], start["body.0.weight"])  # still frozen after epoch 2
    assert not torch.equal(load_file(tmp_path / "whole" / "model.safetensors")["body.0.weight"], start["body.0.weight"])
    assert whole["param_groups"] == [{"lr_mult": 0.1, "weight_decay": 0.05, "parameters": 6},
                                     {"lr_mult": 1.0, "weight_decay": 0.05, "parameters": 2}]
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-00000008", cut / "checkpoints" / "step-00000008")
    acc_trainer.set_seed(0)
    fit(Net(8), task(8, 256, 5), None, cut, resume="auto", **options)
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(cut / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_freezing_and_groups_on_two_processes():
    """acc-trainer check with --freeze/--unfreeze-at and parameter groups (a model without BatchNorm, whose
    statistics differ per process by design): 2 processes and accumulation end where 1 process does, and a run
    resumed across the unfreeze (half-way, step 4; unfreezing at epoch 2, step 5) too."""
    import acc_trainer

    acc_trainer.set_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    rows = {r["check"]: r for r in acc_trainer.check(
        model, task(8, 128, 5), task(8, 64, 6), steps=8, batch_size=32, optimizer="sgd", lr=0.05,
        freeze=r"^[02]\.", unfreeze_at=2, no_decay_norm_bias=True, weight_decay=0.01,
        param_groups={r"^0\.": {"lr_mult": 0.5}})}
    for name in ("2 processes vs 1", "--grad-accum 2 vs 1 process", "stopped at step 4 and resumed"):
        assert rows[name]["result"] == "PASS", rows[name]
    assert float(re.search(r"difference (\S+)", rows["2 processes vs 1"]["measured"]).group(1)) <= 1e-5


def test_param_groups_layer_decay_and_no_decay_on_norms_and_biases():
    from torchvision.models import resnet18

    from acc_trainer.config import make_config
    from acc_trainer.workload.optim import _depths, build_optimizer, param_groups

    model = resnet18(num_classes=5)
    names = [n for n, _ in model.named_parameters()]
    depth, deepest = _depths(names)
    assert depth["conv1.weight"] == depth["bn1.weight"] == 0 and depth["layer1.0.conv1.weight"] == 1
    assert depth["layer4.1.bn2.bias"] == 4 and depth["fc.weight"] == deepest == 5
    cfg = make_config({"layer_decay": 0.5, "no_decay_norm_bias": True, "weight_decay": 0.05,
                       "param_groups": {r"^fc\.": {"lr_mult": 10}}})
    groups = build_optimizer(cfg, param_groups(cfg, model, 0.1), 0.1).param_groups  # adam: its own lr, decay 0.05
    by_param = {id(p): g for g in groups for p in g["params"]}
    params = dict(model.named_parameters())
    assert by_param[id(params["conv1.weight"])]["lr"] == pytest.approx(0.1 * 0.5 ** 5)
    assert by_param[id(params["layer3.0.conv1.weight"])]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
    assert by_param[id(params["fc.weight"])]["lr"] == pytest.approx(0.1 * 10)
    assert by_param[id(params["layer3.0.bn1.weight"])]["weight_decay"] == 0.0
    assert by_param[id(params["layer3.0.conv1.weight"])]["weight_decay"] == 0.05
    assert sum(len(g["params"]) for g in groups) == len(names)


def test_a_factorys_own_learning_rate_and_decay_stay_and_groups_scale_them():
    from acc_trainer.config import make_config
    from acc_trainer.workload.optim import build_optimizer, param_groups

    cfg = make_config({"param_groups": {r"^body\.": {"lr_mult": 0.1}}, "lr": 1e-3, "weight_decay": 0.0})
    optimizer = build_optimizer(cfg, param_groups(cfg, Net(4), 1e-3), 1e-3,
                                lambda groups: torch.optim.SGD(groups, lr=0.5, weight_decay=5e-4))
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(pytest.approx(0.05), 5e-4), (0.5, 5e-4)]


def test_an_optimizer_and_scheduler_of_your_own_resume_exactly(tmp_path):
    import acc_trainer

    def make(**extra):
        acc_trainer.set_seed(0)
        return fit(Net(4), task(4, 256, 7), None, extra.pop("out"), max_steps=16, checkpoint_every="8",
                   optimizer=lambda groups: torch.optim.RAdam(groups, lr=3e-3, betas=(0.9, 0.99)),
                   scheduler=lambda optimizer, total: torch.optim.lr_scheduler.StepLR(optimizer, total // 4, 0.5), **extra)

    whole = make(out=tmp_path / "whole")
    assert whole["steps"] == 16
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-00000008", cut / "checkpoints" / "step-00000008")
    make(out=cut, resume="auto")
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(cut / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(acc_trainer.ConfigError, match="fit: optimizer= takes a name or a factory"):
        fit(Net(4), task(4, 64, 7), None, tmp_path / "never", optimizer=torch.optim.Adam(Net(4).parameters()))
    assert not (tmp_path / "never").exists()


def test_an_optimizer_by_import_path_from_the_command_line(project, tmp_path):
    result = run_here("--model", "my_model:build", "--dataset", "my_data:load", "--batch-size", "64", "--epochs", "1",
                      "--optimizer", "torch.optim:RAdam", "--optimizer-args", "{betas: [0.9, 0.99]}",
                      "--output-dir", tmp_path / "run", "--progress", "none", "--no-plots", cwd=project)
    assert result.returncode == 0, result.stderr[-2000:]
    bad = run_here("--model", "my_model:build", "--dataset", "my_data:load", "--optimizer", "torch.optim:Nothing",
                   "--output-dir", tmp_path / "never", cwd=project)
    assert bad.returncode == 2 and "--optimizer torch.optim:Nothing: torch.optim has no attribute 'Nothing'" in bad.stderr


def test_pretrained_weights_offline_are_one_line_naming_the_file_and_the_folder(tmp_path, monkeypatch):
    """No network here: the download fails at once, and the line says where to put the file."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    result = run_here("--model", "torchvision:resnet18", "--pretrained", "--dataset", "synthetic", "--train-size", "256",
                      "--output-dir", tmp_path / "never")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "--pretrained: the weights of torchvision:resnet18 cannot be downloaded" in lines[0]
    assert f"put resnet18-f37072fd.pth (from https://download.pytorch.org/models/resnet18-f37072fd.pth) in " \
           f"{tmp_path / 'torch' / 'hub' / 'checkpoints'}" in lines[0]


def test_pretrained_weights_in_the_cache_get_a_new_head(tmp_path, monkeypatch):
    """Weights put in the cache by hand (here: a fresh model's, under the file name torchvision expects, whose hash
    check is off for torchvision's classification weights) load, and the head is rebuilt for the data's classes."""
    from torchvision.models import resnet18

    folder = tmp_path / "torch" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    reference = resnet18()
    torch.save(reference.state_dict(), folder / "resnet18-f37072fd.pth")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    from acc_trainer.config import make_config
    from acc_trainer.workload.components import build_data, build_model

    cfg = make_config({"model": "torchvision:resnet18", "pretrained": True, "train_size": 256})
    model = build_model(cfg, build_data(cfg))
    assert model.fc.out_features == 10 and torch.equal(model.conv1.weight, reference.conv1.weight)


def test_fine_tuning_beats_training_from_scratch_on_few_labels(pretrained, tmp_path):
    """Pretrained on the 8-class task (2,048 samples), fine-tuned on the related 4-class task with 64 labelled
    samples, against the same 64 from scratch; both evaluated on 512."""
    import acc_trainer

    few, evaluation = task(4, 64, 11, noise=1.5), task(4, 512, 12, noise=1.5)
    results = {}
    for name, extra in (("scratch", {}), ("fine-tuned", {"init_from": str(pretrained)})):
        acc_trainer.set_seed(0)
        results[name] = fit(Net(4), few, evaluation, tmp_path / name, epochs=10, **extra)["eval"]["accuracy"]
    print(results)
    assert results["fine-tuned"] >= results["scratch"] + 0.1


def test_the_schedule_scales_every_group_alike():
    from acc_trainer.config import make_config
    from acc_trainer.workload.optim import build_optimizer, build_scheduler, param_groups

    model = Net(4)
    for name in ("cosine", "onecycle"):
        cfg = make_config({"param_groups": {r"^body\.": {"lr_mult": 0.1}}, "scheduler": name, "warmup_steps": 2})
        optimizer = build_optimizer(cfg, param_groups(cfg, model, 0.2), 0.2)
        scheduler = build_scheduler(cfg, optimizer, 0.2, total_steps=10, steps_per_epoch=5)
        for _ in range(6):
            optimizer.step()
            scheduler.step()
            body, head = (g["lr"] for g in optimizer.param_groups)
            assert body == pytest.approx(0.1 * head), name


def test_the_built_in_schedules_follow_torchs_own():
    """`step` is torch's StepLR over epochs of optimizer steps, `cosine` its CosineAnnealingLR to 0 (both
    without warmup), learning rate for learning rate over a run of 3 epochs of 5 steps."""
    from acc_trainer.config import make_config
    from acc_trainer.workload.optim import build_optimizer, build_scheduler, param_groups

    for name, theirs in (("step", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2 * 5, gamma=0.3)),
                         ("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=15))):
        cfg = make_config({"scheduler": name, "warmup_steps": 0, "lr_step_epochs": 2, "lr_gamma": 0.3})
        ours = build_optimizer(cfg, param_groups(cfg, Net(4), 0.2), 0.2)
        reference = torch.optim.SGD(Net(4).parameters(), lr=0.2)
        schedules = build_scheduler(cfg, ours, 0.2, total_steps=15, steps_per_epoch=5), theirs(reference)
        for step in range(15):
            assert ours.param_groups[0]["lr"] == pytest.approx(reference.param_groups[0]["lr"], rel=1e-12), (name, step)
            ours.step(), reference.step()
            for schedule in schedules:
                schedule.step()


SCHEDULE = '''
import torch


def halving(optimizer, total_steps):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, total_steps // 2), gamma=0.5)
'''


def test_a_scheduler_by_import_path_from_the_command_line(project, tmp_path):
    import json

    (project / "schedules.py").write_text(SCHEDULE)
    result = run_here("--model", "my_model:build", "--dataset", "my_data:load", "--batch-size", "64", "--max-steps", "8",
                      "--log-every", "1", "--scheduler", "schedules:halving", "--output-dir", tmp_path / "run",
                      "--progress", "none", "--no-plots", cwd=project)
    assert result.returncode == 0, result.stderr[-2000:]
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
           if '"lr"' in line]
    assert lrs[:3] == [1e-3, 1e-3, 1e-3] and lrs[4:7] == [5e-4, 5e-4, 5e-4] and lrs[-1] == 2.5e-4


def test_frozen_parameters_are_found_again_under_the_names_wrappers_give():
    """Under FSDP2, --freeze's parameters are found again by name once prepared (fully_shard replaces them): names
    taken from a model its user compiled, or asked of layers that Accelerate's FSDP2 activation checkpointing wrapped,
    find the same parameters; a name found nowhere is an error, not layers silently left training."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from acc_trainer.language.adapters import found_again

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    compiled = torch.compile(model, backend="eager")
    names = {name for name, _ in compiled.named_parameters() if name.startswith("_orig_mod.0.")}
    first = [model[0].weight, model[0].bias]
    for prepared in (model, compiled, nn.Sequential(checkpoint_wrapper(model[0]), model[1])):
        found = found_again(prepared, names)
        assert len(found) == 2 and all(a is b for a, b in zip(found, first)), prepared
    with pytest.raises(RuntimeError, match="0 of its 1 parameters"):
        found_again(model, {"2.weight"})
