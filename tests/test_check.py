"""`acc-trainer check` on a sound user workload and on workloads broken in each of the ways that
silently make "the same run on 1 or N processes" or "a resumed run is the same run" false; `check --faults`
on the sound one, and with a resume broken on purpose."""

from __future__ import annotations

import re

from conftest import BIN, run_cli, run_forked

# Small and not chaotic: SGD on a 16-32-4 MLP. 8 steps per run, evaluation of 301 samples.
OPTIONS = {"batch_size": 64, "optimizer": "sgd", "lr": 0.05}


def test_a_sound_workload_passes_every_row(project):
    """From the user's folder, with the console script, by import path."""
    result = run_cli("check", "--model", "my_model:build", "--dataset", "my_data:load", "--batch-size", "64",
                     "--optimizer", "sgd", "--lr", "0.05", cwd=project, command=[str(BIN / "acc-trainer")])
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") >= 4}
    for name in ("2 processes vs 1", "--grad-accum 2 vs 1 process", "same start, same samples at every step",
                 "evaluation counts every sample once", "stopped at step 4 and resumed", "the same run twice"):
        assert "PASS" in lines[name], name
    assert "SKIPPED" in lines["BatchNorm across processes"]
    assert "301 samples on 1 process, 301 on 2" in result.stdout
    assert "every check passed" in result.stdout


def _check(**workload):
    from my_data import load

    import acc_trainer

    train, evaluation = load()
    arguments = {"model": None, "train": train, "evaluation": evaluation, **workload}
    rows = acc_trainer.check(arguments["model"], arguments["train"], arguments["evaluation"], steps=4, **OPTIONS)
    return {r["check"]: r for r in rows}


def test_a_random_transform_per_process_fails_the_samples_row(project):
    from broken import NoisyData
    from my_data import load
    from my_model import Net

    train, _ = load()
    rows = _check(model=Net(4), train=NoisyData(*train.tensors))
    samples = rows["same start, same samples at every step"]
    assert samples["result"] == "FAIL" and "steps saw other samples on 2 processes" in samples["measured"]
    assert "random transform" in samples["cause"]
    assert rows["2 processes vs 1"]["result"] == "FAIL"
    # The loader reads a batch ahead: its noise was drawn before the checkpoint recorded the RNG state.
    resumed = rows["stopped at step 2 and resumed"]
    assert resumed["result"] == "FAIL" and "__getitem__" in resumed["cause"]


def test_torch_rand_in_forward_fails_with_that_cause(project):
    from broken import RandomForward

    rows = _check(model=RandomForward(4))
    topology = rows["2 processes vs 1"]
    assert topology["result"] == "FAIL" and "draws random numbers in forward" in topology["cause"]
    assert rows["same start, same samples at every step"]["result"] == "PASS"
    assert rows["stopped at step 2 and resumed"]["result"] == "PASS"


def test_batchnorm_without_sync_bn_is_measured(project):
    from broken import BatchNormNet

    rows = _check(model=BatchNormNet())
    bn = rows["BatchNorm across processes"]
    assert bn["result"] == "FAIL" and bn["fix"] == "add --sync-bn"
    without, with_sync = [float(x.split()[0]) for x in bn["measured"].split(": ")[1].split(", ")]
    assert with_sync <= 1e-5 < without
    assert rows["2 processes vs 1"]["result"] == "FAIL" and "BatchNorm" in rows["2 processes vs 1"]["cause"]


def test_a_dataset_whose_length_differs_per_process(project):
    from broken import PerProcessData
    from my_data import load
    from my_model import Net

    rows = _check(model=Net(4), train=PerProcessData(*load()[0].tensors))
    samples = rows["same start, same samples at every step"]
    assert samples["result"] == "FAIL"
    assert ("the datasets differ between processes (process 0: 512 training, 301 evaluation samples; "
            "process 1: 511 training") in samples["measured"]


def test_a_failing_check_exits_1_from_the_command_line(project):
    result = run_cli("check", "--model", "broken:BatchNormNet", "--dataset", "my_data:load", "--batch-size", "64",
                     "--steps", "4", cwd=project)
    assert result.returncode == 1
    assert "3 check(s) failed" in result.stdout
    lines = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") >= 4}
    assert "FAIL" in lines["BatchNorm across processes"] and "without --sync-bn" in lines["BatchNorm across processes"]


def _table(stdout: str) -> dict:
    """The printed table as {check: [check, result, measured, cause]}, a cell folded over lines joined."""
    rows, name = {}, None
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) != 4:
            continue
        if cells[0]:
            name, rows[cells[0]] = cells[0], cells
        else:
            rows[name] = [" ".join(filter(None, pair)) for pair in zip(rows[name], cells)]
    return rows


def test_faults_a_killed_and_a_stopped_process_end_the_run_which_resumes_bit_identical(project):
    """`check --faults`, with the watchdog's bound set by the user: the kill ends the survivor at once (its
    collective fails), the stop within the bound and the check's slack; both runs resume to the same bits."""
    result = run_forked("check", "--faults", "--hang-timeout", "3", "--model", "my_model:build", "--dataset",
                        "my_data:load", "--batch-size", "64", "--optimizer", "sgd", "--lr", "0.05", cwd=project)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = _table(result.stdout)
    ended = re.compile(r"every process ended ([\d.]+) s after it \(at most 13 s: --hang-timeout 3 s \+ 10 s\); (.*)")
    kill, stall = (rows[f"{signal} to process 1 after the step-4 checkpoint"] for signal in ("SIGKILL", "SIGSTOP"))
    took, said = ended.fullmatch(kill[2]).groups()
    assert kill[1] == "PASS" and float(took) < 3, kill  # by the failed collective, not the watchdog
    assert said.startswith("process 0: lost contact with another process: "), said
    took, said = ended.fullmatch(stall[2]).groups()
    assert stall[1] == "PASS" and 2 <= float(took) <= 13 and said == "the watchdog named process 1", stall
    for signal in ("SIGKILL", "SIGSTOP"):
        resumed = rows[f"resumed after {signal} (--resume auto)"]
        assert resumed[1:3] == ["PASS", "from step 4: bit-identical to the uninterrupted 2-process run"], resumed
    assert "every check passed" in result.stdout


def test_faults_a_resume_that_starts_over_fails(project, monkeypatch):
    """A run that starts over ends bit-identical too: the row fails it for not starting from the checkpoint."""
    from my_data import load
    from my_model import Net

    import acc_trainer
    import acc_trainer.outputs.checkpoints

    monkeypatch.setattr(acc_trainer.outputs.checkpoints, "find_resume", lambda cfg, out: (None, []))  # inherited by the forks
    train, evaluation = load()
    rows = {r["check"]: r for r in acc_trainer.check(Net(4), train, evaluation, steps=4, faults=["kill"], **OPTIONS)}
    assert list(rows) == ["SIGKILL to process 1 after the step-2 checkpoint", "resumed after SIGKILL (--resume auto)"]
    stop = rows["SIGKILL to process 1 after the step-2 checkpoint"]
    # The check's own bound: 20 x the step time, at least 5 s.
    assert stop["result"] == "PASS" and "(at most 15 s: --hang-timeout 5 s + 10 s)" in stop["measured"], stop
    resumed = rows["resumed after SIGKILL (--resume auto)"]
    assert resumed["result"] == "FAIL" and resumed["measured"] == "started from the beginning, not the step-2 checkpoint"
