"""Runs that can be run again: a run's saved config.yaml trains it again bit for bit (`acc-trainer --config`, and
`acc-trainer rerun`, which says whether the weights are the same and what changed); a fit() run's config.yaml
names what it cannot rebuild, and rerun refuses it in one line while `fit(config=...)` re-runs it; several
processes from a notebook after an in-process fit(); 'did you mean' for mistyped names."""

import pytest
import torch
from conftest import check, metrics, reset_accelerate, run_here
from safetensors.torch import load_file

from acc_trainer.config import ConfigError

JOB = ("--model", "mlp", "--train-size", "96", "--eval-size", "32", "--batch-size", "16", "--image-size", "8",
       "--max-steps", "4", "--no-plots", "--progress", "none")


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reruns")
    check(run_here(*JOB, "--output-dir", folder / "original"))
    return folder / "original"


def _same_bits(a, b) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_runs_own_config_trains_it_again_into_a_new_folder(original, tmp_path):
    check(run_here("--config", original / "config.yaml", cwd=tmp_path))
    (again,) = (tmp_path / "runs").iterdir()  # runs/<time>-mlp-synthetic: the file names no folder of its own
    assert _same_bits(again, original)
    assert [r.get("loss") for r in metrics(again)] == [r.get("loss") for r in metrics(original)]


def test_rerun_says_whether_the_weights_are_the_runs_and_what_changed(original, tmp_path):
    result = check(run_here("rerun", original, "--output-dir", tmp_path / "same"))
    assert f"{tmp_path}/same/model.safetensors is bit-identical to {original}/model.safetensors (4 tensors)" \
        in result.stdout
    assert _same_bits(tmp_path / "same", original)
    result = check(run_here("rerun", original, "--output-dir", tmp_path / "seed", "--seed", "7"))
    assert "differs from" in result.stdout and "in 4 of 4 tensors" in result.stdout
    assert result.stdout.rstrip().endswith("changed: --seed 7 (was 42)")
    assert not _same_bits(tmp_path / "seed", original)


def _data():
    from torch.utils.data import TensorDataset

    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(3))
    y = (x[:, 0] + x[:, 1] > 0).long()
    return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])


def _net():
    import acc_trainer

    acc_trainer.set_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _fit(output_dir, **options):
    import acc_trainer

    return acc_trainer.fit(_net(), *_data(), epochs=2, batch_size=16, progress="none", plots=False,
                           output_dir=str(output_dir), **options)


def test_a_fit_run_names_what_it_cannot_rebuild_and_its_options_run_again(tmp_path, torch_on_one_thread):
    import acc_trainer

    reset_accelerate()
    _fit(tmp_path / "fit", loss=lambda outputs, targets: torch.nn.functional.cross_entropy(outputs, targets),
         metrics=["accuracy"])
    config = (tmp_path / "fit" / "config.yaml").read_text()
    assert config.startswith("# fit() trained this run on objects this file cannot build again: model "
                             "torch.nn.modules.container:Sequential, data torch.utils.data.dataset:TensorDataset, "
                             "loss <lambda>\n")
    cfg = acc_trainer.parse_config(["--config", str(tmp_path / "fit" / "config.yaml")])
    assert cfg.metrics == ["accuracy"] and cfg.output_dir is None and cfg.epochs == 2
    refused = run_here("rerun", tmp_path / "fit")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "was trained by fit() on objects its config.yaml cannot build again (model torch.nn.modules.container:" \
           "Sequential, data torch.utils.data.dataset:TensorDataset, loss <lambda>); run the script" in refused.stderr
    # What the line says to do: the same objects, with the run's options, give the same weights.
    reset_accelerate()
    _fit(tmp_path / "again", loss=lambda outputs, targets: torch.nn.functional.cross_entropy(outputs, targets),
         config=cfg)
    assert _same_bits(tmp_path / "again", tmp_path / "fit")


@pytest.mark.skipif(torch.cuda.is_available(), reason="forks CPU processes: on a GPU machine the in-process fit() "
                    "puts CUDA in use, and launch_in_notebook refuses (the refusal is tested below, on a CPU)")
def test_launch_in_notebook_after_an_in_process_fit_returns_the_summary(tmp_path, torch_on_one_thread, monkeypatch):
    """Accelerate's notebook_launcher refuses once fit() ran in the notebook's own process; launch_in_notebook
    runs the two processes (forked, on the CPU) and hands back the main one's summary; the weights are the
    one-process run's (the global batch is the same)."""
    import acc_trainer

    reset_accelerate()
    one = _fit(tmp_path / "here")
    with pytest.raises(ValueError, match="Accelerator` should only be initialized inside your training function"):
        from accelerate import notebook_launcher

        notebook_launcher(_fit, (tmp_path / "unused",), num_processes=2)
    two = acc_trainer.launch_in_notebook(_fit, (tmp_path / "two",), num_processes=2)
    assert two["world_size"] == 2 and two["steps"] == one["steps"] == 6 and two["ranks_agree"] is True
    first, second = load_file(tmp_path / "here" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert all(torch.allclose(first[k], second[k], atol=1e-5) for k in first)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match="CUDA is already in use in this notebook's process .*restart the kernel"):
        acc_trainer.launch_in_notebook(_fit, (tmp_path / "three",), num_processes=2)


TYPOS = [
    (["--progress", "richh"], "argument --progress: invalid choice: 'richh' (choose from 'auto', 'rich', 'plain', "
                              "'none'); did you mean rich?"),
    (["--model", "mlpp"], "unknown model 'mlpp'; choose from linreg, mlp, lenet, convnet, resnet18, resnet18_cifar, or "
                          "give an import path pkg.module:factory, torchvision:<name> or timm:<name>; did you mean mlp?"),
    (["--optimizer", "adamm"], "; did you mean adam?"),
    (["--config", "{tmp}/value.yaml"], "unknown scheduler 'cosin'; choose from constant, cosine, step, onecycle, or give "
                                       "an import path pkg.module:attr; did you mean cosine?"),
    (["rerunn", "x"], "unknown command 'rerunn'; did you mean rerun?"),
    (["rerun", "{tmp}", "--seeds", "1"], "unknown option --seeds; did you mean --seed?"),
]


@pytest.mark.parametrize("args,message", TYPOS, ids=[" ".join(a) for a, _ in TYPOS])
def test_mistyped_names_get_the_nearest_known_one(tmp_path, args, message):
    (tmp_path / "value.yaml").write_text("scheduler: cosin\n")
    result = run_here(*[a.format(tmp=tmp_path) for a in args])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("acc-trainer: error: ") and result.stderr.endswith(f"{message.format(tmp=tmp_path)}\n")


def test_options_given_by_name_in_python_get_the_nearest_known_one():
    from acc_trainer.config import make_config

    with pytest.raises(ConfigError, match=r"^unknown option 'epoch'; did you mean epochs\?$"):
        make_config({"epoch": 2})
    with pytest.raises(ConfigError, match=r"^fit: unknown option 'batchsize'.*; did you mean batch_size\?$"):
        _fit("unused", batchsize=8)
