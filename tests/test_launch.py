"""Several processes, started the ways the README says, and the shipped accelerate config files."""

from __future__ import annotations

import re
import subprocess

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import BIN, CONFIGS, _env, check, forked_cli, free_port, launch, metrics, run_here, summary
from safetensors.torch import load_file

EXPECTED_CONFIGS = {
    "cpu.yaml": ("NO", 1, 1),
    "cpu_ddp.yaml": ("MULTI_GPU", 2, 1),
    "single_gpu.yaml": ("NO", 1, 1),
    "multi_gpu.yaml": ("MULTI_GPU", 2, 1),
    "multi_gpu_bf16.yaml": ("MULTI_GPU", 2, 1),
    "multi_gpu_fp16.yaml": ("MULTI_GPU", 2, 1),
    "multi_node.yaml": ("MULTI_GPU", 4, 2),
    "fsdp.yaml": ("FSDP", 2, 1),
    "deepspeed.yaml": ("DEEPSPEED", 2, 1),
}


def test_every_shipped_config_loads_with_accelerates_loader():
    assert {p.name for p in CONFIGS.glob("*.yaml")} == set(EXPECTED_CONFIGS)
    assert load_config_from_file(str(CONFIGS / "fsdp.yaml")).fsdp_config["fsdp_version"] == 2
    assert load_config_from_file(str(CONFIGS / "deepspeed.yaml")).deepspeed_config["zero_stage"] == 2
    for name, (kind, processes, machines) in EXPECTED_CONFIGS.items():
        config = load_config_from_file(str(CONFIGS / name))
        assert (config.distributed_type.value, config.num_processes, config.num_machines) == (kind, processes, machines)
    assert load_config_from_file(str(CONFIGS / "multi_gpu_bf16.yaml")).mixed_precision == "bf16"
    assert load_config_from_file(str(CONFIGS / "multi_gpu_fp16.yaml")).mixed_precision == "fp16"
    assert load_config_from_file(str(CONFIGS / "cpu.yaml")).use_cpu is True


JOB = ["--model", "mlp", "--max-steps", "12", "--batch-size", "64", "--eval-size", "301", "--log-every", "4", "--no-plots"]


@pytest.mark.parametrize("launcher_args,world", [
    (["--config_file", CONFIGS / "cpu_ddp.yaml"], 2),
    (["--multi_gpu", "--num_processes", "2"], 2),
    (["--config_file", CONFIGS / "cpu.yaml"], 1),
], ids=["cpu_ddp.yaml", "--multi_gpu --num_processes 2", "cpu.yaml"])
def test_launched_runs_form_the_expected_group(tmp_path, launcher_args, world):
    # The README's command through `accelerate launch` itself; the config files through Accelerate's same launch
    # command, run by `acc-trainer launch` (which starts sooner: tests/conftest.py's launch).
    result = check(launch(*JOB, "--output-dir", tmp_path / "run", launcher_args=launcher_args,
                          plain="--multi_gpu" in launcher_args))
    s = summary(tmp_path / "run")
    assert s["world_size"] == world
    assert s["distributed_type"] == ("MULTI_CPU" if world == 2 else "NO")
    assert s["per_process_batch_size"] == 64 // world
    assert s["eval_samples"] == 301 and s["steps"] == 12
    assert s["ranks_agree"] is (True if world == 2 else None)
    assert s["eval"]["accuracy"] > 0.3  # it trains: 12 steps already beat chance (0.1)
    assert all(len(r["loss_per_rank"]) == world for r in metrics(tmp_path / "run") if "loss" in r)
    # Only the main process prints: one header line, not one per process.
    assert result.stdout.count("acc_trainer mlp on synthetic") == 1


def test_bad_input_on_two_processes_is_one_line_and_exit_2(tmp_path):
    """`acc-trainer launch`: torch's launcher would exit 1 with a traceback, and every process would print the line."""
    def launched(*args):
        return subprocess.run([str(BIN / "acc-trainer"), "launch", "--config_file", str(CONFIGS / "cpu_ddp.yaml"),
                               "--main_process_port", str(free_port()), "-m", "acc_trainer", *args, "--output-dir",
                               str(tmp_path / "run")], capture_output=True, text=True, env=_env(), timeout=300)

    # Met by both once the group has formed: the first to meet it says it (the launcher may end the other first).
    found_in_the_group = launched("--batch-size", "63")
    assert found_in_the_group.returncode == 2
    (line,) = found_in_the_group.stderr.splitlines()
    assert re.fullmatch(r"acc-trainer: error \(rank [01]\): --batch-size 63 does not split into 2 processes x 1 "
                        r"accumulation micro-batches; use a multiple of 2", line), line
    found_by_both = launched("--epochs", "-1")  # both processes meet it at once, before any group
    assert found_by_both.returncode == 2
    assert found_by_both.stderr.splitlines() == ["acc-trainer: error (rank 0): --epochs must be positive, got -1"]
    assert not (tmp_path / "run").exists()


def test_a_failed_run_ends_with_its_processes_exit_code_and_at_most_one_line(tmp_path, monkeypatch, capsys):
    """What `acc-trainer launch` makes of torch's report of failed processes (ChildFailedError; the processes'
    bad-input lines handed over as in a run): the first failure decides, except that bad input on any process
    is bad input (the launcher may end the others first); a line only another machine met is shown."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from acc_trainer.distributed.launching import _failed, tell_launcher

    def failure(rank, exitcode, told=None):
        path = tmp_path / f"{rank}-{exitcode}.json"
        if told:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
            assert tell_launcher(told)
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))

    bad = "acc-trainer: error (rank {}): --batch-size 63 does not split"
    cases = [  # failures in the order torch saw them, then the exit code and stderr expected
        ({0: failure(0, 2, bad.format(0)), 1: failure(1, -15, bad.format(1))}, 2, ""),
        ({1: failure(1, 2, bad.format(1)), 0: failure(0, 1)}, 2, bad.format(1) + "\n"),  # rank 1's data alone
        ({1: failure(1, 1), 0: failure(0, -15)}, 1, "acc-trainer: process 1 failed with exit code 1 (its own output "
                                                    "above says why)\n"),
        ({1: failure(1, -9), 0: failure(0, 1)}, 137, "acc-trainer: process 1 was ended by SIGKILL\n"),
        ({0: failure(0, 143), 1: failure(1, 143)}, 143, ""),  # stopped by SIGTERM: the main process said so
    ]
    for failures, code, stderr in cases:
        assert _failed(ChildFailedError("acc_trainer", failures)) == code
        assert capsys.readouterr().err == stderr


ORPHAN_JOB = ["--model", "orphan_probe:Slow", "--dataset", "orphan_probe:halves", "--loss", "cross_entropy",
              "--batch-size", "16", "--max-steps", "60", "--log-every", "10", "--optimizer", "sgd", "--no-plots"]


def orphan_launcher(plain: bool = False) -> list[str]:
    return [str(BIN / "accelerate") if plain else str(BIN / "acc-trainer"), "launch", "--main_process_port",
            str(free_port()), "--multi_gpu", "--num_processes", "2", "-m", "acc_trainer"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """ORPHAN_JOB run to its end on 2 processes (forked from this one: the launches are the interrupted runs')."""
    out = tmp_path_factory.mktemp("uninterrupted")
    forked_cli(*ORPHAN_JOB, "--output-dir", out / "run", processes=2, cwd=out)
    return load_file(out / "run" / "model.safetensors")


@pytest.mark.parametrize("plain", [False, True], ids=["acc-trainer launch", "accelerate launch"])
def test_workers_whose_launcher_is_killed_stop_with_a_checkpoint_and_resume_bit_identical(tmp_path, plain, uninterrupted):
    """torch's launcher starts its workers in sessions of their own: a launcher killed with SIGKILL passes no signal
    on. Each worker sees its launcher gone and stops as on SIGTERM (a checkpoint, exit 143) within seconds, instead of
    training on to the end, orphaned; `--resume auto` then ends with the uninterrupted run's weights, bit for bit
    (resumed once: the resume does not depend on the launcher that was killed)."""
    import json
    import sys

    from conftest import REPO

    tests, run = str(REPO / "tests"), tmp_path / "run"
    env = _env(PYTHONPATH=tests)
    killed = subprocess.run([sys.executable, f"{tests}/orphan_probe.py", str(run), *orphan_launcher(plain), *ORPHAN_JOB,
                             "--output-dir", str(run)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert killed.returncode == 0, killed.stderr[-3000:]
    workers = json.loads(killed.stdout.strip().splitlines()[-1])
    assert [w["code"] for w in workers.values()] == [143, 143], killed.stderr[-3000:]
    assert max(w["seconds"] for w in workers.values()) < 10
    assert killed.stderr.count("the launcher (process") == 2 and "stopped by SIGTERM at step" in killed.stderr
    stopped = max(json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{stopped:08d}"] and stopped < 60
    if plain:
        return
    check(subprocess.run([*orphan_launcher(), *ORPHAN_JOB, "--output-dir", str(run), "--resume", "auto"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path))
    resumed = load_file(run / "model.safetensors")
    assert set(resumed) == set(uninterrupted) and all(resumed[k].equal(uninterrupted[k]) for k in resumed)
    assert summary(run)["steps"] == 60


def test_linear_regression_learns_two_and_three(tmp_path):
    """y = 2x + 3 + noise, 10,000 samples, batch 32, SGD lr 0.01, 10 epochs (one process: run in this one)."""
    check(run_here("--model", "linreg", "--dataset", "linear", "--train-size", "10000", "--eval-size", "1000",
                           "--batch-size", "32", "--optimizer", "sgd", "--momentum", "0", "--lr", "0.01",
                           "--epochs", "10", "--log-every", "100", "--output-dir", tmp_path / "run"))
    learned = load_file(tmp_path / "run" / "model.safetensors")  # the weights file, as a user reads it
    assert abs(learned["linear.weight"].item() - 2) < 0.05 and abs(learned["linear.bias"].item() - 3) < 0.05
    assert summary(tmp_path / "run")["eval"]["loss"] < 0.02  # the noise variance is 0.01
    assert "accuracy" not in summary(tmp_path / "run")["eval"]
