"""The command line as the README shows it: the default job, --help, YAML configs and bad input."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from acc_trainer.flags import parse_config
from acc_trainer.config import ConfigError, TrainConfig
from conftest import BIN, check, run_cli


# The default job (`python -m acc_trainer`, as the README's quick start types it) runs once, in
# test_readme.py::test_readme_command_runs, which makes every check of it: the run learns (accuracy, its line
# on stdout), its summary, metrics.jsonl, config.yaml read back by --config, and the final weights.


@pytest.fixture(scope="module")
def help_text() -> str:
    """`python -m acc_trainer --help`, once for the tests that read it."""
    return check(run_cli("--help")).stdout


def test_console_script_is_the_same_command(help_text):
    via_module = help_text
    via_script = check(run_cli("--help", command=[str(BIN / "acc-trainer")])).stdout
    assert via_script == via_module


def test_help_documents_every_option(help_text):
    text = help_text
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, f"{flag} missing from --help"
        assert f.metadata["help"].split()[0] in text
    assert "--config" in text and "accelerate launch" in text


def test_yaml_config_with_flags_overriding_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: mlp\nbatch-size: 64\nlr: 0.01\noptimizer: sgd\nnesterov: true\n")
    cfg = parse_config(["--config", str(path), "--lr", "0.02"])
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.optimizer, cfg.nesterov) == ("mlp", 64, 0.02, "sgd", True)
    assert parse_config(["--config", str(path), "--no-nesterov"]).nesterov is False


def _existing_run(tmp_path: Path) -> Path:
    run = tmp_path / "earlier"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "model.safetensors").write_bytes(b"weights of an earlier run")
    return run


BAD_INPUTS = [
    (["--model", "transformer"], "unknown model 'transformer'; choose from linreg, mlp"),
    (["--dataset", "mnist"], "unknown dataset 'mnist'; choose from synthetic"),
    (["--batch-size", "0"], "--batch-size must be positive, got 0"),
    (["--epochs", "-1"], "--epochs must be positive, got -1"),
    (["--train-size", "0"], "--train-size must be positive"),
    (["--lr", "0"], "--lr must be positive, got 0.0"),
    (["--lr", "fast"], "invalid float value: 'fast'"),
    (["--batch-size", "100", "--grad-accum", "3"], "does not divide into --grad-accum 3"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--config", "{tmp}/missing.yaml"], "missing.yaml does not exist"),
    (["--config", "{tmp}/broken.yaml"], "is not valid YAML"),
    (["--config", "{tmp}/unknown.yaml"], "unknown option 'learning_rate'"),
    (["--config", "{tmp}/wrongtype.yaml"], "option 'epochs' must be int, got 'three'"),
    (["--dataset", "imagefolder", "--data-dir", "{tmp}/nowhere"], "imagefolder needs {tmp}/nowhere/train"),
    (["--dataset", "cifar10", "--data-dir", "{tmp}/nocifar"], "put the extracted 'cifar-10-batches-py' folder"),
    (["--model", "linreg"], "use it with --dataset linear"),
    (["--model", "lenet", "--dataset", "linear"], "classifies images"),
    (["--mixed-precision", "fp16", "--cpu"], "fp16 mixed precision needs a GPU"),
    (["--train-size", "100", "--batch-size", "128"], "fewer than one global batch"),
    (["--log-with", "notatracker"], "unknown tracker 'notatracker'"),
    (["--output-dir", "{tmp}/earlier"], "already holds a run"),
]


def _bad_input_files(tmp_path: Path) -> Path:
    (tmp_path / "broken.yaml").write_text("model: [lenet\n")
    (tmp_path / "unknown.yaml").write_text("learning_rate: 0.1\n")
    (tmp_path / "wrongtype.yaml").write_text("epochs: three\n")
    return _existing_run(tmp_path)


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, main_in_process, args, message):
    earlier = _bad_input_files(tmp_path)
    args = [a.format(tmp=tmp_path) for a in args]
    code, _, stderr = main_in_process(*args, "--max-steps", "2")
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("acc-trainer: error: "), stderr
    assert message.format(tmp=tmp_path) in stderr
    # Nothing already written is touched, and a failed start leaves no half-made run behind.
    assert (earlier / "model.safetensors").read_bytes() == b"weights of an earlier run"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args", [["--model", "transformer"], ["--config", "{tmp}/broken.yaml"],
                                  ["--dataset", "cifar10", "--data-dir", "{tmp}/nocifar"]])
def test_bad_input_from_the_shell_has_no_traceback(tmp_path, args):
    """The same, as a user's shell sees it: a real process, its exit code and its whole stderr."""
    _bad_input_files(tmp_path)
    result = run_cli(*[a.format(tmp=tmp_path) for a in args], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("acc-trainer: error: ")
    assert "Traceback" not in result.stdout + result.stderr


def test_config_errors_are_one_type():
    with pytest.raises(ConfigError, match="--warmup-steps must not be negative"):
        TrainConfig(warmup_steps=-1).validate()
    with pytest.raises(ConfigError, match="--nesterov applies to --optimizer sgd only"):
        TrainConfig(nesterov=True, optimizer="adam").validate()
