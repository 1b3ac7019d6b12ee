"""torchrun restarts a run whose process died: the same command line continues it (--resume auto) and the run
ends as the uninterrupted one does (docs/checkpoints.md#restarts-with-torchrun)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch
from conftest import BIN, _env, check, forked_cli, free_port, launch, metrics, summary
from safetensors.torch import load_file

# 64 steps over 2 epochs, a checkpoint every 8: a worker is killed after the first one, and the restarted
# attempt crosses the epoch boundary (a new shuffle) before it ends.
STEPS = 64
JOB = ["--model", "mlp", "--train-size", "2048", "--eval-size", "256", "--batch-size", "64", "--epochs", "2",
       "--checkpoint-every", "8", "--keep-last", "2", "--resume", "auto", "--no-plots", "--progress", "plain",
       "--log-every", "8", "--dist-timeout", "120"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """JOB run to its end on 2 processes forked from this one (the launches are those restarted)."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    forked_cli(*JOB, "--output-dir", run, processes=2)
    return run


def test_a_killed_worker_is_restarted_by_torchrun_and_the_run_ends_as_if_uninterrupted(tmp_path, uninterrupted):
    """torchrun's c10d rendezvous on an endpoint, as on a cluster, with the setting that gives each attempt its own
    store; a worker is SIGKILLed after the first checkpoint."""
    run = tmp_path / "run"
    torchrun = subprocess.Popen(
        [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "acc_trainer", *JOB, "--output-dir", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    try:
        deadline = time.time() + 120
        while not (run / "checkpoints" / "step-00000008").exists():
            assert time.time() < deadline and torchrun.poll() is None, "the first attempt never wrote a checkpoint"
            time.sleep(0.05)
        while "1" not in workers(torchrun):  # read from /proc, where a process can end or not be listed yet
            assert time.time() < deadline, "torchrun's process 1 was not found"
            time.sleep(0.05)
        os.kill(workers(torchrun)["1"], signal.SIGKILL)
        stdout, stderr = torchrun.communicate(timeout=300)
    finally:
        if torchrun.poll() is None:  # its workers run in sessions of their own
            for pid in workers(torchrun).values():
                os.kill(pid, signal.SIGKILL)
            os.killpg(torchrun.pid, signal.SIGKILL)
    assert torchrun.returncode == 0, stderr[-5000:]
    assert "exitcode: -9" in stderr  # the worker was killed while the run went on
    assert stdout.count("--resume auto: no checkpoint") == 1  # the first attempt
    resumed = [line for line in stdout.splitlines() if "resuming at step" in line]
    assert len(resumed) == 1 and int(resumed[0].split("resuming at step ")[1].split()[0]) < STEPS, stdout
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in stderr  # no warning: each attempt has its own store
    final, reference = load_file(run / "model.safetensors"), load_file(uninterrupted / "model.safetensors")
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)
    s, r = summary(run), summary(uninterrupted)
    assert (s["eval"], s["evals"], s["steps"], s["world_size"]) == (r["eval"], r["evals"], r["steps"], r["world_size"])
    assert losses(run) == losses(uninterrupted)  # the killed attempt's records after the checkpoint are replaced


def losses(run) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in metrics(run) if "loss" in m]


def workers(torchrun: subprocess.Popen) -> dict[str, int]:
    """torchrun's worker processes: their RANK -> their pid."""
    found = {}
    for pid in subprocess.run(["pgrep", "-P", str(torchrun.pid)], capture_output=True, text=True).stdout.split():
        try:
            environ = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        except OSError:  # ended meanwhile
            continue
        found[environ.get("RANK")] = int(pid)
    return found


def test_a_launcher_that_shares_one_store_between_attempts_is_named(monkeypatch, capsys):
    """torch elastic's shared store (its c10d rendezvous unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, its static one
    always) keeps a dead attempt's addresses, which a restarted one can read: said at start."""
    from acc_trainer.distributed.processes import warn_if_restarts_share_a_store

    main = types.SimpleNamespace(is_main_process=True)
    for restarts, shared, warned in [("1", "True", True), ("1", "False", False), ("0", "True", False), (None, None, False)]:
        for name, value in (("TORCHELASTIC_MAX_RESTARTS", restarts), ("TORCHELASTIC_USE_AGENT_STORE", shared)):
            monkeypatch.delenv(name, raising=False) if value is None else monkeypatch.setenv(name, value)
        warn_if_restarts_share_a_store(main)
        assert ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().err) is warned


# A model whose process 1 kills itself (SIGKILL) at a different moment in each of three attempts, when KILLS is set:
# during a step (attempt 0), while a checkpoint is written (attempt 1: save_state asks every process for the model's
# state; setup asks once before the first step), during an evaluation (attempt 2).
KILLED_THREE_TIMES = '''
import os
import signal

import torch

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
KILLS = os.environ.get("KILLS") == "1" and os.environ.get("RANK") == "1"


def die():
    os.kill(os.getpid(), signal.SIGKILL)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(3 * 32 * 32, 32), torch.nn.Linear(32, 10)
        self.trained, self.evaluated = 0, 0

    def forward(self, x):
        self.trained += self.training
        self.evaluated += not self.training
        if KILLS and (ATTEMPT == 0 and self.trained == 12 or ATTEMPT == 2 and self.evaluated == 2):
            die()  # a step (the first-sample check makes 1 call of each kind)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    def state_dict(self, *args, **kwargs):
        if KILLS and ATTEMPT == 1 and self.trained > 1:
            die()  # the attempt's first checkpoint write
        return super().state_dict(*args, **kwargs)
'''


def test_acc_trainer_launch_restarts_without_a_variable_and_ends_bit_identical(tmp_path):
    """`acc-trainer launch --max_restarts 3`, no variable set by the user: a worker killed during a step, then during a
    checkpoint write, then during an evaluation; each restarted group forms, continues from its last checkpoint
    (--resume auto), and the run ends with the uninterrupted run's weights, bit for bit."""
    (tmp_path / "killed.py").write_text(KILLED_THREE_TIMES)
    job = ["--model", "killed:Net", "--dataset", "synthetic", "--train-size", "1024", "--eval-size", "128",
           "--batch-size", "64", "--epochs", "2", "--checkpoint-every", "4", "--resume", "auto", "--no-plots",
           "--progress", "plain", "--log-every", "4", "--dist-timeout", "120"]
    reference, run = tmp_path / "reference", tmp_path / "run"
    forked_cli(*job, "--output-dir", reference, processes=2, cwd=tmp_path)  # uninterrupted, on forked processes
    restarted = launch(*job, "--output-dir", run, cwd=tmp_path, env={"KILLS": "1"},
                       launcher_args=["--multi_gpu", "--num_processes", "2", "--max_restarts", "3"])
    check(restarted)
    resumed = [int(line.split("resuming at step ")[1].split()[0]) for line in restarted.stdout.splitlines()
               if "resuming at step" in line]
    # Three restarts: after the kill in step 12 (from 8), at the write of 12 (from 8 again), at evaluation 16 (from 12).
    assert resumed == [8, 8, 12], restarted.stdout
    final, expected = load_file(run / "model.safetensors"), load_file(reference / "model.safetensors")
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
    assert losses(run) == losses(reference) and summary(run)["evals"] == summary(reference)["evals"]
