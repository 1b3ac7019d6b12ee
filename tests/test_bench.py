"""A smoke test of `acc-trainer bench`: it runs every variant and writes its table and figures.

The benchmark's numbers are not checked here (the machines are shared and noisy); the README's
Performance section quotes a real run.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import run_cli, run_forked
from test_reports import assert_png

# The tests' own torch work on one thread (conftest.torch_on_one_thread): two test workers share 2 cores.
pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


def test_bench_runs_every_variant_and_writes_its_files(tmp_path, main_in_process, monkeypatch):
    """`acc-trainer bench` in this process (it launches every variant in processes of its own, with the
    environment the suite gives its subprocesses)."""
    import yaml

    out = tmp_path / "bench"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code, stdout, stderr = main_in_process("bench", "--model", "mlp", "--dataset", "fake", "--batch-size", "32",
                                           "--train-size", "256", "--processes", "1,2", "--steps", "6", "--warmup", "2",
                                           "--log-every", "2", "--repeats", "1", "--pipelines", "batched,stream",
                                           "--bench-dir", out)
    assert code == 0, stdout[-3000:] + stderr[-5000:]
    report = json.loads((out / "bench.json").read_text())
    rows = {(r["implementation"], r["processes"]): r for r in report["rows"]}
    assert set(rows) == {("acc_trainer", 1), ("acc_trainer stream", 1), ("raw", 1), ("ceiling", 1),
                         ("acc_trainer", 2), ("acc_trainer stream", 2), ("raw-ddp", 2)}
    for row in rows.values():
        assert 0 <= row["data_time_s"] <= row["step_time_s"]
    # Every acc_trainer variant trained the 6 steps of 32 samples asked, with the display a user's run has
    # (auto: plain lines into the bench's pipe), the stream ones on the parquet shards the bench wrote.
    assert len(list((out / "parquet").glob("train-*.parquet"))) == 4 and (out / "parquet" / "eval-00000.parquet").is_file()
    runs = [(json.loads((d / "summary.json").read_text()), yaml.safe_load((d / "config.yaml").read_text()))
            for d in (out / "runs").iterdir()]
    assert sorted((s["dataset"], s["world_size"]) for s, _ in runs) == [
        ("acc_trainer.tools.bench:stream_data", 1), ("acc_trainer.tools.bench:stream_data", 2), ("fake", 1), ("fake", 2)]
    assert all(s["steps"] == 6 and s["train_samples"] == 6 * 32 and c["progress"] == "auto" for s, c in runs)
    # The speeds the bench reports are the ones its runs measured over the steps after the 2 of warm-up (log steps
    # 4 and 6 of metrics.jsonl), not the whole run's of the summary, and each printed ratio is theirs.
    measured = {name: [m["samples_per_s"] for m in runs_of] for name, runs_of in report["runs"].items()}
    steady = []
    for d in (out / "runs").iterdir():
        logged = {r["step"]: r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
        assert sorted(logged) == [2, 4, 6]
        steady.append(4 * 32 / (2 * logged[4]["step_time_s"] + 2 * logged[6]["step_time_s"]))
    ours = sorted(measured["acc_trainer@1"] + measured["acc_trainer stream@1"] + measured["acc_trainer@2"]
                  + measured["acc_trainer stream@2"])
    assert ours == pytest.approx(sorted(steady), rel=1e-9) and ours != sorted(s["samples_per_s"] for s, _ in runs)
    # The warm-up apart: its 2 steps' extra time over steady steps; MFU from the runs' model FLOPs per sample over
    # the CPU's measured matrix-multiply rate.
    flops = {s["model_flops_per_sample"] for s, _ in runs}
    assert len(flops) == 1 and flops.pop() > 0 and report["peak_flops"] > 1e8 and "measured fp32" in report["peak"]
    for row in rows.values():
        assert row["warmup_extra_s"] == pytest.approx(row["warmup_s"] - 2 * row["step_time_s"])
        assert row["mfu"] == pytest.approx(runs[0][0]["model_flops_per_sample"] * row["samples_per_s"]
                                           / report["peak_flops"])
        assert f" | {row['warmup_extra_s']:.2f} | {row['mfu']:.1%} | " in (out / "bench.md").read_text()
    for name, (speed,) in measured.items():
        kind, n = name.split("@")
        assert f"repeat 1/1  {kind:>11} x{n}: {speed:>10,.0f} samples/s" in stdout
    table = (out / "bench.md").read_text()
    one, two = measured["acc_trainer@1"][0], measured["acc_trainer@2"][0]
    assert (f"| acc_trainer | 1 | {rows[('acc_trainer', 1)]['time_s']:.3f} | " in table
            and f" | {one:,.0f} | {one / measured['raw@1'][0]:.3f} | {one / measured['ceiling@1'][0]:.2f} | 1.00 |" in table)
    assert f" | {two:,.0f} | {two / measured['raw-ddp@2'][0]:.3f} | - | {two / one:.2f} | " in table
    assert "| raw-ddp | 2 |" in table and "| ceiling | 1 |" in table
    # Each 1-process loop's own cost per step: its measured step beyond the ceiling's, printed and in bench.md.
    line = next(line for line in table.splitlines() if line.startswith("Host cost per step, 1 process"))
    said = {name: int(us.replace(",", "")) for name, us in re.findall(r"(acc_trainer|\(raw\)) (-?[\d,]+) us", line)}
    ceiling_step = 32 / measured["ceiling@1"][0]
    assert said.keys() == {"acc_trainer", "(raw)"}
    assert abs(said["acc_trainer"] - 1e6 * (32 / one - ceiling_step)) <= 1
    assert abs(said["(raw)"] - 1e6 * (32 / measured["raw@1"][0] - ceiling_step)) <= 1
    assert "Host cost per step, 1 process" in stdout
    assert "| data pipeline (loader alone, 1 process) | samples/s | vs batched |" in table
    for pipeline, speed in report["pipelines"].items():
        assert f"| {pipeline} | {speed:,.0f} |" in table and f"data pipeline {pipeline:>10}: {speed:>10,.0f} samples/s" in stdout
    assert "dp (nn.DataParallel) needs 2+ GPUs" in stdout
    for figure in ("bench_performance.png", "bench_time_breakdown.png"):
        assert_png(out / figure)


def test_bench_input_errors(tmp_path):
    cases = [(["--processes", "0"], "--processes must be positive numbers"),
             (["--baselines", "tensorflow"], "unknown baseline 'tensorflow'"),
             (["--processes", "3", "--batch-size", "128"], "--batch-size 128 does not split over 3"),
             (["--steps", "60", "--warmup", "5"], "--warmup and --steps must be multiples of --log-every (10)"),
             (["--steps", "10", "--warmup", "10"], "0 < warmup < steps")]
    for i, (args, message) in enumerate(cases):
        result = (run_cli if i == 0 else run_forked)("bench", *args, cwd=tmp_path)  # the first from the shell
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("acc-trainer: error: ") and message in result.stderr
        assert result.stderr.count("\n") == 1


def test_channels_last_reaches_the_model_and_changes_no_result(train_in_process, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from acc_trainer.workload.models import LeNet

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

    def fake_run(kind, processes, cfg, steps, folder, warmup):
        calls.append((kind, steps))
        return {"samples_per_s": 1.0, "time_s": 1.0, "step_time_s": 0.01, "data_time_s": 0.001, "warmup_s": 0.2,
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


def _slow_start(monkeypatch, cls, seconds: float, first: int) -> None:
    """`cls`'s forward sleeps `seconds` in its first `first` training batches (not the start-up forwards of one or
    two samples): a warm-up such as compilation or the device's first kernels."""
    forward, calls = cls.forward, []

    def slow(self, x):
        if self.training and len(x) > 2:
            calls.append(1)
            if len(calls) <= first:
                time.sleep(seconds)
        return forward(self, x)

    monkeypatch.setattr(cls, "forward", slow)


def test_every_variant_leaves_the_same_warm_up_out_of_its_speed(train_in_process, monkeypatch, tmp_path):
    """A first step that takes 0.6 s longer (compilation, say) is the warm-up's, in acc_trainer's figures (read
    from its log steps) and in the hand-written loops' (timed from the device's end of the warm-up), not the
    steady speed's."""
    import torch

    from acc_trainer.config import make_config
    from acc_trainer.tools import baselines, bench
    from acc_trainer.workload.components import build_data, build_model
    from acc_trainer.workload.models import LeNet

    _slow_start(monkeypatch, LeNet, 0.6, 1)
    run = train_in_process(model="lenet", train_size=512, eval_size=64, batch_size=32, max_steps=8, log_every=2)
    ours = bench.logged_window(tmp_path / "run1", 2, 32)
    logged = [json.loads(line) for line in (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()]
    assert ours["warmup_s"] > 0.6 and ours["time_s"] < 0.6  # steps 3-8 only
    assert ours["samples_per_s"] > 2 * run["samples_per_s"]  # the summary's counts the slow first step
    assert ours["time_s"] == pytest.approx(sum(2 * r["step_time_s"] for r in logged if r.get("step", 0) > 2
                                               and "loss" in r))

    _slow_start(monkeypatch, LeNet, 0.6, 1)  # again, for the hand-written loop's model
    cfg = make_config({"model": "lenet", "train_size": 512, "batch_size": 32})
    data = build_data(cfg)
    model = build_model(cfg, data)
    batches = baselines.batches_on_device(data.train, cfg, torch.device("cpu"), 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    elapsed, data_time, warmup_s = baselines.time_steps(model, optimizer, batches, data.task, cfg,
                                                        torch.device("cpu"), 8, 2)
    assert warmup_s > 0.6 and elapsed < 0.6 and 0 <= data_time < elapsed


def test_a_gpu_step_s_data_time_is_what_the_device_waited(monkeypatch):
    """On CUDA the data time is read from events recorded where a step's work ends and the next begins (the host,
    running ahead, may wait long for a batch while the device still computes): here the host waited 50 ms for each
    batch, the device 1 and 3 ms; a pause (a log line, an evaluation) leaves its gap out."""
    import torch

    from acc_trainer.workload.measure import StepGaps

    clock = iter([0.0, 0.010, 0.011, 0.020, 0.023, 0.5, 0.6, 0.601])  # device times (s) of successive events

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = next(clock)

        def synchronize(self):
            pass

        def elapsed_time(self, later):
            return 1000 * (later.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    gaps = StepGaps(torch.device("cuda"))
    for _ in range(3):  # began at 0.0, ended 0.010; began 0.011 (1 ms), ended 0.020; began 0.023 (3 ms), ended 0.5
        gaps.began(0.05)
        gaps.ended()
    gaps.forget()  # a log step
    gaps.began(0.05)  # 0.6: 100 ms after the pause began, not counted
    gaps.ended()
    assert gaps.read() == pytest.approx(0.004)
    # The trainer's clock: a step's bookkeeping is no pause (its gap counts), a log step is.
    from acc_trainer.training.state import Clock

    clock = iter([0.0, 0.010, 0.012, 0.020, 0.5, 0.6])
    trainer = Clock(StepGaps(torch.device("cuda")))
    trainer.batch_arrived()  # 0.0
    trainer.batch_done()  # 0.010
    trainer.paused()  # an optimizer step's end
    trainer.batch_arrived()  # 0.012: 2 ms
    trainer.batch_done()  # 0.020
    trainer.restart()  # a log line
    trainer.batch_arrived()  # 0.5, not counted
    trainer.batch_done()  # 0.6
    assert trainer.gaps.read() == pytest.approx(0.002)
    cpu = StepGaps(torch.device("cpu"))  # on a CPU the device is the host: its wait
    cpu.began(0.05)
    cpu.began(0.02)
    assert cpu.read() == pytest.approx(0.07) and cpu.read() == 0


def test_the_hand_written_loops_compile_a_model_as_acc_trainer_does():
    """--compile: a model of repeated blocks (a transformers model's layers) compiled block by block in place, as
    acc_trainer's run compiles it; any other model compiled whole. Nothing is traced until a forward."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from acc_trainer.config import TrainConfig
    from acc_trainer.tools.baselines import wrap_model

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    wrapped = wrap_model(llama, "raw", TrainConfig(compile=True), torch.device("cpu"))
    assert wrapped is llama and all(layer._compiled_call_impl is not None for layer in llama.model.layers)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert isinstance(wrap_model(mlp, "raw", TrainConfig(compile=True), torch.device("cpu")),
                      torch._dynamo.eval_frame.OptimizedModule)
    # Under DataParallel, whose replicas would copy blocks compiled in place with the original's weights: whole.
    other = LlamaForCausalLM(llama.config)
    parallel = wrap_model(other, "dp", TrainConfig(compile=True), torch.device("cpu"))
    assert isinstance(parallel.module, torch._dynamo.eval_frame.OptimizedModule)
    assert all(layer._compiled_call_impl is None for layer in other.model.layers)
