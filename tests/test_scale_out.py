"""Beyond one machine: two machines simulated on this one, FSDP and DeepSpeed configs (the SLURM script:
test_slurm.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import BIN, CONFIGS, _env, check, forked_cli, free_port, launch, run_here, summary
from safetensors.torch import load_file

JOB = ["--model", "mlp", "--train-size", "1024", "--eval-size", "256", "--batch-size", "64", "--epochs", "2",
       "--max-steps", "24", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"]
# Added to the single-process runs, which nothing here draws figures of; the launches of several processes keep
# them (a process ends only after the main one has drawn its figures, as in a user's run).
NO_PLOTS = ["--no-plots"]


def test_two_machines_train_like_one_process(tmp_path):
    """`acc-trainer launch --num_machines 2 --machine_rank 0|1` (Accelerate's launch command) on 127.0.0.1, one CPU
    process each."""
    port = free_port()
    machines = [subprocess.Popen(
        [str(BIN / "acc-trainer"), "launch", "--multi_gpu", "--num_machines", "2", "--num_processes", "2",
         "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
         "-m", "acc_trainer", *JOB, *NO_PLOTS, "--output-dir", str(tmp_path / "two")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) for rank in (0, 1)]
    for machine in machines:
        _, stderr = machine.communicate(timeout=300)
        assert machine.returncode == 0, stderr[-3000:]
    check(run_here(*JOB, *NO_PLOTS, "--output-dir", tmp_path / "one"))  # one process: this one, on one thread
    s = summary(tmp_path / "two")
    assert (s["world_size"], s["distributed_type"], s["ranks_agree"]) == (2, "MULTI_CPU", True)
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert max((one[k] - two[k]).abs().max().item() for k in one) <= 1e-5


# Gradient accumulation, clipping, AdamW with warmup and cosine: what the sharded engines must reproduce.
SHARDED_JOB = ["--model", "mlp", "--train-size", "1024", "--eval-size", "256", "--batch-size", "64", "--epochs", "2",
               "--max-steps", "24", "--optimizer", "adamw", "--lr", "0.003", "--warmup-steps", "4", "--scheduler",
               "cosine", "--grad-accum", "2", "--max-grad-norm", "0.5"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """SHARDED_JOB on one plain process (this one, on one thread): the reference for FSDP and DeepSpeed."""
    out = tmp_path_factory.mktemp("plain") / "run"
    check(run_here(*SHARDED_JOB, *NO_PLOTS, "--output-dir", out))
    return out


def check_sharded_engine(tmp_path, plain_run, engine: str, config: Path, shards: str) -> None:
    """Trains SHARDED_JOB under an engine's CONFIG, checkpointing at step 10, then resumes from that checkpoint."""
    check(launch(*SHARDED_JOB, *NO_PLOTS, "--output-dir", tmp_path / "run", "--checkpoint-every", "10",
                 launcher_args=["--config_file", config]))
    s, plain = summary(tmp_path / "run"), summary(plain_run)
    assert s["distributed_type"] == engine
    for a, b in zip(s["evals"], plain["evals"], strict=True):
        assert a["accuracy"] == b["accuracy"] and abs(a["loss"] - b["loss"]) < 1e-5

    # The checkpoint holds the engine's own files; the final weights are whole and load into a plain
    # model, equal to the plain run's.
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000010"
    assert (checkpoint / shards).exists()
    from acc_trainer.data.datasets import Data
    from acc_trainer.workload.models import mlp

    final, reference = load_file(tmp_path / "run" / "model.safetensors"), load_file(plain_run / "model.safetensors")
    mlp(Data(None, None, "classification", 10, (3, 32, 32))).load_state_dict(final)  # strict
    assert max((final[k] - reference[k]).abs().max().item() for k in reference) <= 1e-5

    # Resumed from the step-10 checkpoint, the run ends with exactly the same weights (on processes forked from this
    # one, with the variables the launch's config gave).
    forked_cli(*SHARDED_JOB, *NO_PLOTS, "--output-dir", tmp_path / "resumed", "--resume", checkpoint,
               config=config)
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    assert summary(tmp_path / "resumed")["evals"] == s["evals"]

    # The checkpoint continues under DDP too (tests/test_engines.py), on another number of processes.
    from acc_trainer.flags import parse_config
    from acc_trainer.outputs.checkpoints import read_state

    cfg = parse_config([*SHARDED_JOB, "--output-dir", str(tmp_path / "ddp"), "--checkpoint-every", "10"])
    assert read_state(checkpoint, cfg, 1, "DDP")["step"] == 10


def test_fsdp_on_two_cpu_processes(tmp_path, plain_run):
    """fsdp.yaml (FSDP2) on 2 gloo processes; the checkpoint is sharded, one file per process."""
    check_sharded_engine(tmp_path, plain_run, "FSDP", CONFIGS / "fsdp.yaml", "pytorch_model_fsdp_0")
    shards = tmp_path / "run" / "checkpoints" / "step-00000010" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    s = summary(tmp_path / "run")  # each weight is held once: the report says so, never a claimed agreement
    assert s["ranks_agree"] is None and s["ranks_check"].startswith("not checked: FSDP keeps each weight once")

    # The config on one CPU process, to continue the checkpoint there: one line saying what to run instead, nothing
    # written; that command (one plain process) continues the checkpoint to the 2-process run's weights.
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000010"
    alone = launch(*SHARDED_JOB, *NO_PLOTS, "--output-dir", tmp_path / "one", "--resume", checkpoint,
                   launcher_args=["--config_file", CONFIGS / "fsdp.yaml", "--num_processes", "1"])
    assert alone.returncode == 2, alone.stderr[-3000:]
    assert alone.stderr.strip().splitlines()[-1] == (
        "acc-trainer: error: the accelerate config selects FSDP for one CPU process, which has nothing to shard: run the "
        "same acc-trainer command without the launcher (one plain process; it continues an FSDP2 checkpoint too), or "
        "launch 2 or more processes")
    assert not (tmp_path / "one").exists()
    check(run_here(*SHARDED_JOB, *NO_PLOTS, "--output-dir", tmp_path / "one", "--resume", checkpoint))
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "run" / "model.safetensors")
    assert max((one[k] - two[k]).abs().max().item() for k in two) <= 1e-5


def test_deepspeed_input_errors(tmp_path, main_in_process, monkeypatch):
    """Each DeepSpeed setup Accelerate would break or quietly replace is one line, before anything is written."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    out = tmp_path / "run"
    expected = {
        "WORLD_SIZE": ("2", "without a GPU, DeepSpeed runs as one process only (Accelerate 1.15 would make every CPU "
                            "process a world of its own): launch it with --num_processes 1, or use "
                            "accelerate_configs/fsdp.yaml or cpu_ddp.yaml for several CPU processes"),
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": ("auto", "the accelerate config sets gradient_accumulation_steps "
                                                   "auto; acc_trainer passes --grad-accum (1) to DeepSpeed: remove it "
                                                   "from the config's deepspeed_config"),
    }
    for variable, (value, message) in expected.items():
        with monkeypatch.context() as m:
            m.setenv(variable, value)
            assert main_in_process(*JOB, "--output-dir", out) == (2, "", f"acc-trainer: error: {message}\n")
    assert main_in_process(*JOB, "--cpu", "--output-dir", out)[2] == (
        "acc-trainer: error: --cpu does not combine with DeepSpeed (Accelerate leaves DeepSpeed out for cpu=True); "
        "on CPUs use accelerate_configs/fsdp.yaml or cpu_ddp.yaml\n")
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else object())
    assert main_in_process(*JOB, "--output-dir", out)[2] == (
        'acc-trainer: error: the accelerate config selects DeepSpeed, which needs transformers: '
        'pip install -e ".[deepspeed]"\n')
    assert not out.exists()
