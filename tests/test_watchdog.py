"""A hung process is found and named within the watchdog's bound, not at --dist-timeout (30 minutes by
default); a slow step that still progresses is no alarm."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

from conftest import BIN, _env, free_port

# Rank 1's data slows down to 0.6 s per step for a while (below the bound: no alarm, the others wait for it
# in the step's collectives), then hangs for good at the 40th batch it reads.
SLOW_DATA = '''
import os
import time

import torch

READ = [0]


class Numbers(torch.utils.data.Dataset):
    classes = ["even", "odd"]

    def __len__(self):
        return 4096

    def __getitem__(self, i):
        if os.environ.get("RANK") == "1":
            READ[0] += 1
            if 96 <= READ[0] < 192:  # 6 steps of 16 samples, 0.6 s each
                time.sleep(0.6 / 16)
            if READ[0] == 40 * 16:
                time.sleep(3600)
        return torch.full((3, 4, 4), float(i % 5)), i % 2


def load():
    return Numbers(), None
'''

JOB = ["--model", "mlp", "--batch-size", "32", "--epochs", "1", "--log-every", "5", "--checkpoint-every", "10",
       "--progress", "none", "--no-plots", "--optimizer", "sgd", "--num-workers", "0"]


def launch(*args, cwd):
    command = [str(BIN / "acc-trainer"), "launch", "--main_process_port", str(free_port()), "--multi_gpu",
               "--num_processes", "2", "-m", "acc_trainer", *map(str, args)]
    return subprocess.Popen(command, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_process_whose_data_hangs_is_named_with_its_stacks(tmp_path):
    (tmp_path / "counting.py").write_text(SLOW_DATA)
    out = tmp_path / "run"
    started = time.monotonic()
    run = launch(*JOB, "--dataset", "counting:load", "--hang-timeout", "2", "--output-dir", out, cwd=tmp_path)
    _, stderr = run.communicate(timeout=300)
    took = time.monotonic() - started
    assert run.returncode != 0
    said = [line for line in stderr.splitlines() if line.startswith("acc-trainer: process 1 is stuck")]
    assert len(said) == 1, stderr[-3000:]
    found = re.fullmatch(r"acc-trainer: process 1 is stuck \(data at step (\d+) for \d+ s\), while the others wait: no "
                         r"progress for \d+ s \(the bound, --hang-timeout: 2 s\); stopped every process; continue "
                         r"from (.+) with --resume auto --output-dir (.+)", said[0])
    assert found, said[0]
    step = int(found[1])  # the hang is in rank 1's 40th batch, after the slow ones (no alarm for those)
    assert 35 <= step <= 40 and found[2] == str(out / "checkpoints" / f"step-{step // 10 * 10:08d}")
    # The stuck process printed where it is: its dataset's sleep, through the loader.
    assert "acc-trainer: process 1 made no progress for" in stderr
    assert re.search(r'counting\.py", line \d+ in __getitem__', stderr), stderr[-3000:]
    assert took < 120  # not --dist-timeout's 1,800 s
    print(f"hung data loading named and every process ended {took:.1f} s after the launch")


def test_a_stopped_process_is_named_within_the_bound(tmp_path):
    """SIGSTOP to process 1 mid-run (as a machine swapping, or a debugger): its heartbeat stops; process 0 names
    it, ends it and itself, and the launcher returns within seconds of the bound."""
    steady = SLOW_DATA.replace('if os.environ.get("RANK") == "1":', "time.sleep(0.002)\n        if False:")
    (tmp_path / "counting.py").write_text(steady)  # 2 ms a sample on both processes, no hang
    out = tmp_path / "run"
    run = launch(*JOB, "--dataset", "counting:load", "--hang-timeout", "3", "--output-dir", out, cwd=tmp_path)
    beat = out / ".heartbeats" / "1"
    deadline = time.monotonic() + 120
    # Stopped in a step (a checkpoint write has a bound ten times as long): its heartbeat, written at once when a
    # write begins, would otherwise hand the test exactly that moment.
    while time.monotonic() < deadline and not (beat.exists() and _at_a_step(beat, 12)):
        time.sleep(0.2)
    os.kill(json.loads(beat.read_text())["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    _, stderr = run.communicate(timeout=300)
    took = time.monotonic() - stopped
    assert run.returncode != 0
    said = [line for line in stderr.splitlines() if line.startswith("acc-trainer: process 1 stopped responding")]
    assert len(said) == 1 and "stopped every process; continue from" in said[0], stderr[-3000:]
    print(f"stopped process named and every process ended {took:.1f} s after SIGSTOP (bound 3 s)")
    assert took < 30


def _at_a_step(beat, step: int) -> bool:
    try:
        seen = json.loads(beat.read_text() or "{}")
    except ValueError:  # caught mid-replace
        return False
    return seen.get("step", 0) >= step and seen.get("what") in ("data", "compute")


# Process 1 stops (SIGSTOP) while the final weights are saved: the first state_dict() of a run without checkpoints.
STOPS_AT_SAVE = '''
import os
import signal

import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3 * 32 * 32, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))

    def state_dict(self, *args, **kwargs):
        if os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().state_dict(*args, **kwargs)
'''


def test_a_process_stopped_while_the_final_weights_are_saved_is_named(tmp_path):
    """The final save and the collectives after the last step are watched as the steps are: a process stopped there is
    named (what it was doing: the final weights) within the bound for writes (10 x --hang-timeout), every process ends,
    and no half-written weights are left (the default --dist-timeout would have held them for 30 minutes)."""
    (tmp_path / "stops.py").write_text(STOPS_AT_SAVE)
    out = tmp_path / "run"
    started = time.monotonic()
    run = launch("--model", "stops:Net", "--dataset", "synthetic", "--train-size", "256", "--eval-size", "64",
                 "--batch-size", "64", "--epochs", "1", "--progress", "none", "--no-plots", "--hang-timeout", "1",
                 "--output-dir", out, cwd=tmp_path)
    _, stderr = run.communicate(timeout=300)
    took = time.monotonic() - started
    said = [line for line in stderr.splitlines() if line.startswith("acc-trainer: process 1 stopped responding")]
    assert run.returncode != 0 and len(said) == 1, stderr[-3000:]
    assert "it was final weights at step 4" in said[0] and "(the bound, --hang-timeout: 10 s)" in said[0], said[0]
    assert not (out / "model.safetensors").exists() and not (out / "summary.json").exists()
    print(f"process stopped in the final save named and every process ended in {took:.1f} s (bound 10 s)")
    assert took < 90


def test_the_median_step_time_is_the_whole_step(monkeypatch, tmp_path):
    """With --grad-accum 4 a step is four micro-batches: the default bound (20 median steps) is measured on the whole
    step, not on its last micro-batch's compute (a bound 6x tighter than documented)."""
    from acc_trainer.distributed import watchdog

    clock = [0.0]
    monkeypatch.setattr(watchdog, "time", type("Clock", (), {"monotonic": lambda: clock[0], "time": time.time}))
    watch = watchdog.Watchdog(tmp_path, 0, 1, None, lambda: "")  # never entered: no thread, the clock is the test's
    for step in range(1, 8):
        for _ in range(4):
            watch.at("data")
            clock[0] += 1.0  # the micro-batch's data
            watch.at("compute")
            clock[0] += 2.0  # its forward and backward
        watch.at("compute", step)
    assert watch.bound() == 20 * 12.0  # 4 micro-batches of 3 s; the last one's compute alone gave 60 s, the floor
