"""The command line as the README shows it: the default job, --help, YAML configs and bad input."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import BIN, REPO, check, run_cli

from acc_trainer.config import ConfigError, TrainConfig
from acc_trainer.flags import parse_config

FLAGS = {"--" + f.name.replace("_", "-") for f in fields(TrainConfig)}


# The default job (`python -m acc_trainer`, as the README's quick start types it) runs once, in
# test_readme.py::test_readme_command_runs, which makes every check of it: the run learns (accuracy, its line
# on stdout), its summary, metrics.jsonl, config.yaml read back by --config, and the final weights.


@pytest.fixture(scope="module")
def help_text() -> str:
    """`python -m acc_trainer --help`, once for the tests that read it."""
    return check(run_cli("--help")).stdout


def test_help_names_every_command_and_each_its_own_options(help_text, main_in_process):
    from acc_trainer.cli import COMMANDS

    for command in COMMANDS:  # consolidate was left out of --help's list
        assert f"  acc-trainer {command} " in help_text, command
    code, stdout, _ = main_in_process("export", "--help")
    assert code == 0 and "--format {onnx,pt2,safetensors}" in stdout and "--samples N" in stdout


def test_the_start_line_names_the_topology_as_a_reader_says_it(tmp_path, main_in_process):
    code, stdout, stderr = main_in_process("--max-steps", "2", "--progress", "plain", "--output-dir", tmp_path / "run")
    assert code == 0 and "1 process(es) (undistributed, cpu)" in stdout and "(NO," not in stdout, stdout + stderr


def test_the_commands_process_collects_garbage_once_imported_and_a_callers_as_before(tmp_path, main_in_process):
    """The command's own process imports with the garbage collector paused, then freezes what the imports made and
    collects from then on (docs/performance.md); main() called in another process leaves its collector alone."""
    import gc
    import json

    (tmp_path / "gc_probe.py").write_text(
        "import gc, json, torch\n"
        "def model(**_):\n"
        "    with open('gc.json', 'w') as f:\n"
        "        json.dump({'enabled': gc.isenabled(), 'frozen': gc.get_freeze_count()}, f)\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))\n")
    args = ("--model", "gc_probe:model", "--max-steps", "1", "--no-plots")
    check(run_cli(*args, "--output-dir", tmp_path / "shell", cwd=tmp_path))
    seen = json.loads((tmp_path / "gc.json").read_text())
    assert seen["enabled"] and seen["frozen"] > 100_000, seen  # torch and Accelerate's objects, frozen
    frozen = gc.get_freeze_count()  # the suite's own (conftest), which only shrinks as frozen objects are freed
    code, stdout, stderr = main_in_process(*args, "--output-dir", tmp_path / "here")
    assert code == 0, stdout + stderr
    here = json.loads((tmp_path / "gc.json").read_text())
    assert here["enabled"] and gc.isenabled() and here["frozen"] <= frozen and gc.get_freeze_count() <= frozen, here


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


def help_entries(text: str) -> list[list]:
    """--help's options, in order: [the title of their group, their flags, their help text]."""
    entries, group = [], None
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):  # a group's title
            group = line[:-1]
        elif match := re.match(r"^  (-\S.*?)(?:\s{2,}(.*))?$", line):  # an option, maybe its help's first line
            entries.append([group, re.findall(r"--[\w-]+", match.group(1)), match.group(2) or ""])
        elif entries and line.startswith("    "):  # more of its help
            entries[-1][2] = f"{entries[-1][2]} {line.strip()}".strip()
    return entries


def docs_themes() -> dict[str, list[str]]:
    """docs/options.md's themes, in order, with the flags each one's bullet names."""
    text = (REPO / "docs" / "options.md").read_text()
    bullets = re.findall(r"^- \*\*(.+?)\*\*: (.*?)(?=^- |^$)", text, flags=re.S | re.M)
    return {theme: re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", body) for theme, body in bullets}


def test_help_groups_the_options_as_the_docs_do(help_text):
    """Each theme of docs/options.md is a group of --help, in the same order, with the same options."""
    entries, themes = help_entries(help_text), docs_themes()
    assert len(themes) == 12
    assert [g for g in dict.fromkeys(g for g, _, _ in entries) if g != "options"] == list(themes)
    main_flag = {flag: flags[0] for _, flags, _ in entries for flag in flags}  # --no-plots is --plots' entry
    for theme, named in themes.items():
        assert {main_flag.get(f, f) for f in named} == {flags[0] for g, flags, _ in entries if g == theme}, theme


def test_every_option_shows_its_default_once(help_text):
    """Options whose help says what their default means do not get a second "(default: None)"."""
    shown = {flags[0]: text for _, flags, text in help_entries(help_text) if flags[0] in FLAGS}
    assert set(shown) == FLAGS
    assert not {flag: text for flag, text in shown.items() if text.count("(default:") != 1}


def test_log_with_lists_the_trackers_accelerate_knows(help_text):
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    text = next(text for _, flags, text in help_entries(help_text) if flags == ["--log-with"])
    assert [name for name in LOGGER_TYPE_TO_CLASS if name not in text] == []
    assert "(default: None, no tracker)" in text


def test_an_option_named_no_something_turns_it_on(tmp_path, help_text):
    """`--no-decay-norm-bias` asks for no decay on norms and biases, as the YAML key and fit() do; its
    opposite, to override a config file, is `--decay-norm-bias` (argparse's own would be --no-no-...)."""
    negative = [f.name for f in fields(TrainConfig) if f.name.startswith("no_") and f.type.startswith("bool")]
    assert negative
    for name in negative:
        flag = name.replace("_", "-")
        assert getattr(parse_config([f"--{flag}"]), name) is True
        (tmp_path / "run.yaml").write_text(f"{flag}: true\n")
        assert getattr(parse_config(["--config", str(tmp_path / "run.yaml")]), name) is True
        assert getattr(parse_config(["--config", str(tmp_path / "run.yaml"), f"--{flag[3:]}"]), name) is False
    assert "--no-no-" not in help_text


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
    (["--no-such-flag"], "unknown option --no-such-flag"),
    (["--epoch", "1", "--batch", "64"], "unknown option --epoch; did you mean --epochs?"),  # never abbreviated
    (["--batch-sise=64"], "unknown option --batch-sise; did you mean --batch-size?"),
    (["evalute", "{tmp}/earlier"], "unknown command 'evalute'; did you mean evaluate?"),
    (["--config", "{tmp}/missing.yaml"], "missing.yaml does not exist"),
    (["--config", "{tmp}/broken.yaml"], "is not valid YAML"),
    (["--config", "{tmp}/unknown.yaml"], "unknown option 'learning_rate'"),
    (["--config", "{tmp}/typo.yaml"], "unknown option 'batch-sise'; did you mean batch-size?"),
    (["--config", "{tmp}/wrongtype.yaml"], "option 'epochs' must be int, got 'three'"),
    (["--config", "{tmp}/twice.yaml"], "the key 'epochs' is given twice (again on line 3)"),
    (["--freeze", "("], "--freeze '(' is not a regular expression (missing ), unterminated subpattern"),
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
    (tmp_path / "typo.yaml").write_text("batch-sise: 64\n")
    (tmp_path / "wrongtype.yaml").write_text("epochs: three\n")
    (tmp_path / "twice.yaml").write_text("epochs: 1\nlr: 0.1\nepochs: 30\n")
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


# Accelerate's own variables (accelerate launch and its config files set them): Accelerate raises deep inside on a value
# it cannot read, or trains with one it does not know ("bogus" recorded as the precision).
BAD_VARIABLES = [
    ("ACCELERATE_USE_CPU", "maybe", "is not true or false"),
    ("ACCELERATE_DEBUG_MODE", "notbool", "is not true or false"),
    ("ACCELERATE_DYNAMO_BACKEND", "bogus", "is not one of no, eager"),
    ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "abc", "is not a whole number"),
    ("ACCELERATE_MIXED_PRECISION", "bogus", "is not one of no, fp8, fp16, bf16"),
]


@pytest.mark.parametrize("name,value,message", BAD_VARIABLES, ids=[n for n, _, _ in BAD_VARIABLES])
def test_a_bad_accelerate_variable_is_one_line_naming_it(tmp_path, main_in_process, monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    code, _, stderr = main_in_process("--max-steps", "2", "--output-dir", str(tmp_path / "run"))
    assert code == 2 and stderr.startswith(f"acc-trainer: error: {name}={value} (in the environment) {message}"), stderr
    assert stderr.count("\n") == 1 and not (tmp_path / "run").exists()


def test_fit_without_training_data_is_one_line():
    import torch

    import acc_trainer

    with pytest.raises(ConfigError, match="the training data of fit\\(\\) is None: give a dataset"):
        acc_trainer.fit(torch.nn.Linear(2, 2), None)


# Each command parses its own options the same way: one line, no abbreviation, the nearest known option.
COMMAND_TYPOS = [
    (["check", "--step", "4"], "unknown option --step; did you mean --steps?"),
    (["evaluate", "{tmp}/earlier", "--weight", "w.pt"], "unknown option --weight; did you mean --weights or "
                                                          "--weight-decay?"),
    (["predict", "{tmp}/earlier", "--eval-batch", "7"], "unknown option --eval-batch; did you mean --eval-batch-size?"),
    (["report", "{tmp}/earlier", "--label", "a"], "unknown option --label; did you mean --labels?"),
    # (--processes 0 would stop a bench that took --repeat for --repeats before it ran anything)
    (["bench", "--repeat", "2", "--processes", "0"], "unknown option --repeat; did you mean --repeats?"),
    (["check-data", "--num-worker", "2"], "unknown option --num-worker; did you mean --num-workers?"),
    (["check", "--max-steps", "5"], "acc-trainer check runs --steps optimizer steps per short run (default 8): give "
                                    "--steps 5, not --max-steps"),  # it was ignored without a word
]


@pytest.mark.parametrize("args,message", COMMAND_TYPOS, ids=[" ".join(a) for a, _ in COMMAND_TYPOS])
def test_commands_refuse_abbreviations_in_one_line(tmp_path, main_in_process, args, message):
    _existing_run(tmp_path)
    code, _, stderr = main_in_process(*[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and stderr == f"acc-trainer: error: {message.format(tmp=tmp_path)}\n"


@pytest.mark.parametrize("command,options", [("evaluate", ["RUN_DIR", "--weights", "--output", "--split"]),
                                             ("predict", ["RUN_DIR", "--weights", "--output", "--split"]),
                                             ("check", ["--steps"])])
def test_commands_have_their_own_help(main_in_process, command, options):
    code, stdout, stderr = main_in_process(command, "--help")
    assert code == 0 and stderr == "" and stdout.startswith(f"usage: acc-trainer {command} ")
    assert all(option in stdout for option in options)
    assert "every option of acc-trainer --help" in stdout  # and where the training options are described


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
