"""The README's commands run as written, and every relative link of README.md and docs/*.md resolves.

Runs the ```bash block directly under "## Install and run" (its `pip install` line aside: this is the
installed environment) and every block marked `<!-- test: runs -->` on the line before its fence, each
command in a fresh working directory, as a user would type it."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, _env, metrics, summary
from safetensors.torch import load_file

README = REPO / "README.md"
MARKER = "<!-- test: runs -->"


def bash_block(lines: list[str], fence: int) -> list[str]:
    """The commands of the fenced block opening at `fence` (one per line; comments and blanks left out)."""
    assert lines[fence].strip() == "```bash", f"README.md:{fence + 1} is not a ```bash fence"
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].strip() == "```")
    return [line.strip() for line in lines[fence + 1:end] if line.strip() and not line.strip().startswith("#")]


def readme_commands() -> list[str]:
    lines = README.read_text().splitlines()
    start = lines.index("## Install and run")
    fence = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    commands = bash_block(lines, fence)
    commands += [c for i, line in enumerate(lines) if line.strip() == MARKER for c in bash_block(lines, i + 1)]
    return [c for c in commands if not c.startswith("pip install")]


COMMANDS = readme_commands()


def as_argv(command: str) -> tuple[str | None, list[str]]:
    """(folder to cd into, argv) for `[cd DIR &&] python -m acc_trainer ...` or `[cd DIR &&] acc-trainer ...`."""
    folder, _, rest = command.rpartition("&&")
    folder = folder.strip()
    if folder:
        cd, _, folder = folder.partition(" ")
        assert cd == "cd", f"only `cd DIR && ...` is understood before the command: {command}"
    words = shlex.split(rest)
    if words[:3] == ["python", "-m", "acc_trainer"]:
        words = words[3:]
    elif words[:1] == ["acc-trainer"]:
        words = words[1:]
    else:
        raise AssertionError(f"not an acc_trainer command: {command}")
    return folder.strip() or None, [sys.executable, "-m", "acc_trainer", *words]


def test_the_readme_has_its_quick_start():
    assert "python -m acc_trainer" in COMMANDS, COMMANDS
    assert 1 <= len(COMMANDS) <= 3, COMMANDS  # cheap: at most three short runs
    assert "```bash\npytest\n```" in README.read_text()  # the test command .ci/run runs


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs(command, tmp_path):
    folder, argv = as_argv(command)
    cwd = tmp_path
    if folder:  # a folder of this repository (examples/): a copy of it, so the run folder lands in tmp_path
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("runs", "__pycache__"))
        cwd = tmp_path / folder
    result = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=_env(), timeout=600)
    assert result.returncode == 0, f"{command}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    runs = [p.parent for p in (cwd / "runs").glob("*/summary.json")]
    assert len(runs) == 1, f"{command}: expected one run folder with summary.json under runs/, found {runs}"
    s = summary(runs[0])
    assert "eval" in s and s["eval_samples"] > 0
    if argv[3:] == []:  # the default job: "reaches 95 % accuracy (chance is 10 %)"
        assert s["eval"]["accuracy"] >= 0.9, s["eval"]
        default_job_learns_and_leaves_its_files(runs[0], result.stdout, cwd)


def default_job_learns_and_leaves_its_files(run_dir: Path, out: str, cwd: Path) -> None:
    """The checks of the default job (`python -m acc_trainer` with no options, its only run in the suite;
    test_the_readme_has_its_quick_start makes sure the README keeps it)."""
    from acc_trainer.config import TrainConfig
    from acc_trainer.flags import parse_config

    assert run_dir.parent == cwd / "runs"  # default output dir: a new folder under runs/
    assert list((cwd / "runs").iterdir()) == [run_dir]
    s = summary(run_dir)
    assert s["eval"]["accuracy"] > 0.8  # 10 classes: chance is 0.1
    assert f"accuracy {s['eval']['accuracy']:.2%}" in out
    assert s["eval_samples"] == TrainConfig().eval_size
    assert s["world_size"] == 1 and s["distributed_type"] == "NO" and s["mixed_precision"] == "no"
    assert s["ranks_agree"] is None and s["ranks_check"] == "not checked: one process"
    assert {"torch", "accelerate", "torchvision", "python"} <= set(s["versions"])
    assert s["wall_time_s"] > 0 and s["samples_per_s"] > 0

    records = metrics(run_dir)
    train_records = [r for r in records if "loss" in r]
    eval_records = [r for r in records if "eval_accuracy" in r]
    assert {"step", "epoch", "loss", "lr", "samples_per_s"} <= set(train_records[0])
    assert [r["epoch"] for r in eval_records] == [1, 2, 3]
    assert train_records[-1]["loss"] < train_records[0]["loss"] / 2

    # The resolved configuration reads back as a config file and reproduces the defaults.
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert "batch-size" in resolved and "batch_size" not in resolved  # named as the flags and the docs name them
    assert parse_config(["--config", str(run_dir / "config.yaml")]).to_dict() == \
        {name.replace("-", "_"): value for name, value in resolved.items()}

    # Final weights: saved once, and they load into a freshly built model of the same name.
    from acc_trainer.workload.components import build_data, build_model

    model = build_model(TrainConfig(), build_data(TrainConfig()))
    weights = load_file(run_dir / "model.safetensors")
    assert set(weights) == set(model.state_dict())
    model.load_state_dict(weights)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (no links live there)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_resolves():
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    broken, seen = [], 0
    for page in pages:
        for target in LINK.findall(prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            seen += 1
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert seen > 20, f"only {seen} links found: is the pattern still right?"
    assert not broken, "\n".join(broken)
