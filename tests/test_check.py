"""`acc-trainer check` on a sound user workload and on workloads broken in each of the ways that
silently make "the same run on 1 or N processes" or "a resumed run is the same run" false."""

from __future__ import annotations

from conftest import BIN, run_cli

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
