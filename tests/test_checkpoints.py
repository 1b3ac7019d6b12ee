"""Checkpoints that survive anything: exact resume, preemption, kill -9, bad checkpoints, runaway losses, hangs."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    BIN,
    CONFIGS,
    REPO,
    _env,
    check,
    forked_cli,
    free_port,
    launch,
    metrics,
    run_cli,
    run_forked,
    run_here,
    summary,
)
from safetensors.torch import load_file

from acc_trainer.config import ConfigError
from acc_trainer.outputs.checkpoints import complete_checkpoints

INTERRUPT = REPO / "tests" / "interrupt.py"
# 16 steps per epoch, 3 epochs; accumulation (2 micro-batches a step), a cosine schedule with warmup and a
# checkpoint every 7 steps that is not a log step (so a resumed run must restore the loss accumulators).
JOB = ["--model", "lenet", "--train-size", "1024", "--eval-size", "256", "--batch-size", "64", "--grad-accum", "2",
       "--epochs", "3", "--optimizer", "adamw", "--scheduler", "cosine", "--warmup-steps", "5", "--log-every", "5",
       "--checkpoint-every", "7", "--no-plots"]
TWO = ["--multi_gpu", "--num_processes", "2"]


def interrupted(options, *args, world=1, job=JOB):
    """Runs JOB + ARGS with tests/interrupt.py's OPTIONS: on 1 process forked from this one, on 2 launched."""
    if world == 1:
        import interrupt

        return run_forked(*job, *args, before=functools.partial(interrupt.prepare, [*map(str, options)]))
    return launch(*options, "--", *job, *args, launcher_args=TWO, target=[INTERRUPT])


def resumed(out, world=1):
    """The interrupted run continued to its end: on one process in this process (the same flags through the
    same acc_trainer.cli.main, on one thread as the subprocesses; nothing here is about the process
    boundary, and a run continued here must match the reference bit for bit all the same), on two processes
    forked from this one (conftest.forked_cli; the launches and their signals are the interrupted runs'). Returns
    what the run printed: its stdout on one process, every process's stdout and stderr together on two."""
    args = [*JOB, "--output-dir", out, "--resume", "auto"]
    if world == 1:
        return check(run_here(*args)).stdout
    return forked_cli(*args, processes=world, output=out.parent / "resumed.out")


def same_run(reference, run):
    """Bit-identical final weights, and the same losses logged at the same steps on every rank."""
    a, b = load_file(reference / "model.safetensors"), load_file(run / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    logged = [[(r["step"], r["loss_per_rank"]) for r in metrics(d) if "loss" in r] for d in (reference, run)]
    assert logged[0] == logged[1] and len(logged[0]) == 10
    evals = [[(r["step"], r["eval_loss"]) for r in metrics(d) if "eval_loss" in r] for d in (reference, run)]
    assert evals[0] == evals[1] and len(evals[0]) == 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted runs, on 1 and 2 processes: reference(world) is the folder of the run on WORLD
    processes, made the first time a test asks for it, where `resumed` runs them (this process, or processes
    forked from it)."""
    folder, made = tmp_path_factory.mktemp("reference"), {}

    def run(world):
        if world not in made:
            out = folder / str(world)
            if world == 1:
                check(run_here(*JOB, "--output-dir", out))
            else:
                forked_cli(*JOB, "--output-dir", out, processes=world)
            made[world] = out
        return made[world]

    return run


@pytest.mark.parametrize("world", [1, 2])
def test_interrupted_twice_and_resumed_is_the_same_run(tmp_path, reference, world):
    out = tmp_path / "run"
    # One process stops after the step in which the signal came; several agree at the next log step
    # (--log-every 5), so that the other steps wait for no extra collective.
    stop, second_stop = (11, 26) if world == 1 else (15, 30)
    # Preempted in the first epoch: SIGTERM in micro-batch 21 (step 11) reaches the last process only.
    first = interrupted(["--signal", "TERM", "--at", 21, "--rank", world - 1], "--output-dir", out, "--plots",
                        world=world)
    assert first.returncode == 143  # through `acc-trainer launch` on two
    assert (f"acc-trainer: stopped by SIGTERM at step {stop}; checkpoint saved in {out}/checkpoints/step-{stop:08d}; "
            f"continue with --resume auto --output-dir {out}") in first.stderr
    # A run stopped early still gets its plots (on two, drawn by the main process while the other waits).
    assert (out / "plots" / "loss.png").exists()
    # Resumed, then interrupted again in the second epoch (SIGINT, Ctrl-C) 15 steps later.
    second = interrupted(["--signal", "INT", "--at", 30], "--output-dir", out, "--resume", "auto", world=world)
    assert f"stopped by SIGINT at step {second_stop}" in second.stderr
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == [
        f"step-{s:08d}" for s in sorted({7, stop, 14, 21, 28, second_stop} - ({28} if world == 1 else set()))]
    result = resumed(out, world)
    assert f"resuming at step {second_stop}" in result
    same_run(reference(world), out)
    assert summary(out)["resumed_from"] == str(out / "checkpoints" / f"step-{second_stop:08d}")


def test_kill_9_loses_only_the_steps_since_the_last_checkpoint(tmp_path, reference):
    out = tmp_path / "run"
    killed = interrupted(["--signal", "KILL", "--at", 40], "--output-dir", out)  # in step 20
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-00000007", "step-00000014"]
    assert "resuming at step 14" in resumed(out)
    same_run(reference(1), out)


def test_a_checkpoint_killed_while_written_never_looks_usable(tmp_path, reference):
    out = tmp_path / "run"
    killed = interrupted(["--kill-in-save", 2], "--output-dir", out)  # inside the step-14 checkpoint
    assert killed.returncode == -signal.SIGKILL
    folders = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert folders == [".tmp-step-00000014", "step-00000007"]
    assert (out / "checkpoints" / ".tmp-step-00000014" / "model.safetensors").exists()  # written, not complete
    assert "resuming at step 7" in resumed(out)
    same_run(reference(1), out)
    assert not (out / "checkpoints" / ".tmp-step-00000014").exists()  # cleared by the next save


def test_sigterm_to_the_launcher_saves_and_stops_every_process(tmp_path):
    """A scheduler's preemption: SIGTERM to `acc-trainer launch` (`accelerate launch` ending as the trainer does:
    torch's launcher would exit 1 with a traceback), which passes it to its processes."""
    out = tmp_path / "run"
    job = [a if a != "3" else "200" for a in JOB]  # long enough to be stopped
    cmd = [str(BIN / "acc-trainer"), "launch", "--main_process_port", str(free_port()), "--config_file",
           str(CONFIGS / "cpu_ddp.yaml"), "-m", "acc_trainer", *job, "--output-dir", str(out), "--progress", "plain"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    (last,) = complete_checkpoints(out / "checkpoints")[-1:]
    state = json.loads((last / "trainer_state.json").read_text())
    assert process.returncode == 143  # 128 + SIGTERM, as a process ended by it
    assert stderr.splitlines() == [f"acc-trainer: stopped by SIGTERM at step {state['step']}; checkpoint saved in {last}; "
                                   f"continue with --resume auto --output-dir {out}"]  # one line, no traceback
    assert last.name == f"step-{state['step']:08d}" and state["world_size"] == 2
    assert (last / "random_states_0.pkl").exists() and (last / "random_states_1.pkl").exists()


def test_a_nan_on_one_process_stops_all_of_them(tmp_path):
    out = tmp_path / "run"
    # A checkpoint after every step and no log step in the run: only the check made before every
    # checkpoint stands between the NaN and a saved checkpoint.
    job = [*JOB, "--checkpoint-every", "1", "--log-every", "1000"]  # the last of a flag given twice counts
    result = interrupted(["--poison", 100], "--output-dir", out, job=job, world=2)  # sample 100 is NaN: it lands on one process
    assert result.returncode != 0
    line = next(line for line in result.stderr.splitlines() if "the loss became NaN or inf" in line)
    bad = int(line.split("at step ")[1].split(";")[0])
    assert line == (f"acc-trainer: the loss became NaN or inf at step {bad}; stopped all processes (the last good "
                    f"checkpoint is {out}/checkpoints/step-{bad - 1:08d}; --skip-nonfinite skips such steps)")
    kept = complete_checkpoints(out / "checkpoints")
    assert kept[-1].name == f"step-{bad - 1:08d}"  # nothing saved from the bad step on
    weights = load_file(kept[-1] / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_skip_nonfinite_steps_are_skipped_and_counted(train_in_process, monkeypatch):
    from acc_trainer.data import datasets as data

    synthetic = data.DATASETS["synthetic"]

    def poisoned(config):
        made = synthetic(config)
        made.train.tensors[0][500] = float("inf")  # in one step of the epoch
        return made

    monkeypatch.setitem(data.DATASETS, "synthetic", poisoned)
    s = train_in_process(model="mlp", train_size=1024, batch_size=64, epochs=1, skip_nonfinite=True)
    assert s["skipped_steps"] == 1 and s["steps"] == 16
    weights = load_file(f"{s['output_dir']}/model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert s["eval"]["accuracy"] > 0.5


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished 1-process run with checkpoints at steps 2 and 4 (made in this process)."""
    out = tmp_path_factory.mktemp("saved") / "run"
    check(run_here("--model", "mlp", "--train-size", "256", "--eval-size", "64", "--batch-size", "64", "--epochs", "1",
                  "--checkpoint-every", "2", "--output-dir", out))
    return out


def _damage(run, tmp_path, how):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    checkpoint = copy / "checkpoints" / "step-00000002"
    sums = checkpoint / "SHA256SUMS"
    if how.endswith("(SHA256SUMS removed)"):  # as a checkpoint written before digests has none
        sums.unlink()
    elif how.endswith("(SHA256SUMS emptied)"):
        sums.write_text("")
    elif how.endswith("(SHA256SUMS without its line)"):
        sums.write_text("".join(line + "\n" for line in sums.read_text().splitlines() if "model.safetensors" not in line))
    how = how.split(" (")[0]
    if how == "truncated":
        data = (checkpoint / "model.safetensors").read_bytes()
        (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "corrupt state":
        (checkpoint / "trainer_state.json").write_text('{"step": 2, "conf')
    elif how == "missing file":
        (checkpoint / "optimizer.bin").unlink()
    elif how == "garbage optimizer":
        (checkpoint / "optimizer.bin").write_bytes(b"not a torch file")
    elif how.startswith("flipped"):  # 64 bytes inside the weights, the size kept: only the digest can tell
        _flip(checkpoint / "model.safetensors")
    elif how == "edited step":  # a later checkpoint's weights under an earlier step
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        (checkpoint / "trainer_state.json").write_text(json.dumps({**state, "step": 1}))
    return copy, checkpoint


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 64] = bytes(b ^ 0xFF for b in data[middle: middle + 64])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how,message", [
    ("truncated", "checkpoint {cp} is damaged: model.safetensors does not match the digest written with it"),
    ("corrupt state", "checkpoint {cp} is damaged: trainer_state.json does not match the digest written with it"),
    ("missing file", "checkpoint {cp} is incomplete: optimizer.bin missing"),
    ("garbage optimizer", "checkpoint {cp} is damaged: optimizer.bin does not match the digest written with it"),
    ("flipped bytes", "checkpoint {cp} is damaged: model.safetensors does not match the digest written with it"),
    ("edited step", "checkpoint {cp} is damaged: trainer_state.json does not match the digest written with it"),
    # Deleting the digests does not switch the check off (a flipped byte used to resume with exit 0).
    ("flipped bytes (SHA256SUMS removed)", "checkpoint {cp} is unverifiable: it has no SHA256SUMS; resume from another "
     "one (--resume auto takes the newest that verifies) or give --accept-unverified"),
    ("flipped bytes (SHA256SUMS emptied)", "checkpoint {cp} is unverifiable: its SHA256SUMS does not list "),
    ("flipped bytes (SHA256SUMS without its line)", "checkpoint {cp} is unverifiable: its SHA256SUMS does not list "
     "model.safetensors"),
    ("edited step (SHA256SUMS removed)", "checkpoint {cp} is unverifiable: it has no SHA256SUMS"),
])
def test_damaged_checkpoints_are_named_errors(saved_run, tmp_path, train_in_process, how, message):
    run, checkpoint = _damage(saved_run, tmp_path, how)
    with pytest.raises(ConfigError) as error:
        train_in_process(model="mlp", train_size=256, eval_size=64, batch_size=64, epochs=1, checkpoint_every="2",
                         output_dir=str(run), resume=str(checkpoint))
    assert str(error.value).startswith(message.format(cp=checkpoint))


def test_a_damaged_newest_checkpoint_is_skipped_by_resume_auto(saved_run, tmp_path, main_in_process):
    """Bytes flipped at rest in the newest checkpoint: `--resume auto` says which it skipped and why, continues
    from the one before, and ends with the uninterrupted run's weights; damaged final weights are refused by
    `evaluate`, naming the file."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    for done in ("summary.json", "model.safetensors"):
        (run / done).unlink()
    newest = run / "checkpoints" / "step-00000004"
    _flip(newest / "model.safetensors")
    code, stdout, stderr = main_in_process("--model", "mlp", "--train-size", "256", "--eval-size", "64", "--batch-size",
                                           "64", "--epochs", "1", "--checkpoint-every", "2", "--output-dir", run,
                                           "--resume", "auto", "--progress", "plain", "--no-plots")
    assert code == 0, stderr
    assert (f"--resume auto: skipped checkpoint {newest}: damaged: model.safetensors does not match the digest "
            f"written with it ({newest}/SHA256SUMS)") in stdout
    assert "resuming at step 2" in stdout
    final, reference = load_file(run / "model.safetensors"), load_file(saved_run / "model.safetensors")
    assert all(torch.equal(final[k], reference[k]) for k in reference)
    _flip(run / "model.safetensors")
    code, _, stderr = main_in_process("evaluate", run)
    assert code == 2 and stderr == (f"acc-trainer: error: the weights {run}/model.safetensors are damaged: "
                                    f"model.safetensors does not match the digest written with it ({run}/SHA256SUMS)\n")


def test_a_checkpoint_of_another_run_is_refused(saved_run, train_in_process):
    checkpoint = saved_run / "checkpoints" / "step-00000002"
    with pytest.raises(ConfigError, match=r"checkpoint .*step-00000002 is from a different run: model 'mlp' "
                                          r"\(this run: 'lenet'\); batch_size 64 \(this run: 32\)"):
        train_in_process(model="lenet", train_size=256, eval_size=64, batch_size=32, epochs=1, resume=str(checkpoint))


def test_random_states_missing_part_of_the_numpy_state_are_refused(saved_run, tmp_path):
    """A random-states file whose NumPy state lacks its last entries (the position in the key, the cached Gaussian)
    cannot have restored NumPy's generator: the check after loading refuses it, though the entries it has match."""
    import random

    import numpy as np
    from accelerate.utils import load as load_weights_only

    from acc_trainer.outputs.checkpoints import check_random_states, restore_random_states

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(saved_run / "checkpoints" / "step-00000002", checkpoint)
    one = type("One", (), {"process_index": 0, "device": "cpu", "gather": staticmethod(lambda flags: flags)})()
    before = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        restore_random_states(checkpoint, 0)  # as load_state leaves them
        check_random_states(one, checkpoint)  # the whole file: restored
        states = load_weights_only(checkpoint / "random_states_0.pkl")
        torch.save({**states, "numpy_random_seed": states["numpy_random_seed"][:2]}, checkpoint / "random_states_0.pkl")
        with pytest.raises(ConfigError, match=r"the random number generator states of process 0 cannot be restored "
                                              r"\(random_states_0.pkl: zip\(\) argument 2 is shorter than argument 1\)"):
            check_random_states(one, checkpoint)
    finally:
        random.setstate(before[0])
        np.random.set_state(before[1])
        torch.set_rng_state(before[2])


def test_the_same_command_starts_a_run_and_continues_it(tmp_path, main_in_process):
    """`--resume auto` serves the first attempt and every restart (a cluster's requeue runs one command line): on
    a folder without a checkpoint it starts from the beginning, saying so, over what an attempt stopped before its
    first checkpoint left; with a checkpoint it continues, and ends as the uninterrupted run does."""
    out, whole = tmp_path / "run", tmp_path / "whole"
    job = ["--model", "mlp", "--train-size", "256", "--eval-size", "64", "--batch-size", "64", "--epochs", "2",
           "--checkpoint-every", "4", "--no-plots", "--progress", "plain"]
    assert main_in_process(*job, "--output-dir", whole)[0] == 0
    out.mkdir()  # an earlier attempt that died before its first checkpoint: its lines must not stay
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 9.0}\n')
    (out / "config.yaml").write_text("model: mlp\n")
    code, stdout, stderr = main_in_process(*job, "--output-dir", out, "--resume", "auto")
    assert code == 0, stderr
    assert f"--resume auto: no checkpoint in {out}/checkpoints yet: the run starts from its beginning" in stdout
    assert '"loss": 9.0' not in (out / "metrics.jsonl").read_text()
    for done in ("summary.json", "model.safetensors", "checkpoints/step-00000008"):  # as if stopped after step 4
        shutil.rmtree(out / done) if (out / done).is_dir() else (out / done).unlink()
    code, stdout, stderr = main_in_process(*job, "--output-dir", out, "--resume", "auto")
    assert code == 0 and "resuming at step 4" in stdout, stderr
    final, reference = load_file(out / "model.safetensors"), load_file(whole / "model.safetensors")
    assert all(torch.equal(final[k], reference[k]) for k in reference)


def test_resume_errors_on_the_command_line(saved_run, tmp_path, main_in_process):
    finished = saved_run.parent / "finished"  # a finished run that kept no checkpoint
    finished.mkdir(exist_ok=True)
    (finished / "summary.json").write_text("{}")
    before = (saved_run / "metrics.jsonl").read_text(), (saved_run / "summary.json").read_text()
    for args, message in [
        (["--resume", tmp_path / "nowhere"], f"--resume {tmp_path}/nowhere: no such checkpoint folder"),
        (["--resume", "auto", "--output-dir", saved_run.parent / "finished"],
         f"--resume auto: {saved_run.parent}/finished holds a finished run (its summary.json), with nothing left to "
         "continue; choose a new --output-dir\n"),
        # With its checkpoints: resuming from the last one rewrote summary.json with that short attempt's figures.
        (["--resume", "auto", "--output-dir", saved_run], f"{saved_run} holds a finished run (its summary.json), with "
         f"nothing left to continue; choose a new --output-dir, or --resume {saved_run}/checkpoints/step-00000"),
        (["--resume", "auto"], "--resume auto needs the --output-dir of the run to continue"),
        (["--model", "lenet", "--resume", saved_run / "checkpoints" / "step-00000004"], "is from a different run: model"),
    ]:
        code, _, stderr = main_in_process(*args)
        assert code == 2 and stderr.count("\n") == 1, stderr
        assert message in stderr
    assert ((saved_run / "metrics.jsonl").read_text(), (saved_run / "summary.json").read_text()) == before  # untouched
    # And as the shell sees it: exit code 2, one line.
    result = run_cli("--resume", tmp_path / "nowhere", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == f"acc-trainer: error: --resume {tmp_path}/nowhere: no such checkpoint folder\n"


def test_a_hung_process_fails_the_others_within_the_timeout(tmp_path):
    """Two machines (simulated on this one); machine 1's process stops answering (SIGSTOP)."""
    port = free_port()
    job = ["-m", "acc_trainer", "--model", "lenet", "--train-size", "4096", "--batch-size", "64", "--epochs", "100",
           "--dist-timeout", "5", "--progress", "plain", "--hang-timeout", "0"]  # the timeout alone (no watchdog)
    machines = [subprocess.Popen(
        [str(BIN / "acc-trainer"), "launch", "--multi_gpu", "--num_machines", "2", "--num_processes", "2",
         "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *job,
         "--output-dir", str(tmp_path / f"m{rank}")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
        for rank in (0, 1)]
    stopped_pids = []
    try:
        deadline = time.time() + 120
        while not (tmp_path / "m0" / "metrics.jsonl").exists():
            assert time.time() < deadline and machines[0].poll() is None
            time.sleep(0.2)
        worker = subprocess.run(["pgrep", "-f", f"output-dir {tmp_path}/m1"], capture_output=True, text=True)
        stopped_pids = [int(pid) for pid in worker.stdout.split()]
        assert stopped_pids
        for pid in stopped_pids:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        _, stderr = machines[0].communicate(timeout=60)
        waited = time.time() - stopped
    finally:
        # torchrun starts its workers in their own sessions: the stopped one is killed by its pid.
        for pid in stopped_pids:
            os.kill(pid, signal.SIGKILL)
        os.killpg(machines[1].pid, signal.SIGKILL)
    assert machines[0].returncode != 0
    assert waited < 5 + 15  # the timeout, plus the error path
    assert "acc-trainer: error (rank 0): lost contact with another process" in stderr
    assert "Timed out" in stderr


def test_best_checkpoint_and_final_weights(train_in_process):
    s = train_in_process(model="mlp", train_size=1024, eval_size=300, batch_size=64, epochs=3, save_best="accuracy",
                         checkpoint_every="epoch", keep_last=1, optimizer="sgd", lr=0.05)
    best = max(s["evals"], key=lambda e: e["accuracy"])
    assert s["best"] == {"step": best["step"], "metric": "accuracy", "value": best["accuracy"]}
    out = s["output_dir"]
    state = json.loads(open(f"{out}/checkpoints/best/trainer_state.json").read())
    assert state["step"] == best["step"]
    assert [p.name for p in complete_checkpoints(Path(out) / "checkpoints")] == ["step-00000048"]

    # The final weights, in a freshly built model, reproduce the run's final evaluation exactly.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from acc_trainer.config import make_config
    from acc_trainer.data.loaders import build_loaders, dataloader_config
    from acc_trainer.training.evaluation import evaluate
    from acc_trainer.workload.components import build_data, build_model
    from acc_trainer.workload.losses import cross_entropy
    from acc_trainer.workload.metrics import METRICS

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    cfg = make_config({"model": "mlp", "train_size": 1024, "eval_size": 300, "batch_size": 64})
    data = build_data(cfg)
    model = build_model(cfg, data)
    model.load_state_dict(load_file(f"{out}/model.safetensors"))
    accelerator = Accelerator(cpu=True, dataloader_config=dataloader_config(cfg))
    _, loader = build_loaders(cfg, data, 1, torch.device("cpu"))
    model, loader = accelerator.prepare(model, loader)
    metrics_again = evaluate(accelerator, model, loader, cross_entropy, {"accuracy": METRICS["accuracy"]})
    assert metrics_again["accuracy"] == s["eval"]["accuracy"] and metrics_again["samples"] == 300
    assert math.isclose(metrics_again["loss"], s["eval"]["loss"], rel_tol=1e-12)


def test_eval_every_n_steps_with_early_stopping_and_a_resume_counting_the_same(train_in_process, tmp_path):
    """--eval-every 5 on 16-step epochs: evaluations at steps 5, 10, 15, 20 ... (none at the epochs' ends), the
    best checkpoint and the early stop counted in them; resumed from the checkpoint at the first epoch's end,
    between two evaluations, the run evaluates at the same steps, stops at the same one and ends with the same
    weights."""
    job = dict(model="mlp", train_size=1024, eval_size=256, batch_size=64, epochs=6, optimizer="sgd", lr=0.3,
               eval_every=5, save_best="loss", early_stop="loss", patience=2, min_delta=0.02, checkpoint_every="8",
               log_every=5)
    whole = train_in_process(**job)
    steps = [e["step"] for e in whole["evals"]]
    assert steps[:4] == [5, 10, 15, 20] and all(s % 5 == 0 for s in steps) and 16 not in steps
    assert whole["steps"] == steps[-1] < 96, steps  # stopped early, at an evaluation
    assert whole["steps"] % 16, steps  # in the middle of an epoch: the run ends at the step, not the epoch's end
    losses = [e["loss"] for e in whole["evals"]]
    best = min(range(len(losses)), key=lambda i: losses[i])
    assert whole["best"]["step"] == steps[best] and len(steps) - 1 - best >= 2  # patience 2, counted in evaluations
    out = Path(whole["output_dir"])
    logged = [m["step"] for m in metrics(out) if "eval_loss" in m]
    assert logged == steps

    # The end of the first epoch, which --eval-every 5 does not evaluate: after the step-15 evaluation, before 20.
    checkpoint = out / "checkpoints" / "step-00000016"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["evals"][-1]["step"] == 15
    resumed = train_in_process(**job, resume=str(checkpoint), output_dir=str(tmp_path / "resumed"))
    assert [e["step"] for e in resumed["evals"]] == steps and resumed["evals"] == whole["evals"]
    assert resumed["steps"] == whole["steps"] and resumed["best"] == whole["best"]
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_in_the_evaluation_set_stops_the_run_in_one_line(tmp_path):
    """An evaluation whose loss is NaN (a NaN in the evaluation set) stops every process with one line and exit 1,
    after a checkpoint (the weights are sound: fix the data and resume); the run's files stay JSON: metrics.jsonl
    never holds a bare NaN, and a metric with nothing to measure is null there."""
    import acc_trainer
    from acc_trainer.stopping import TrainingStopped

    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    bad = x[:16].clone()
    bad[3, 1] = float("nan")
    sets = torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(bad, y[:16])
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="the evaluation at step 4 gave a nan loss") as stopped:
        acc_trainer.fit(torch.nn.Linear(4, 2), *sets, epochs=2, batch_size=16, progress="none", plots=False,
                        output_dir=str(out))
    assert stopped.value.code == 1 and complete_checkpoints(out / "checkpoints")[-1].name == "step-00000004"

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")

    # AUROC of a set with one class measures nothing: NaN, written as null.
    one_class = torch.utils.data.TensorDataset(x[:16], torch.zeros(16, dtype=torch.long))
    acc_trainer.fit(torch.nn.Linear(4, 2), sets[0], one_class, epochs=1, batch_size=16, progress="none", plots=False,
                    metrics=["accuracy", "auroc"], output_dir=str(tmp_path / "one_class"))
    records = [json.loads(line, parse_constant=strict) for line in (tmp_path / "one_class" / "metrics.jsonl").open()]
    assert [r["eval_auroc"] for r in records if "eval_auroc" in r] == [None]
    json.loads((tmp_path / "one_class" / "summary.json").read_text(), parse_constant=strict)


def test_a_run_resumed_from_an_older_checkpoint_keeps_its_own(tmp_path):
    """Resumed from step 4 of a run that reached step 8, with --keep-last 1, and stopped at step 8's evaluation: the
    checkpoint it wrote (step 6) is its newest, kept, and what --resume auto continues; the abandoned attempt's step 8
    is set aside in checkpoints/abandoned/ (it used to be kept as the newest by its number, and step 6 deleted)."""
    import acc_trainer

    class Stop(Exception):
        pass

    def stop_at_8(evaluation):
        if evaluation["step"] == 8:
            raise Stop

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
    options = {"epochs": 2, "batch_size": 64, "eval_every": 2, "checkpoint_every": "2", "progress": "none",
               "plots": False, "output_dir": str(tmp_path / "run")}
    acc_trainer.fit(torch.nn.Linear(4, 2), data, data, **options)
    folder = tmp_path / "run" / "checkpoints"
    assert [p.name for p in complete_checkpoints(folder)] == [f"step-0000000{s}" for s in (2, 4, 6, 8)]
    with pytest.raises(Stop):
        acc_trainer.fit(torch.nn.Linear(4, 2), data, data, **options, keep_last=1, resume=str(folder / "step-00000004"),
                        on_evaluation=stop_at_8)
    assert [p.name for p in complete_checkpoints(folder)] == ["step-00000006"]
    assert (folder / "abandoned" / "step-00000008").is_dir() and not (tmp_path / "run" / "summary.json").exists()
    summary = acc_trainer.fit(torch.nn.Linear(4, 2), data, data, **{**options, "resume": "auto"})
    assert summary["resumed_from"].endswith("step-00000006") and summary["steps"] == 8


def test_a_resume_into_another_folder_leaves_the_later_checkpoints_and_says_so(tmp_path):
    """Resumed from step 4 of a run that reached step 8, into another --output-dir: the first run's step 8 stays where it
    is, and the start note says so (it used to announce a move to checkpoints/abandoned/ that never happened)."""
    import acc_trainer

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
    options = {"epochs": 2, "batch_size": 64, "checkpoint_every": "2", "progress": "none", "plots": False}
    acc_trainer.fit(torch.nn.Linear(4, 2), data, data, **options, output_dir=str(tmp_path / "run"))
    folder = tmp_path / "run" / "checkpoints"
    summary = acc_trainer.fit(torch.nn.Linear(4, 2), data, data, **options, output_dir=str(tmp_path / "branch"),
                              resume=str(folder / "step-00000004"))
    assert summary["steps"] == 8
    assert [p.name for p in complete_checkpoints(folder)] == [f"step-0000000{s}" for s in (2, 4, 6, 8)]
    assert not (folder / "abandoned").exists()
    note, = [n for n in summary["notes"] if "step-00000008" in n]
    assert "stay where they are" in note and "moves" not in note, note


def test_a_checkpoint_left_half_replaced_is_written_over(tmp_path):
    """A write killed between renaming a checkpoint to .old-<name> and removing it leaves that folder: the next write of
    the same name replaces it (it used to fail "Directory not empty" on the main process alone, the others waiting)."""
    import acc_trainer

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(128, 4), torch.randint(0, 2, (128,)))
    options = {"epochs": 1, "batch_size": 32, "checkpoint_every": "2", "progress": "none", "plots": False,
               "output_dir": str(tmp_path / "run")}
    acc_trainer.fit(torch.nn.Linear(4, 2), data, **options)
    folder = tmp_path / "run" / "checkpoints"
    shutil.copytree(folder / "step-00000004", folder / ".old-step-00000004")  # what the killed write left
    summary = acc_trainer.fit(torch.nn.Linear(4, 2), data, **options, resume=str(folder / "step-00000002"))
    assert summary["steps"] == 4 and [p.name for p in complete_checkpoints(folder)] == ["step-00000002", "step-00000004"]
    assert not (folder / ".old-step-00000004").exists()


@pytest.mark.parametrize("how,problem", [
    ("SHA256SUMS removed", "run folder {run} (config.yaml) is unverifiable: it has no SHA256SUMS"),
    ("SHA256SUMS emptied", "run folder {run} (config.yaml) is unverifiable: its SHA256SUMS does not list config.yaml"),
    ("weights unlisted", "the weights {run}/model.safetensors are unverifiable: its SHA256SUMS does not list "
     "model.safetensors"),
    # config.yaml is read back to rebuild the model and data: another seed scored a 99.61 % run at 12.11 %
    ("seed edited", "run folder {run} (config.yaml) is damaged: config.yaml does not match the digest written with it"),
])
def test_a_run_folder_that_cannot_be_verified_is_refused(saved_run, tmp_path, main_in_process, how, problem):
    """evaluate, predict, export and rerun read a run folder only when SHA256SUMS lists what they read (config.yaml and
    the weights) and it matches; --accept-unverified reads a folder without digests, saying so."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    sums = run / "SHA256SUMS"
    if how == "SHA256SUMS removed":
        sums.unlink()
    elif how == "SHA256SUMS emptied":
        sums.write_text("")
    elif how == "weights unlisted":
        sums.write_text("".join(line + "\n" for line in sums.read_text().splitlines() if "model.safetensors" not in line))
    else:
        config = (run / "config.yaml").read_text()
        (run / "config.yaml").write_text(config.replace("\nseed: 42\n", "\nseed: 7\n"))
    for command in (["evaluate", run], ["predict", run, "--output", tmp_path / "rows.jsonl"],
                    ["export", run, "--format", "safetensors", "--output", tmp_path / "model.safetensors"],
                    ["rerun", run, "--output-dir", tmp_path / "again"]):
        code, _, stderr = main_in_process(*command)
        assert code == 2 and stderr.count("\n") == 1 and problem.format(run=run) in stderr, (command, stderr)
    assert not any((tmp_path / name).exists() for name in ("rows.jsonl", "model.safetensors", "again"))
    if how == "SHA256SUMS removed":
        code, stdout, stderr = main_in_process("evaluate", run, "--accept-unverified")
        assert code == 0 and "accuracy" in stdout and stderr.count("--accept-unverified: ") == 2, stderr


def test_a_checkpoint_without_digests_resumes_only_when_accepted(saved_run, tmp_path, main_in_process):
    """A checkpoint written before digests (or copied without them): refused by --resume, skipped by --resume auto
    (which then finds no checkpoint that verifies), resumed with --accept-unverified, which the run's notes say."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    for done in ("summary.json", "model.safetensors"):
        (run / done).unlink()
    for checkpoint in complete_checkpoints(run / "checkpoints"):
        (checkpoint / "SHA256SUMS").unlink()
    job = ["--model", "mlp", "--train-size", "256", "--eval-size", "64", "--batch-size", "64", "--epochs", "1",
           "--checkpoint-every", "2", "--output-dir", run, "--resume", "auto"]
    code, _, stderr = main_in_process(*job)
    assert code == 2 and "no checkpoint in" in stderr and "unverifiable: it has no SHA256SUMS" in stderr, stderr
    code, _, stderr = main_in_process(*job, "--accept-unverified")
    assert code == 0, stderr
    notes = summary(run)["notes"]
    assert any("--accept-unverified: checkpoint" in n and "step-00000004 is unverifiable" in n for n in notes), notes


def test_a_checkpoint_folder_that_cannot_be_read_stops_every_process_at_once(saved_run, tmp_path):
    """Read in the code: an error other than bad input while the main process chose the checkpoint skipped the
    broadcast that the other processes wait in (up to --dist-timeout). Confirmed and mended: on 2 processes a checkpoint
    whose files the main process cannot read (PermissionError, made here by a sitecustomize: the tests run as root) is
    one line and exit 2 on every process, at once."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '0':\n"
        "    import acc_trainer.outputs.checkpoints as c\n"
        "    def unreadable(path):\n"
        "        raise PermissionError(13, 'Permission denied', str(path))\n"
        "    c._sha256 = unreadable\n")
    checkpoint = run / "checkpoints" / "step-00000002"
    started = time.monotonic()
    result = launch("--model", "mlp", "--train-size", "256", "--eval-size", "64", "--batch-size", "64", "--epochs", "1",
                    "--checkpoint-every", "2", "--output-dir", run, "--resume", checkpoint, "--dist-timeout", "60",
                    launcher_args=["--multi_gpu", "--num_processes", "2"], env={"PYTHONPATH": str(tmp_path / "site")})
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"acc-trainer: error (rank 0): --resume {checkpoint}: the "
                                                             "checkpoints in"), result.stderr[-3000:]
    assert "PermissionError" in result.stderr and time.monotonic() - started < 50


def test_outputs_that_would_be_lost_or_cannot_be_made_are_one_line(saved_run, tmp_path, main_in_process):
    """predict --output over a file that holds no predictions (it was replaced), and export into a folder that cannot
    be made (a traceback): one line, exit 2, the file untouched."""
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"my": "notes"}\n')
    code, _, stderr = main_in_process("predict", saved_run, "--output", notes)
    assert code == 2 and stderr.count("\n") == 1 and "exists and holds no predictions" in stderr, stderr
    assert notes.read_text() == '{"my": "notes"}\n'
    (tmp_path / "a-file").write_text("")
    code, _, stderr = main_in_process("export", saved_run, "--format", "safetensors", "--output",
                                      tmp_path / "a-file" / "model.safetensors")
    assert code == 2 and stderr.count("\n") == 1 and "its folder cannot be made (FileExistsError" in stderr, stderr
    code, _, stderr = main_in_process("predict", saved_run, "--output", tmp_path / "rows.jsonl")
    assert code == 0 and main_in_process("predict", saved_run, "--output", tmp_path / "rows.jsonl")[0] == 0  # replaced


def test_consolidate_killed_before_its_folder_is_whole_leaves_none(saved_run, tmp_path, main_in_process, monkeypatch):
    """`acc-trainer consolidate` puts OUT in place with its SHA256SUMS or not at all: killed while writing the digests
    (the process ends there, as under kill -9), there is no OUT, where there was a folder without digests (read as
    unverifiable); run again it writes OUT, which verifies."""
    from acc_trainer.after_training import consolidating
    from acc_trainer.outputs.checkpoints import damage

    class Killed(BaseException):
        pass

    def killed(folder, names=None):
        raise Killed

    checkpoint, out = saved_run / "checkpoints" / "step-00000004", tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(consolidating, "write_sums", killed)
        with pytest.raises(Killed):
            consolidating.consolidate(checkpoint, out)
    assert not out.exists()
    code, stdout, stderr = main_in_process("consolidate", checkpoint, out)
    assert code == 0 and stdout.startswith("consolidated ") and stderr == "", stderr
    assert damage(out) is None and sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "model.safetensors"]
