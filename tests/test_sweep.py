"""Sweeps: `acc-trainer sweep SPACE.yaml` (Optuna), each trial a run in its own process and folder, pruned from its
evaluations, stopped and continued, by two workers on one SQLite study; and fit()'s part in an Optuna search of
your own: a callback per evaluation, a folder per run, the caller's random state kept, a precision per run."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, _env, run_here

optuna = pytest.importorskip("optuna")

LINREG = {"model": "linreg", "dataset": "linear", "train-size": 512, "eval-size": 64, "batch-size": 32,
          "optimizer": "sgd", "max-steps": 300, "eval-every": 10, "log-every": 10, "progress": "none", "plots": False}


def write_space(folder: Path, name: str = "space", **keys) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def waiting_for(condition, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.02)


def text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_a_stopped_sweep_continues_with_two_workers(tmp_path, monkeypatch):
    """Ctrl-C stops the sweep and its trial (checkpointed, left running in the study); the same command, run by two
    workers at once on the one SQLite file, continues: one takes the stopped trial over and resumes it from its
    checkpoint to its end, the other finds it taken and starts the next trial, which successive halving prunes at
    its first evaluation (SIGTERM: it stops). At the end: the table, the figure, the best trial and the command that
    runs it again."""
    space = write_space(tmp_path, metric="loss", direction="minimize", trials=2, pruner="successive-halving",
                        **{"pruner-args": {"min_resource": 10, "reduction_factor": 2}}, options=LINREG,
                        search={"lr": {"float": ["1e-5", 0.1], "log": True}, "max-steps": [300, 100_000]})
    folder = tmp_path / "sweeps" / "space"
    folder.mkdir(parents=True)
    storage = f"sqlite:///{folder / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name="space", direction="minimize")
    # A good rate first, then a poor one that would run for minutes unless pruned: deterministic trials.
    study.enqueue_trial({"lr": 0.02, "max-steps": 300})
    study.enqueue_trial({"lr": 1e-5, "max-steps": 100_000})
    command = [sys.executable, "-m", "acc_trainer", "sweep", str(space)]

    def start() -> subprocess.Popen:
        return subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_env())

    trial0 = folder / "trial-0"
    first = start()
    waiting_for(lambda: "eval_loss" in text(trial0 / "metrics.jsonl"), "trial 0's first evaluation")
    first.send_signal(signal.SIGINT)
    out = first.communicate(timeout=90)[0]
    assert first.returncode == 130, out
    assert "trial 0: stopped after step" in out and "sweep stopped by SIGINT: run the same command again" in out
    (checkpoint,) = (trial0 / "checkpoints").glob("step-*")
    stopped_at = int(checkpoint.name[5:])
    assert 10 <= stopped_at < 300
    assert optuna.load_study(study_name="space", storage=storage).trials[0].state.name == "RUNNING"

    # Both at once: the one that locks trial 0 first resumes it; the other finds it taken and starts trial 1.
    workers = [start(), start()]
    outs = [worker.communicate(timeout=120)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], outs
    said = sorted([line for line in out.splitlines() if line.startswith("trial ")] for out in outs)
    assert said[0][0] == "trial 0 resumed: lr=0.02, max-steps=300" and said[0][1].startswith("trial 0: loss "), outs
    assert said[1][0] == "trial 1 started: lr=1e-05, max-steps=100000", outs
    assert said[1][1].startswith("trial 1: pruned at step 10 (loss ") and len(said[0]) == len(said[1]) == 2, outs

    trials = optuna.load_study(study_name="space", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED"]
    evals = [json.loads(line) for line in (trial0 / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in evals if "eval_loss" in r}
    assert sorted(evals) == list(range(10, 301, 10))
    assert trials[0].intermediate_values == evals  # each evaluation reported once, before and after the stop
    assert trials[0].value == evals[300]
    summary = json.loads((trial0 / "summary.json").read_text())
    assert summary["resumed_from"].endswith(checkpoint.name) and summary["steps"] == 300
    assert list(trials[1].intermediate_values) == [10] and trials[1].intermediate_values[10] > evals[10]
    assert not (folder / "trial-1" / "checkpoints").exists()  # a pruned trial never continues
    assert "acc-trainer: stopped by SIGTERM at step " in (folder / "trial-1" / "trial.log").read_text()
    # Stopped long before its 100,000 steps. Not a tight bound: a step of this model takes about 0.4 ms, so the 0.2 s
    # between reads of metrics.jsonl, the pruner's answer from the shared SQLite file and the signal are hundreds of
    # steps unloaded and over a thousand on a busy machine (1,080 seen in CI).
    assert json.loads((folder / "trial-1" / "metrics.jsonl").read_text().splitlines()[-1])["step"] < 25_000

    # The worker that ends last (or both) shows the study as a whole.
    last = next(out for out in outs if "study space: 2 trials, 1 complete, 1 pruned" in out)
    assert f"best: trial 0, loss {evals[300]:.6g} (lr=0.02, max-steps=300)" in last
    rerun = "acc-trainer --config sweeps/space/trial-0/trial.yaml --output-dir runs/space-trial-0"
    assert f"run it again: {rerun}" in last
    rows = list(csv.reader(open(folder / "trials.csv")))
    assert rows[0] == ["trial", "state", "loss", "step", "lr", "max-steps", "seconds"]
    assert [r[:4] for r in rows[1:]] == [["0", "complete", str(evals[300]), "300"], ["1", "pruned", rows[2][2], "10"]]
    assert (folder / "trials.png").stat().st_size > 10_000

    # The command runs the best trial's options again: the trial's own configuration, in a folder of its own.
    from acc_trainer.flags import parse_config

    monkeypatch.chdir(tmp_path)
    again = parse_config(rerun.split()[1:]).to_dict()
    ran = {name.replace("-", "_"): value for name, value in yaml.safe_load((trial0 / "config.yaml").read_text()).items()}
    assert again["output_dir"] == "runs/space-trial-0" and ran["lr"] == 0.02
    assert {**again, "output_dir": None} == {**ran, "output_dir": None, "resume": None}


def test_every_signal_to_the_sweep_reaches_its_trial_and_the_sweep_waits_for_it():
    """The sweep's stop (StopSignals(passes_on=True)): a SIGTERM that came while the trial was starting reaches it
    once it is followed, and Ctrl-C twice reaches it twice (a trainer stops at once at the second, as in a
    terminal) while the sweep keeps its handler: it is not interrupted, and stops once its trial has."""
    import os

    from acc_trainer.stopping import StopSignals

    # Says each signal as it comes (one line each: two of a kind sent together could arrive as one).
    trial = ("import signal, time\n"
             "got = []\n"
             "def said(signum, frame):\n"
             "    got.append(signum)\n"
             "    print(signum, flush=True)\n"
             "signal.signal(signal.SIGINT, said)\n"
             "signal.signal(signal.SIGTERM, said)\n"
             "print('ready', flush=True)\n"
             "while len(got) < 3:\n"
             "    time.sleep(0.01)\n")
    with StopSignals(passes_on=True) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        child = subprocess.Popen([sys.executable, "-c", trial], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline() == "ready\n"
            stop.follow(child)
            assert child.stdout.readline() == f"{signal.SIGTERM.value}\n"
            for _ in range(2):  # the second with Python's own handler back would raise KeyboardInterrupt here
                os.kill(os.getpid(), signal.SIGINT)
                assert child.stdout.readline() == f"{signal.SIGINT.value}\n"
            assert child.wait(timeout=30) == 0
        finally:
            stop.follow(None)
            child.kill()
            child.wait()
    assert stop.received == signal.SIGTERM


def test_median_pruning_and_a_failed_trial_under_any_launcher(tmp_path):
    """The launcher is any command (here a stand-in trial without torch): the median pruner stops the trial that is
    worse than the completed ones at the same step; a trial that fails is marked failed, with its last line; a grid
    runs each of its points once."""
    launcher = f"{sys.executable} {REPO / 'tests' / 'sweep_trial.py'}"
    storage = f"sqlite:///{tmp_path / 'median.db'}"
    space = write_space(tmp_path, metric="loss", direction="minimize", sampler="grid", pruner="median",
                        **{"pruner-args": {"n_startup_trials": 2}, "sweep-dir": str(tmp_path / "median")}, launcher=launcher,
                        options={"max-steps": 8}, search={"lr": [1.0, 0.5, 0.25, 0.01]}, study="median", storage=storage,
                        seed=23)  # the grid's order, shuffled by the seed: 1.0, 0.5, 0.25, 0.01
    result = subprocess.run([sys.executable, "-m", "acc_trainer", "sweep", str(space)], cwd=tmp_path, capture_output=True,
                            text=True, env=_env(), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    trials = optuna.load_study(study_name="median", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "FAIL", "PRUNED"], result.stdout
    assert list(trials[3].intermediate_values) == [1]  # stopped at its first evaluation
    assert trials[2].user_attrs["failure"] == "exit 1: sweep_trial: a trial that fails, on purpose"
    assert (f"trial 2: failed: exit 1: sweep_trial: a trial that fails, on purpose ({tmp_path}/median/trial-2/trial.log)"
            in result.stdout)
    assert "trial 3: pruned at step 1 (loss 0.990099)" in result.stdout
    assert "best: trial 0, loss 0.111111 (lr=1)" in result.stdout
    assert f"run it again: {launcher} --config {tmp_path}/median/trial-0/trial.yaml --output-dir runs/median-trial-0" \
        in result.stdout


@pytest.mark.parametrize("space, error", [
    ({"search": {"lr": [0.1]}, "pruner_arg": {}}, "unknown key 'pruner_arg'; did you mean pruner-args?"),
    ({"search": {"lr": [0.1]}, "options": {"output-dir": "x"}}, "options: output-dir is the sweep's to set"),
    ({"search": {"lr": {"float": [0.1]}}}, "search: lr: give {float: [low, high]} or {int: [low, high]}"),
    ({"search": {"optimiser": ["sgd"]}}, "search: 'optimiser' is not an option to search; did you mean optimizer?"),
    ({"search": {"optimizer": ["sgd", "adamx"]}}, "optimizer 'adamx': "),
    ({"search": {"lr": {"float": [0.1, 1]}}, "sampler": "grid"}, "sampler grid takes lists of values"),
    ({"search": {"lr": [0.1]}, "pruner": "medain"}, "pruner 'medain': choose from median, successive-halving, "
                                                     "hyperband, none; did you mean median?"),
])
def test_a_bad_space_file_is_one_line(space, error, tmp_path):
    result = run_here("sweep", write_space(tmp_path, **space), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and error in result.stderr, result.stderr
    assert not (tmp_path / "sweeps").exists()  # nothing started


def test_the_direction_follows_the_metric(tmp_path):
    from acc_trainer.tools.sweep_space import read_space

    for metric, direction in (("loss", "minimize"), ("accuracy", "maximize"), ("perplexity", "minimize")):
        space = read_space(write_space(tmp_path, metric=metric, search={"lr": {"float": ["1e-4", 0.1], "log": True}}))
        assert space.direction == direction
    assert space.storage == f"sqlite:///{Path('sweeps/space').resolve()}/study.db" and space.trials == 20


def test_an_optuna_search_over_fit_in_one_process(tmp_path, monkeypatch, torch_on_one_thread):
    """fit(on_evaluation=...) hands each evaluation to an Optuna trial, which prunes a poor run (optuna.TrialPruned
    raised by the callback ends the run, and fit raises it); runs named in the same second get folders of their own;
    a bf16 run after a float32 one in the same process works; fit leaves the caller's random state as it was."""
    import random

    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    import acc_trainer
    from acc_trainer.outputs import (
        progress,  # noqa: F401 (imported first: rich's import draws one number from random)
        runfiles,
    )

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runfiles.time, "strftime", lambda *_: "20250101-000000")  # every run in the same second
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
    seen, runs = [], []

    def states():
        return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()

    def objective(trial):
        lr, precision = trial.suggest_float("lr", 1e-4, 1.0, log=True), trial.suggest_categorical("precision", ["no", "bf16"])

        def report(evaluation):
            seen.append((trial.number, evaluation["step"]))
            trial.report(evaluation["accuracy"], evaluation["step"])
            if trial.should_prune():
                raise optuna.TrialPruned()

        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        before = states()
        try:
            summary = acc_trainer.fit(model, data, data, epochs=2, batch_size=32, lr=lr, optimizer="sgd",
                                      metrics=["accuracy"], mixed_precision=precision, progress="none", plots=False,
                                      on_evaluation=report)
        finally:
            assert states() == before  # the caller's Python, NumPy and torch generators, as they were
        runs.append((summary["output_dir"], summary["mixed_precision"], [e["step"] for e in summary["evals"]]))
        return summary["eval"]["accuracy"]

    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
    for lr, precision in ((0.5, "no"), (0.5, "bf16"), (1e-4, "no")):
        study.enqueue_trial({"lr": lr, "precision": precision})
    study.optimize(objective, n_trials=3)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert seen == [(0, 8), (0, 16), (1, 8), (1, 16), (2, 8)]  # one call per evaluation; the pruned run ends at its first
    folder = "runs/20250101-000000-Linear-TensorDataset"
    assert runs == [(folder, "no", [8, 16]), (folder + "-2", "bf16", [8, 16])]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [Path(folder).name + s for s in ("", "-2", "-3")]
    assert study.trials[0].value > 0.8


def test_workers_of_different_seeds_draw_different_values(tmp_path):
    """Worker 1 restarted on a study of 2 trials and worker 2 started on one of 1 trial draw their own values (their
    samplers were both seeded 3 = 1 + 2 = 2 + 1, and drew exactly the same learning rates)."""
    from acc_trainer.tools.sweep import open_study
    from acc_trainer.tools.sweep_space import read_space

    drawn = []
    for seed, trials in ((1, 2), (2, 1)):
        space = read_space(write_space(tmp_path, f"seed{seed}", metric="loss", seed=seed, study=f"s{seed}",
                                       storage=f"sqlite:///{tmp_path}/study{seed}.db",
                                       search={"lr": {"float": ["1e-4", 0.1], "log": True}}))
        study = optuna.create_study(storage=space.storage, study_name=space.study)
        for _ in range(trials):
            study.tell(study.ask(), 1.0)
        trial = open_study(space).ask()
        drawn.append(trial.suggest_float("lr", 1e-4, 0.1, log=True))
    assert drawn[0] != drawn[1], drawn


def test_a_metric_no_trial_evaluates_stops_the_sweep_in_one_line(tmp_path):
    """A metric the trials do not compute (a typo) made every trial fail and the sweep exit 0: the first trial that
    evaluates without it stops the sweep, one line naming what the evaluations have, exit 2."""
    launcher = f"{sys.executable} {REPO / 'tests' / 'sweep_trial.py'}"
    space = write_space(tmp_path, metric="los", direction="minimize", launcher=launcher, options={"max-steps": 8},
                        search={"lr": [1.0, 0.5, 0.1]}, sampler="grid", storage=f"sqlite:///{tmp_path / 's.db'}",
                        **{"sweep-dir": str(tmp_path / "s")})
    result = subprocess.run([sys.executable, "-m", "acc_trainer", "sweep", str(space)], cwd=tmp_path, capture_output=True,
                            text=True, env=_env(), timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stdout + result.stderr
    assert "metric 'los' is not among the trials' evaluations (loss, samples); the sweep stops; did you mean loss?" in \
        result.stderr
    assert result.stdout.count("started:") == 1  # the other trials were never started
    # Every trial failing (each for its own reason) is no success either: exit 1, one line.
    failing = write_space(tmp_path, "failing", metric="loss", direction="minimize", launcher=launcher,
                          options={"max-steps": 8}, search={"lr": [0.25]}, sampler="grid",
                          storage=f"sqlite:///{tmp_path / 'f.db'}", **{"sweep-dir": str(tmp_path / "f")})
    result = subprocess.run([sys.executable, "-m", "acc_trainer", "sweep", str(failing)], cwd=tmp_path,
                            capture_output=True, text=True, env=_env(), timeout=120)
    assert result.returncode == 1 and result.stderr == ("acc-trainer: every trial this sweep ran failed (1); their "
                                                        "trial.log says why\n"), result.stdout + result.stderr
