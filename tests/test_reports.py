"""What people look at: run plots, the run comparison report, TensorBoard, the end-of-run summary."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
import yaml
from conftest import check, run_cli, run_forked, run_here, summary

# The tests' own torch work on one thread (conftest.torch_on_one_thread): two test workers share 2 cores.
pytestmark = pytest.mark.usefixtures("torch_on_one_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = {"loss.png", "eval.png", "lr.png", "throughput.png", "time_split.png", "confusion.png"}  # a classification run


def assert_png(path: Path, min_side: int = 300) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    height, width, _ = matplotlib.image.imread(path).shape
    assert min(height, width) >= min_side, (path, height, width)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two short runs that differ in their learning rate (in this process, as `acc-trainer` runs them)."""
    folder = tmp_path_factory.mktemp("runs")
    for name, lr in (("slow", "0.0003"), ("fast", "0.003")):
        out = check(run_here("--model", "mlp", "--epochs", "2", "--train-size", "1024", "--eval-size", "256",
                             "--log-every", "2", "--lr", lr, "--output-dir", folder / name)).stdout
        (folder / f"{name}.stdout").write_text(out)
    return folder


def test_every_run_plots_its_curves(two_runs):
    run = two_runs / "fast"
    assert {p.name for p in (run / "plots").iterdir()} == PLOTS
    for png in (run / "plots").iterdir():
        assert_png(png)


def test_end_of_run_summary_table(two_runs):
    out = (two_runs / "fast.stdout").read_text()
    s = summary(two_runs / "fast")
    assert "acc_trainer: run summary" in out
    best = max(s["evals"], key=lambda e: e["accuracy"])
    assert f"accuracy {best['accuracy']:.2%} at step {best['step']}" in out
    assert f"{s['samples_per_s']:,.0f} samples/s" in out and "waiting for data" in out
    assert "1 process(es), undistributed on cpu, precision no" in out  # not Accelerate's "NO"
    assert f"{two_runs / 'fast'}/model.safetensors" in out and "plots/" in out


def test_report_compares_runs(two_runs, tmp_path, main_in_process):
    figure = tmp_path / "compare.png"
    code, stdout, stderr = main_in_process("report", two_runs / "slow", two_runs / "fast", "--labels", "lr 3e-4",
                                           "lr 3e-3", "--output", figure)
    assert code == 0, stderr
    for name, label in (("slow", "lr 3e-4"), ("fast", "lr 3e-3")):
        s = summary(two_runs / name)
        row = next(line for line in stdout.splitlines() if label in line)
        assert f"{s['eval']['accuracy']:.2%}" in row and f"{s['eval']['loss']:.4f}" in row
        assert f"{s['samples_per_s']:,.0f}" in row and "mlp / synthetic" in row
    assert f"comparison figure: {figure}" in stdout
    assert "options that differ: --lr (lr 3e-4: 0.0003, lr 3e-3: 0.003)" in stdout  # what makes them differ
    assert_png(figure)


def test_report_of_a_folder_that_is_not_a_run(two_runs, tmp_path):
    result = run_cli("report", two_runs / "fast", tmp_path, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"acc-trainer: error: {tmp_path} is not a run folder (it has no metrics.jsonl)"
    assert not (tmp_path / "report.png").exists()


def test_tensorboard_gets_the_scalars_and_the_config(train_in_process):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s = train_in_process(model="mlp", train_size=512, eval_size=128, batch_size=64, epochs=2, log_every=2,
                         log_with="tensorboard")
    logs = Path(s["output_dir"]) / "logs" / "acc_trainer"
    events = EventAccumulator(str(logs))
    events.Reload()
    assert {"train/loss", "train/lr", "train/samples_per_s", "eval/loss", "eval/accuracy"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8, 10, 12, 14, 16]
    accuracy = [e.value for e in events.Scalars("eval/accuracy")]
    assert accuracy == pytest.approx([e["accuracy"] for e in s["evals"]], rel=1e-6)
    (hparams,) = logs.glob("*/hparams.yml")
    assert yaml.safe_load(hparams.read_text())["model"] == "mlp"


def test_a_tracker_that_is_not_installed(tmp_path):
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    missing = next(name for name in sorted(LOGGER_TYPE_TO_CLASS) if name not in available)
    result = run_forked("--log-with", missing, "--output-dir", tmp_path / "run")
    assert result.returncode == 2
    assert result.stderr.strip() == f"acc-trainer: error: --log-with {missing}: the {missing} package is not installed"
    assert not (tmp_path / "run").exists()


def test_live_progress_bars_on_the_main_process(train_in_process, capsys):
    """--progress rich: a live bar (epoch, steps, loss, lr, samples/s) instead of plain lines."""
    s = train_in_process(model="mlp", train_size=512, eval_size=64, batch_size=64, epochs=2, log_every=2,
                         progress="rich")
    out = capsys.readouterr().out
    assert "epoch 2" in out and "16/16" in out and "samples/s" in out and "loss" in out
    assert "step 16/16" not in out  # the plain per-log-step lines are not printed as well
    assert s["steps"] == 16


def test_the_bars_follow_the_loop_without_a_call_into_rich_per_step(monkeypatch, capsys):
    """At a terminal (FORCE_COLOR: rich takes the test's pipe for one), rich redraws the bars from the loop's
    counts a few times a second: the loop's steps cost no call into rich, and the bars end at the counts."""
    from rich.progress import Progress as RichProgress

    from acc_trainer.outputs.progress import Progress

    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")  # the bars and their figures on one line
    calls = []
    for name in ("advance", "update"):
        original = getattr(RichProgress, name)
        monkeypatch.setattr(RichProgress, name, lambda self, *a, _original=original, **k: (calls.append(1),
                                                                                              _original(self, *a, **k)))
    progress = Progress("auto", True, total_steps=10_000, epochs=2, steps_per_epoch=5_000)
    assert progress.live
    with progress:
        progress.new_epoch(1, done=1_000)  # a run resumed in its second epoch, at step 6,000
        for step in range(6_001, 10_001):
            progress.step()
            if step % 10 == 0:
                progress.log(step, 1, 0.25, 0.01, 1234.0)
    assert len(calls) < 40  # two per redraw, against two per step (8,000 here) before
    out = capsys.readouterr().out
    assert "10000/10000" in out and "epoch 2" in out and "5000/5000" in out and "loss 0.2500" in out


def test_a_run_that_stops_early_finishes_its_tracker(train_in_process, tmp_path, monkeypatch):
    """A loss that becomes inf stops the run; its tracker is finished all the same (wandb and MLflow mark their
    run finished there; a process of several can end without the interpreter's atexit), with the events logged
    up to then in TensorBoard's file."""
    from accelerate.tracking import TensorBoardTracker
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from acc_trainer.stopping import TrainingStopped

    finished = []
    close = TensorBoardTracker.finish
    monkeypatch.setattr(TensorBoardTracker, "finish", lambda self: (finished.append(self.logging_dir), close(self)))
    with pytest.raises(TrainingStopped, match="the loss became NaN or inf at step 3"):
        train_in_process(model="mlp", train_size=512, eval_size=128, batch_size=64, epochs=2, log_every=2,
                         optimizer="sgd", lr=1e12, log_with="tensorboard", output_dir=str(tmp_path / "run"))
    assert len(finished) == 1
    events = EventAccumulator(str(tmp_path / "run" / "logs" / "acc_trainer"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2]
