"""A stand-in trial for tests/test_sweep.py, started by the sweep as its launcher: `python sweep_trial.py --config
trial.yaml --output-dir DIR` writes an evaluation a step to DIR/metrics.jsonl, in the trainer's format, without torch
(a tenth of a second to start, where the trainer takes seconds). The loss falls faster with a larger --lr; SIGTERM
ends it with 143, as it ends the trainer; --lr 0.25 fails."""

import json
import signal
import sys
import time
from pathlib import Path

import yaml

args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
options = yaml.safe_load(Path(args["--config"]).read_text())
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
if options["lr"] == 0.25:
    sys.exit("sweep_trial: a trial that fails, on purpose")
with open(Path(args["--output-dir"]) / "metrics.jsonl", "a", buffering=1) as metrics:
    for step in range(1, options["max-steps"] + 1):
        time.sleep(0.05)
        metrics.write(json.dumps({"step": step, "epoch": 1, "eval_loss": 1 / (1 + options["lr"] * step),
                                  "eval_samples": 10}) + "\n")
