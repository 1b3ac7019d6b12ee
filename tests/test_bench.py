"""A smoke test of `acc-trainer bench`: it runs every variant and writes its table and figures.

The benchmark's numbers are not checked here (the machines are shared and noisy); the README's
Performance section quotes a real run.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from test_reports import assert_png


# The tests' own torch work on one thread (conftest.torch_on_one_thread): two test workers share 2 cores.
pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


def test_bench_runs_every_variant_and_writes_its_files(tmp_path, main_in_process, monkeypatch):
    """`acc-trainer bench` in this process (it launches every variant in processes of its own, with the
    environment the suite gives its subprocesses)."""
    out = tmp_path / "bench"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code, stdout, stderr = main_in_process("bench", "--model", "mlp", "--dataset", "fake", "--batch-size", "32",
                                           "--train-size", "256", "--processes", "1,2", "--steps", "6", "--repeats",
                                           "1", "--pipelines", "batched,stream", "--bench-dir", out)
    assert code == 0, stdout[-3000:] + stderr[-5000:]
    report = json.loads((out / "bench.json").read_text())
    rows = {(r["implementation"], r["processes"]): r for r in report["rows"]}
    assert set(rows) == {("acc_trainer", 1), ("acc_trainer stream", 1), ("raw", 1), ("ceiling", 1),
                         ("acc_trainer", 2), ("acc_trainer stream", 2), ("raw-ddp", 2)}
    for row in rows.values():
        assert row["samples_per_s"] > 0 and 0 <= row["data_time_s"] <= row["step_time_s"]
        assert row["peak_memory_mb"] > 0 and row["data_share"] == row["data_time_s"] / row["step_time_s"]
    one = rows[("acc_trainer", 1)]
    assert one["vs_ceiling"] == one["samples_per_s"] / rows[("ceiling", 1)]["samples_per_s"]
    assert set(report["pipelines"]) == {"batched", "stream"} and min(report["pipelines"].values()) > 0
    # The stream rows trained on the same samples, read from the parquet shards the bench wrote.
    assert len(list((out / "parquet").glob("train-*.parquet"))) == 4 and (out / "parquet" / "eval-00000.parquet").is_file()
    streamed = [json.loads(p.read_text()) for p in (out / "runs").glob("*/summary.json")
                if json.loads(p.read_text())["dataset"] == "acc_trainer.tools.bench:stream_data"]
    assert len(streamed) == 2 and all(s["steps"] == 6 and s["train_samples"] == 6 * 32 for s in streamed)
    two = rows[("acc_trainer", 2)]
    assert two["speedup"] == two["samples_per_s"] / rows[("acc_trainer", 1)]["samples_per_s"]
    assert two["vs_baseline"] == two["samples_per_s"] / rows[("raw-ddp", 2)]["samples_per_s"]
    table = (out / "bench.md").read_text()
    assert table.count("\n| acc_trainer |") == 2 and "| raw-ddp | 2 |" in table and "| ceiling | 1 |" in table
    assert "| data pipeline (loader alone, 1 process) |" in table and "\n| stream |" in table
    assert "dp (nn.DataParallel) needs 2+ GPUs" in stdout
    for figure in ("bench_performance.png", "bench_time_breakdown.png"):
        assert_png(out / figure)


def test_bench_input_errors(tmp_path):
    for args, message in [(["--processes", "0"], "--processes must be positive numbers"),
                          (["--baselines", "tensorflow"], "unknown baseline 'tensorflow'"),
                          (["--processes", "3", "--batch-size", "128"], "--batch-size 128 does not split over 3")]:
        result = run_cli("bench", *args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("acc-trainer: error: ") and message in result.stderr
        assert result.stderr.count("\n") == 1


def test_flops_per_sample_is_what_pytorchs_flop_counter_counts():
    """The trainer's cheap count (hooks on Linear/Conv layers) against torch.utils.flop_counter."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from acc_trainer.data import Data
    from acc_trainer.measure import flops_per_sample
    from acc_trainer.models import MODELS

    cases = [(name, (3, 32, 32)) for name in MODELS if name != "linreg"] + [("resnet18", (3, 64, 64)),
                                                                            ("linreg", (1,))]
    for name, shape in cases:
        task = "regression" if name == "linreg" else "classification"
        model = MODELS[name](Data(None, None, task, None if name == "linreg" else 10, shape))
        sample = torch.randn(*shape)
        counted = flops_per_sample(model, [sample[None], None])
        model.eval()
        with FlopCounterMode(display=False) as reference:
            model(sample[None]).sum().backward()
        assert counted == reference.get_total_flops() > 0, name


def test_channels_last_reaches_the_model_and_changes_no_result(train_in_process, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from acc_trainer.models import LeNet

    seen = []
    forward = LeNet.forward

    def recording_forward(self, x):
        if len(x) > 2:  # not the start-up forwards of one and two samples (FLOPs, the fit check)
            seen.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return forward(self, x)

    monkeypatch.setattr(LeNet, "forward", recording_forward)
    job = {"model": "lenet", "train_size": 512, "eval_size": 64, "batch_size": 64, "max_steps": 6}
    plain = train_in_process(**job)
    assert not any(seen)
    seen.clear()
    fast = train_in_process(**job, channels_last=True)
    assert seen and all(seen)  # every training and evaluation batch arrived channels-last
    a, b = load_file(f"{plain['output_dir']}/model.safetensors"), load_file(f"{fast['output_dir']}/model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_whole_process_speed_is_the_difference_of_two_runs(monkeypatch, tmp_path):
    """--whole-process: each variant also runs at twice the steps; samples/s come from the difference of the
    two wall times (start-up cancels out), and the table compares them with the hand-written loop's."""
    from acc_trainer.tools import bench

    walls = {("acc_trainer", 100): 5.0, ("acc_trainer", 200): 6.0, ("raw", 100): 4.0, ("raw", 200): 6.0}
    calls = []

    def fake_run(kind, processes, cfg, steps, folder):
        calls.append((kind, steps))
        return {"samples_per_s": 1.0, "time_s": 1.0, "step_time_s": 0.01, "data_time_s": 0.001,
                "peak_memory_mb": 1.0, "wall_s": walls[(kind, steps)]}

    monkeypatch.setattr(bench, "run_variant", fake_run)
    out = tmp_path / "bench"
    bench.main(["--model", "linreg", "--dataset", "linear", "--batch-size", "32", "--processes", "1",
                "--baselines", "raw", "--steps", "100", "--repeats", "1", "--whole-process", "--bench-dir", str(out)])
    assert sorted(calls) == [("acc_trainer", 100), ("acc_trainer", 200), ("raw", 100), ("raw", 200)]
    rows = {r["implementation"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    assert rows["acc_trainer"]["whole_samples_per_s"] == 100 * 32 / 1.0  # 100 more steps took 1 s more
    assert rows["raw"]["whole_samples_per_s"] == 100 * 32 / 2.0
    assert rows["acc_trainer"]["whole_vs_baseline"] == 2.0
    assert "| acc_trainer | 1 | 3,200 | 2.000 |" in (out / "bench.md").read_text()
