"""A launcher killed outright (SIGKILL) in the middle of a run, and what became of its processes.

    python tests/orphan_probe.py RUN_DIR LAUNCHER ARGS...

Starts LAUNCHER ARGS as a child of this process, which is made the subreaper of its descendants (Linux's
PR_SET_CHILD_SUBREAPER): torch's launcher starts each worker in a session of its own, and once the launcher is killed
they become this process's children, whose exit codes it can read. The launcher is killed as soon as RUN_DIR's
metrics.jsonl holds a training loss; prints one JSON line: each worker's exit code and seconds after the kill.
Also the slow model of the run: `orphan_probe:Slow`, `orphan_probe:halves`.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn


class Slow(nn.Module):
    """A linear model whose every forward pass takes 50 ms: a run long enough to kill its launcher in the middle."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        time.sleep(0.05)
        return self.fc(x)


def halves(size: int = 256):
    """(train, eval): 8 numbers, labelled by the sign of the first."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * size, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return torch.utils.data.TensorDataset(x[:size], y[:size]), torch.utils.data.TensorDataset(x[size:], y[size:])


def main() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    metrics = Path(sys.argv[1]) / "metrics.jsonl"
    launcher = subprocess.Popen(sys.argv[2:])
    while not (metrics.exists() and '"loss"' in metrics.read_text()):
        if launcher.poll() is not None:
            sys.exit(f"the launcher ended before the run logged a step: exit {launcher.returncode}")
        time.sleep(0.05)
    launcher.send_signal(signal.SIGKILL)
    killed = time.perf_counter()
    launcher.wait()
    ended = {}
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # every orphan has ended
            break
        ended[pid] = {"code": os.waitstatus_to_exitcode(status), "seconds": time.perf_counter() - killed}
    print(json.dumps(ended))


if __name__ == "__main__":
    main()
