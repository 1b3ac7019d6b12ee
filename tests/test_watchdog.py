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
    while time.monotonic() < deadline and not (beat.exists() and json.loads(beat.read_text() or "{}").get("step", 0) >= 12):
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
