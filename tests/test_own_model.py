"""A user's own model and data: from Python (`fit`), by import path on the command line and in YAML,
on 1 and 2 processes (accelerate launch, torchrun, notebook_launcher), resumed, and every mistake a
user makes with them. The user's files are written by tests/user_project.py into a fresh folder."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import user_project
from conftest import BIN, REPO, _env, check, forked, free_port, launch, metrics, reset_accelerate, run_cli, summary
from safetensors.torch import load_file

# The tests' own torch work on one thread (conftest.torch_on_one_thread): two test workers share 2 cores.
pytestmark = pytest.mark.usefixtures("torch_on_one_thread")

EXAMPLES = REPO / "examples"


@pytest.fixture
def fit(project):
    """acc_trainer.fit in this process, with Accelerate's process-wide state reset before each run."""
    from accelerate.state import AcceleratorState, GradientState

    import acc_trainer

    def run(*args, **kwargs):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        return acc_trainer.fit(*args, **{"progress": "none", **kwargs})

    yield run
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_fit_trains_a_plain_module_with_its_own_loss_and_metrics(fit, project, capsys):
    from my_data import load
    from my_metrics import smooth_ce, top1_error
    from my_model import Net

    import acc_trainer

    acc_trainer.set_seed(0)
    train, evaluation = load()
    out = project / "run"
    s = fit(Net(4), train, evaluation, loss=smooth_ce, metrics={"accuracy": "accuracy", "top1_error": top1_error},
            epochs=3, batch_size=64, lr=2e-2, output_dir=str(out), progress="plain", save_best="top1_error")
    assert s["loss_function"] == "smooth_ce" and s["metrics"] == ["accuracy", "top1_error"]
    assert s["eval_samples"] == 301 and s["steps"] == 3 * (512 // 64)
    # Per-sample metrics are exact: every sample counted once, so accuracy and error add up to 1.
    assert s["eval"]["accuracy"] > 0.8
    assert s["eval"]["accuracy"] + s["eval"]["top1_error"] == pytest.approx(1, abs=1e-12)
    assert s["best"]["metric"] == "top1_error" and s["best"]["value"] == min(e["top1_error"] for e in s["evals"])
    # By name in every output: metrics.jsonl, summary.json, the plots, the end-of-run table.
    evals = [r for r in metrics(out) if "eval_loss" in r]
    assert [r["eval_samples"] for r in evals] == [301] * 3 and all("eval_top1_error" in r for r in evals)
    assert summary(out)["eval"]["top1_error"] == s["eval"]["top1_error"]
    assert (out / "plots" / "eval.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert f"top1_error {s['eval']['top1_error']:.4g}" in printed and "smooth_ce" in printed
    # The final weights load back into the user's model, strictly.
    Net(4).load_state_dict(load_file(out / "model.safetensors"))

    from acc_trainer.tools.report import main as report

    report([str(out), "--output", str(project / "report.png")])
    assert f"top1_error {s['eval']['top1_error']:.4g}" in capsys.readouterr().out


def test_fit_chooses_the_loss_from_the_targets(fit, project):
    from my_data import load, regression
    from my_model import Net

    classes = fit(Net(4), *load(), epochs=1, batch_size=64, output_dir=str(project / "classes"))
    assert classes["loss_function"] == "cross_entropy" and set(classes["eval"]) == {"loss", "accuracy"}
    values = fit(Net(1), *regression(), epochs=2, batch_size=32, output_dir=str(project / "values"))
    assert values["loss_function"] == "mse" and set(values["eval"]) == {"loss"}
    assert values["eval"]["loss"] < values["evals"][0]["loss"] or values["eval"]["loss"] < 0.5
    # No evaluation set: it trains, and says so.
    alone = fit(Net(4), load()[0], epochs=1, batch_size=64, output_dir=str(project / "alone"))
    assert alone["eval"] is None and alone["evals"] == [] and alone["steps"] == 8


def test_fit_refuses_what_it_cannot_use(fit, project):
    from my_data import load
    from my_model import Net

    from acc_trainer import ConfigError

    with pytest.raises(ConfigError, match="fit: unknown option 'learning_rate'"):
        fit(Net(4), *load(), learning_rate=0.1)
    with pytest.raises(ConfigError, match="fit: model must be a torch.nn.Module, not function"):
        fit(load, *load())
    with pytest.raises(ConfigError, match=r"loss mse does not fit the outputs of my_model:Net "
                                          r"\(\[2, 4\] float32\) and targets \(\[2\] int64\): "
                       r"ValueError: predictions \[2, 4\] and targets \[2\] differ in shape"):
        fit(Net(4), *load(), loss="mse", output_dir=str(project / "never"))
    assert not (project / "never").exists()


def test_a_bug_in_the_users_model_keeps_its_traceback_with_the_step(fit, project):
    from my_data import load
    from my_model import Buggy

    # The bug is in the third training-mode call: the first-sample check's, step 1's, step 2's.
    with pytest.raises(ZeroDivisionError) as caught:
        fit(Buggy(4), *load(), batch_size=64, output_dir=str(project / "run"))
    assert "acc_trainer: raised in epoch 1, after optimizer step 1, process 0 of 1" in caught.value.__notes__


def test_a_transformers_model_with_its_own_loss_on_dict_batches(tmp_path, monkeypatch):
    """examples/tiny_transformer.py in a short form: a BERT built from a config, dict batches, its own loss.
    Run in this process, as `python tiny_transformer.py ...` runs it."""
    import runpy

    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "tiny_transformer.py"), "--epochs", "1", "--max-steps", "16",
                                      "--log-every", "4", "--output-dir", str(out)])
    reset_accelerate()
    try:
        runpy.run_path(str(EXAMPLES / "tiny_transformer.py"), run_name="__main__")
    finally:
        reset_accelerate()
    s = summary(out)
    assert s["loss_function"] == "the model's own" and s["eval_samples"] == 512
    assert s["eval"]["accuracy"] > 0.6  # the majority class is about half
    losses = [r["loss"] for r in metrics(out) if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]


LAUNCH_JOB = ["--output-dir", "{out}", "--progress", "plain"]


def _weights(run: Path) -> dict:
    return load_file(run / "model.safetensors")


def test_a_users_script_on_one_and_two_processes_every_way_it_is_launched(project):
    """`python script.py`, `accelerate launch --multi_gpu --num_processes 2 script.py`, `torchrun
    --nproc_per_node 2 script.py` and notebook_launcher(num_processes=2): the same weights (SGD, not
    chaotic), every evaluation sample counted once, one process printing."""
    script, runs = project / "train_script.py", {}

    def flags(name):
        runs[name] = project / name
        return ["0", "--output-dir", runs[name], "--progress", "plain", "--no-plots"]

    outputs = {
        "python": check(subprocess.run([sys.executable, script, *flags("python")], capture_output=True, text=True,
                                       env=_env(), cwd=project, timeout=300)).stdout,
        "accelerate": check(launch(*flags("accelerate"), launcher_args=["--multi_gpu", "--num_processes", "2"],
                                   target=[script], cwd=project, plain=True)).stdout,
        "torchrun": check(subprocess.run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
                                          script, *flags("torchrun")], capture_output=True, text=True, env=_env(),
                                         cwd=project, timeout=300)).stdout,
        "notebook": check(subprocess.run([sys.executable, project / "notebook.py", str(free_port()),
                                          *map(str, flags("notebook"))], capture_output=True, text=True, env=_env(),
                                         cwd=project, timeout=300)).stdout,
    }
    reference = _weights(runs["python"])
    for name, run in runs.items():
        s = summary(run)
        assert s["world_size"] == (1 if name == "python" else 2), name
        assert s["eval_samples"] == 301 and s["steps"] == 16, name
        assert s["ranks_agree"] is (None if name == "python" else True), name  # one process: nothing to compare
        difference = max((_weights(run)[k] - reference[k]).abs().max().item() for k in reference)
        print(f"{name}: {s['world_size']} process(es), max weight difference from 1 process {difference:.1e}")
        assert difference <= 1e-5, name
        assert s["eval"]["accuracy"] == pytest.approx(summary(runs["python"])["eval"]["accuracy"], abs=1 / 301)
        assert outputs[name].count("acc_trainer my_model:Net on") == 1, name  # printed by the main process only


def test_a_model_with_dropout_resumed_after_sigterm_is_the_same_run(project):
    """2 processes; process 1 receives SIGTERM in its 11th training batch (step 11; its 12th training-mode
    call, after the first-sample check's): both stop at an agreed
    step with a checkpoint; resumed, the run ends bit-identical to an uninterrupted one (RNG states of
    both processes restored, so dropout draws the same masks)."""
    import train_script

    script = project / "train_script.py"
    two = ["--multi_gpu", "--num_processes", "2"]
    # The uninterrupted run and the resume: the script's main() on processes forked from this one (its launch is
    # the stopped run's).
    forked(train_script.main, ["0.3", "--output-dir", str(project / "whole"), "--log-every", "2", "--no-plots"])
    out = project / "cut"
    stopped = launch("0.3", "--output-dir", out, "--log-every", "2", "--no-plots", launcher_args=two, target=[script],
                     cwd=project, env={"SIGTERM_AT_BATCH": "12"})
    # fit() raises TrainingStopped (the user's script may catch it); its message says how to continue.
    assert stopped.returncode != 0 and "TrainingStopped: stopped by SIGTERM at step 12" in stopped.stderr
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 1 and 11 <= int(checkpoints[0].name[5:]) < 16, stopped.stderr[-2000:]
    forked(train_script.main, ["0.3", "--output-dir", str(out), "--log-every", "2", "--no-plots", "--resume", "auto"])
    whole, resumed = _weights(project / "whole"), _weights(out)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert summary(out)["eval"] == summary(project / "whole")["eval"]


def test_import_paths_from_the_users_folder_with_the_console_script(project):
    """`acc-trainer --model my_model:build --dataset my_data:load ...` run from the folder holding them."""
    out = project / "run"
    result = check(run_cli("--model", "my_model:build", "--model-args", "{width: 24}", "--dataset", "my_data:load",
                           "--dataset-args", '{"train_size": 256, "eval_size": 77}', "--loss", "my_metrics:smooth_ce",
                           "--metrics", "accuracy,my_metrics:top1_error", "--batch-size", "32", "--epochs", "2",
                           "--output-dir", out, cwd=project, command=[str(BIN / "acc-trainer")]))
    s = summary(out)
    assert s["model"] == "my_model:build" and s["loss_function"] == "my_metrics:smooth_ce"
    assert s["eval_samples"] == 77 and s["steps"] == 16
    assert s["eval"]["accuracy"] + s["eval"]["top1_error"] == pytest.approx(1, abs=1e-12)
    weights = load_file(out / "model.safetensors")
    assert weights["hidden.weight"].shape == (24, 16) and weights["out.weight"].shape == (4, 24)  # num_classes: 4
    assert "acc_trainer my_model:build on my_data:load" in result.stdout
    # config.yaml holds the nested arguments and reads back as a --config file.
    from acc_trainer.flags import parse_config

    again = parse_config(["--config", str(out / "config.yaml")])
    assert again.model_args == {"width": 24} and again.dataset_args == {"train_size": 256, "eval_size": 77}
    assert again.metrics == ["accuracy", "my_metrics:top1_error"]


def test_a_checkpoint_of_another_model_is_refused_by_its_parameters(project, main_in_process):
    """Same options, but the user's model file changed between the runs: the shapes say so."""
    out = project / "run"
    args = ["--model", "my_model:build", "--dataset", "my_data:load", "--batch-size", "64", "--output-dir", out,
            "--progress", "none"]
    assert main_in_process(*args, "--max-steps", "4", "--checkpoint-every", "4")[0] == 0
    (project / "my_model.py").write_text((project / "my_model.py").read_text().replace("width=32", "width=40"))
    for name in user_project.MODULES:  # a new process imports the changed file
        sys.modules.pop(name, None)
    code, _, stderr = main_in_process(*args, "--max-steps", "4", "--checkpoint-every", "4", "--resume",
                                      out / "checkpoints" / "step-00000004")
    assert code == 2, stderr
    assert (f"acc-trainer: error: checkpoint {out}/checkpoints/step-00000004 holds a different model: "
            "hidden.weight [32, 16] in the checkpoint, [40, 16] here") in stderr


BAD_USER_INPUT = [
    (["--model", "nosuch_module:Net"], "--model nosuch_module:Net: no module named 'nosuch_module'"),
    (["--model", "my_model:Nope"], "--model my_model:Nope: my_model has no attribute 'Nope'"),
    (["--model", "my_model:broken"], "model factory my_model:broken() raised ValueError: width must be even"),
    (["--model", "my_model:Net", "--model-args", "{depth: 2}"],
     "model factory my_model:Net(depth=2) raised TypeError: Net.__init__() got an unexpected keyword argument 'depth'"),
    (["--model", "my_model:Net", "--model-args", "[1, 2]"], "option 'model_args' must be a mapping, got '[1, 2]'"),
    (["--model", "my_model:ImageNet"], "model my_model:ImageNet does not take the samples of my_data:load "
                                       "(([2, 16] float32, [2] int64)): RuntimeError: "),
    (["--loss", "my_metrics:per_sample_loss"], "loss my_metrics:per_sample_loss returned [2] float32; it must return one number"),
    (["--loss", "mse"], "loss mse does not fit the outputs of my_model:Net ([2, 4] float32)"),
    (["--loss", "focal"], "unknown loss 'focal'; choose from cross_entropy, mse"),
    (["--metrics", "f2"], "unknown metric 'f2'; choose from accuracy, top5, mae, f1, precision, recall, auroc, iou"),
    (["--save-best", "f1"], "--save-best f1: the run evaluates loss, accuracy"),
    (["--dataset", "my_data:not_a_pair"], "dataset factory my_data:not_a_pair returned TensorDataset; it must return a pair"),
    (["--model", "torchvision:resnet999"], "--model torchvision:resnet999: torchvision has no classification model 'resnet999'"),
    (["--model", "timm:resnet18"], 'timm models need the timm package: pip install "acc_trainer[timm]"'),
    (["--model", "my model"], "unknown model 'my model'; choose from linreg"),
]


@pytest.mark.parametrize("args,message", BAD_USER_INPUT, ids=[" ".join(a) for a, _ in BAD_USER_INPUT])
def test_mistakes_with_a_users_objects_are_one_line(project, main_in_process, monkeypatch, args, message):
    monkeypatch.setitem(sys.modules, "timm", None)  # as if timm were not installed
    options = {"--model": "my_model:Net", "--dataset": "my_data:load"}
    for i in range(0, len(args), 2):
        options[args[i]] = args[i + 1]
    code, _, stderr = main_in_process(*[x for item in options.items() for x in item], "--max-steps", "2",
                                      "--output-dir", project / "run")
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("acc-trainer: error: "), stderr
    assert message in stderr
    assert not (project / "run").exists()  # nothing written


def test_a_missing_module_from_the_shell_is_one_line(tmp_path):
    result = run_cli("--model", "my_model:Net", cwd=tmp_path, command=[str(BIN / "acc-trainer")])
    assert result.returncode == 2
    assert result.stderr == (f"acc-trainer: error: --model my_model:Net: no module named 'my_model' (looked in "
                             f"{tmp_path} and the installed packages)\n")


def test_zoo_models_get_the_datas_number_of_classes(tmp_path, main_in_process, monkeypatch):
    """examples/shapes.py (a Dataset class of the user's) with `torchvision:resnet18` and `timm:resnet18`."""
    out = tmp_path / "tv"
    monkeypatch.chdir(EXAMPLES)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    try:
        code, _, stderr = main_in_process("--model", "torchvision:resnet18", "--dataset", "shapes:load",
                                          "--dataset-args", "{train_size: 64, eval_size: 37}", "--batch-size", "32",
                                          "--max-steps", "2", "--output-dir", out)
    finally:
        sys.modules.pop("shapes", None)
    assert code == 0, stderr
    assert summary(out)["eval_samples"] == 37
    assert load_file(out / "model.safetensors")["fc.weight"].shape == (3, 512)  # Shapes.classes: 3
    pytest.importorskip("timm")
    from acc_trainer.config import TrainConfig
    from acc_trainer.data.datasets import Data
    from acc_trainer.workload.components import build_model

    model = build_model(TrainConfig(model="timm:resnet18"), Data(None, None, "classification", 7, (3, 32, 32)))
    assert model.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 7)


def test_the_examples_run(tmp_path, main_in_process, monkeypatch):
    """examples/signal_classifier.py (fit in a script) and examples/signal.yaml (import paths in YAML), both
    in this process, as `python signal_classifier.py` and `acc-trainer --config signal.yaml` run them. (The
    console script from a user's folder: test_import_paths_from_the_users_folder_with_the_console_script;
    signal.yaml as the README's command, in a process of its own: test_readme.)"""
    import runpy

    out = tmp_path / "script"
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "signal_classifier.py"), "--epochs", "1", "--output-dir",
                                      str(out)])
    reset_accelerate()
    runpy.run_path(str(EXAMPLES / "signal_classifier.py"), run_name="__main__")
    assert summary(out)["eval"]["accuracy"] > 0.8 and summary(out)["eval_samples"] == 1000
    out = tmp_path / "yaml"
    monkeypatch.chdir(EXAMPLES)  # the user's folder, where signal.yaml's import paths point
    monkeypatch.syspath_prepend(str(EXAMPLES))
    try:
        code, _, stderr = main_in_process("--config", "signal.yaml", "--epochs", "1", "--output-dir", out)
    finally:
        sys.modules.pop("signal_classifier", None)  # a new process would import it afresh
    assert code == 0, stderr
    s = summary(out)
    assert s["model"] == "signal_classifier:SignalNet" and s["eval_samples"] == 500
    assert load_file(out / "model.safetensors")["head.weight"].shape == (3, 16)  # channels: 16, 3 classes


def test_built_in_names_match_the_registries():
    from acc_trainer import config
    from acc_trainer.data import datasets as data
    from acc_trainer.workload import models

    assert config.MODELS == tuple(models.MODELS) and config.DATASETS == tuple(data.DATASETS)
    assert json.loads(json.dumps(config.TrainConfig(model_args={"a": [1]}).to_dict()))["model_args"] == {"a": [1]}


def test_the_python_api_names_stay_callable(tmp_path):
    """`acc_trainer.train` once was the loop's module: after any first use, `acc_trainer.train(...)` raised
    "'module' object is not callable". Each exported name must be what it says, whatever was used first."""
    code = ("import acc_trainer, inspect; acc_trainer.fit; acc_trainer.check; acc_trainer.parse_config; "
            "import acc_trainer.cli, acc_trainer.tools.check; "
            "print(' '.join(n for n in acc_trainer.__all__ if not callable(getattr(acc_trainer, n))) or 'callable'); "
            "print(acc_trainer.train(acc_trainer.TrainConfig(model='mlp', max_steps=2, eval_size=16, plots=False, "
            f"output_dir={str(tmp_path / 'run')!r}))['steps'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().split("\n")
    assert (lines[0], lines[-1]) == ("callable", "2")


def test_a_run_made_by_fit_is_evaluated_and_predicted_from_python(fit, project, main_in_process):
    """`acc_trainer.evaluate(RUN, model=..., data=...)` loads the run's weights into the model as built before
    training and gives the run's own final numbers; the command line, which cannot build fit()'s objects again,
    says in one line what to give it."""
    from accelerate.state import AcceleratorState, GradientState
    from my_data import load
    from my_model import Net

    import acc_trainer

    train, evaluation = load()
    out = project / "run"
    fit(Net(4), train, evaluation, batch_size=64, max_steps=6, plots=False, output_dir=str(out))
    s = summary(out)
    assert s["built_from"] == "objects (fit)"
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    results = acc_trainer.evaluate(out, model=Net(4), data=evaluation, progress="none")
    assert results["samples"] == 301
    assert results["accuracy"] == s["eval"]["accuracy"] and results["loss"] == pytest.approx(s["eval"]["loss"], abs=1e-6)
    rows = acc_trainer.predict(out, model=Net(4), data=evaluation, progress="none")
    assert [r["index"] for r in rows] == list(range(301))
    assert sum(r["class"] == int(evaluation[r["index"]][1]) for r in rows) / 301 == s["eval"]["accuracy"]

    with pytest.raises(acc_trainer.ConfigError, match=r"do not load into Net: RuntimeError: Error\(s\) in loading"):
        acc_trainer.evaluate(out, model=Net(4, width=8), data=evaluation)
    with pytest.raises(acc_trainer.ConfigError, match=r"give the model as it was built before training"):
        acc_trainer.evaluate(out, data=evaluation)
    code, _, stderr = main_in_process("evaluate", out)
    assert code == 2 and stderr == (
        f"acc-trainer: error: {out} was trained by fit() on objects (my_model:Net, torch.utils.data.dataset:"
        "TensorDataset), which the command line cannot build again: give --model and --dataset as functions that "
        f"build them (module:function), or from Python: acc_trainer.evaluate('{out}', model=..., data=...)\n")


def test_a_transformers_run_folder_loads_with_from_pretrained(tmp_path):
    """A causal LM with tied embeddings (GPT-2 from its config), trained by fit(): the run folder, and each
    checkpoint, load with AutoModelForCausalLM.from_pretrained and give the trained model's logits."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    import acc_trainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=50,
                                       bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 50, (32, 16), generator=torch.Generator().manual_seed(1))
    samples = [{"input_ids": row, "labels": row} for row in ids]
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    out = tmp_path / "run"
    acc_trainer.fit(model, samples, batch_size=8, max_steps=4, checkpoint_every="2", optimizer="adamw", lr=1e-2,
                    metrics=["perplexity"], progress="none", plots=False, output_dir=str(out))
    model.eval()
    with torch.no_grad():
        expected = model(ids[:4]).logits
        for folder in (out, out / "checkpoints" / "step-00000004"):
            loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
            assert type(loaded) is GPT2LMHeadModel and loaded.lm_head.weight is loaded.transformer.wte.weight
            assert torch.equal(loaded(ids[:4]).logits, expected), folder
            assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 0
    sums = (out / "SHA256SUMS").read_text()
    assert "config.json" in sums and "generation_config.json" in sums  # verified as the weights are
    # The run's weights into a fresh model: the tied output layer, held once in the file, is filled in too.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    fresh = acc_trainer.evaluate(out, model=GPT2LMHeadModel(model.config), data=samples[:8], progress="none")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    # With the run's own metrics (its config.yaml's): its perplexity too, which evaluate() used to leave out.
    assert fresh["perplexity"] == pytest.approx(math.exp(fresh["loss"]))
    assert fresh == acc_trainer.evaluate(model, samples[:8], metrics=["perplexity"], progress="none")


def test_a_config_transformers_refuses_to_write_leaves_the_weights(tmp_path, capsys):
    """transformers raises ValueError for a config it finds invalid: a warning, not a crash of the main process
    alone (the others would wait at the next collective)."""
    from acc_trainer.language.pretrained import config_files

    class Refused:
        def save_pretrained(self, folder):
            (folder / "config.json").write_text("{")
            raise ValueError("temperature is set but do_sample is False")

    class Model:
        config = Refused()

        def save_pretrained(self, folder):
            pass

    assert config_files(Model(), tmp_path) == [] and not (tmp_path / "config.json").exists()
    assert "Model's config was not written beside its weights" in capsys.readouterr().err


def _gpt2_fit(tmp_path, name, **options):
    """A 2-layer GPT-2 (dropout on) trained by fit() on fixed token rows: its final weights, and how many
    tensors a training forward pass of the model (as fit left it) keeps for the backward pass."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import GPT2Config, GPT2LMHeadModel

    import acc_trainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=50))
    ids = torch.randint(0, 50, (32, 16), generator=torch.Generator().manual_seed(1))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    options = {"max_steps": 6, **options}
    acc_trainer.fit(model, [{"input_ids": row, "labels": row} for row in ids], batch_size=8, optimizer="sgd", lr=0.1,
                    progress="none", plots=False, output_dir=str(tmp_path / name), **options)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        model.train()(input_ids=ids[:2], labels=ids[:2])
    return load_file(tmp_path / name / "model.safetensors"), len(kept)


def test_gradient_checkpointing_trains_the_same_weights(tmp_path):
    """--gradient-checkpointing through the transformers model's own switch (non-reentrant; dropout's random
    numbers replayed in the recomputation): the weights of a run without it, within 1e-6."""
    (plain, kept), (checkpointed, recomputed) = _gpt2_fit(tmp_path, "plain"), _gpt2_fit(tmp_path, "checkpointed",
                                                                                         gradient_checkpointing=True)
    assert recomputed < kept / 2, (recomputed, kept)  # the blocks' activations are recomputed, not kept
    assert max((plain[k] - checkpointed[k]).abs().max().item() for k in plain) <= 1e-6
    one_step, _ = _gpt2_fit(tmp_path, "one step", max_steps=1)
    assert any((plain[k] != one_step[k]).any() for k in plain)  # six steps moved the weights on


def test_gradient_checkpointing_on_a_module_without_the_switch_is_one_line(fit, project):
    from my_data import load
    from my_model import Net

    import acc_trainer

    with pytest.raises(acc_trainer.ConfigError, match=r"--gradient-checkpointing: Net has no gradient_checkpointing_"
                                                      r"enable .* call torch.utils.checkpoint.checkpoint"):
        fit(Net(4), *load(), gradient_checkpointing=True, output_dir=str(project / "never"))
    assert not (project / "never").exists()
