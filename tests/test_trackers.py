"""Trackers as their users read them: `--log-with all` sends one run to TensorBoard, MLflow (a SQLite store), wandb
(offline) and trackio, each named after the run folder, in the project its environment variable or --project
names, with the final summary and (MLflow, wandb) the run's files; read back with each tracker's own reader.
A tracker that fails to start stops the run in one line and leaves the folder as it was. Nothing goes online."""

import hashlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from conftest import BIN, metrics, run_here, summary

JOB = ["--model", "mlp", "--train-size", "256", "--eval-size", "64", "--batch-size", "64", "--epochs", "2",
       "--log-every", "2", "--progress", "plain"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """In one folder: a start with TensorBoard and an MLflow store that cannot be reached (into a folder the user
    made, holding a file of theirs), then a run that succeeds into it (`all`: tensorboard, wandb, mlflow, trackio;
    projects from WANDB_PROJECT and MLFLOW_EXPERIMENT_NAME), and a second run of the same seed with --project."""
    from accelerate.tracking import MLflowTracker

    folder = tmp_path_factory.mktemp("trackers")
    # MLflow's SQLite store is created by 68 migrations, each committed (an fsync): 6 s on this disk, 3.5 s in memory.
    store = Path(tempfile.mkdtemp(dir="/dev/shm")) if Path("/dev/shm").is_dir() else folder
    draws, mlflow_start = [], MLflowTracker.start

    def start(self):  # what MLflow would draw for a run's name, from the generators it is handed
        draws.append((random.random(), float(np.random.random())))
        mlflow_start(self)

    homes = {"WANDB_CONFIG_DIR": "wandb-config", "WANDB_CACHE_DIR": "wandb-cache", "WANDB_DATA_DIR": "wandb-data",
             "TRACKIO_DIR": "trackio"}  # nothing written outside the test's folders
    variables = {"WANDB_MODE": "offline", "WANDB_CONSOLE": "off", "WANDB_PROJECT": "w-env",
                 "MLFLOW_EXPERIMENT_NAME": "m-env", **{k: str(folder / v) for k, v in homes.items()}}
    # trackio reads TRACKIO_DIR once, when first imported: one imported already in this process (TRL's trainers import
    # it, and another test of this worker may have imported them) would write its store outside the test's folders.
    for name in [name for name in sys.modules if name == "trackio" or name.startswith("trackio.")]:
        del sys.modules[name]
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setattr(MLflowTracker, "start", start)
            for name, value in variables.items():
                env.setenv(name, value)
            env.setenv("MLFLOW_TRACKING_URI", "nowhere://store")
            (folder / "run").mkdir()
            (folder / "run" / "notes.txt").write_text("the user's own file\n")
            failed = run_here(*JOB, "--log-with", "tensorboard,mlflow", "--output-dir", "run", cwd=folder)
            left = sorted(p.relative_to(folder / "run").as_posix() for p in (folder / "run").rglob("*"))
            env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
            tracked = run_here(*JOB, "--log-with", "all", "--output-dir", "run", cwd=folder)
            again = run_here(*JOB, "--log-with", "tensorboard,mlflow", "--project", "sweep 1", "--output-dir", "run2",
                             "--no-plots", cwd=folder)
        assert tracked.returncode == 0 and again.returncode == 0, tracked.stderr[-3000:] + again.stderr[-3000:]
        yield SimpleNamespace(folder=folder, run=folder / "run", failed=failed, left=left, draws=draws[-2:], store=store)
    finally:
        if store != folder:
            shutil.rmtree(store, ignore_errors=True)


def test_a_tracker_that_fails_to_start_stops_the_run_in_one_line_and_leaves_the_folder_reusable(runs):
    assert runs.failed.returncode == 2
    line, = runs.failed.stderr.strip().splitlines()[-1:]
    assert line.startswith("acc-trainer: error: --log-with mlflow: the tracker did not start: ")
    assert "Traceback" not in runs.failed.stderr
    # TensorBoard had started: its files went with it; the user's file and the run's lock stayed.
    assert runs.left == [".lock", "notes.txt"]
    assert (runs.run / "notes.txt").read_text() == "the user's own file\n"  # and the next start ran into the folder
    assert summary(runs.run)["steps"] == 8


def test_tensorboard_holds_one_run_whose_hparams_show_the_results_beside_the_options(runs):
    """What TensorBoard's HParams tab lists (its own handler, on its own event reader): one session per run, the
    options as its hyperparameters, the final summary and the last scalars as its metrics, ended successfully."""
    from google.protobuf import json_format
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.context import RequestContext
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    events = plugin_event_multiplexer.EventMultiplexer()
    events.AddRunsFromDirectory(str(runs.folder))
    events.Reload()
    assert sorted(events.Runs()) == ["run/logs/acc_trainer", "run2/logs/sweep_1"]  # one TensorBoard run per run
    context = backend_context.Context(base_plugin.TBContext(
        logdir=str(runs.folder), multiplexer=events,
        data_provider=data_provider.MultiplexerDataProvider(events, str(runs.folder))))
    request = json_format.Parse('{"startIndex": 0, "sliceSize": 10, "allowedStatuses": ["STATUS_SUCCESS"]}',
                                api_pb2.ListSessionGroupsRequest())
    groups = {g.name: g for g in list_session_groups.Handler(RequestContext(), context, "", request).run().session_groups}
    assert sorted(groups) == ["run/logs/acc_trainer", "run2/logs/sweep_1"]
    group, s = groups["run/logs/acc_trainer"], summary(runs.run)
    options = yaml.safe_load((runs.run / "config.yaml").read_text())
    assert group.hparams["lr"].number_value == options["lr"] and group.hparams["model"].string_value == "mlp"
    results = {m.name.tag: m.value for m in group.metric_values}
    assert results["final/eval_accuracy"] == pytest.approx(s["eval"]["accuracy"])
    assert results["final/best_accuracy"] == pytest.approx(s["best"]["value"])
    assert results["final/wall_time_s"] == pytest.approx(s["wall_time_s"], rel=1e-6)
    assert results["final/peak_memory_mb"] == pytest.approx(s["peak_memory_mb"], rel=1e-6)
    assert results["train/loss"] == pytest.approx([m for m in metrics(runs.run) if "loss" in m][-1]["loss"], rel=1e-6)


def test_mlflow_keeps_each_run_by_its_folder_name_with_the_final_summary_and_the_run_files(runs):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{runs.store / 'mlflow.db'}")
    # MLFLOW_EXPERIMENT_NAME names the experiment; --project wins over it.
    (run,) = client.search_runs([client.get_experiment_by_name("m-env").experiment_id])
    (second,) = client.search_runs([client.get_experiment_by_name("sweep 1").experiment_id])
    assert (run.info.run_name, second.info.run_name) == ("run", "run2")
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "0.001"
    s = summary(runs.run)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2, 4, 6, 8]
    assert run.data.metrics["final/eval_loss"] == pytest.approx(s["eval"]["loss"])
    assert run.data.metrics["final/samples_per_s"] == pytest.approx(s["samples_per_s"])
    files = _artifacts(client, run.info.run_id)
    assert {"config.yaml", "summary.json", "model.safetensors", "SHA256SUMS", "plots/loss.png"} <= set(files)
    kept = Path(client.download_artifacts(run.info.run_id, "model.safetensors", str(runs.folder / "download")))
    assert _digest(kept) == _digest(runs.run / "model.safetensors")
    # Both runs seeded Python's and NumPy's generators from --seed 42; what MLflow drew for itself still differs.
    assert runs.draws[0] != runs.draws[1]


def test_wandb_offline_files_in_the_run_folder(runs):
    """Read with wandb's own reader of its transaction log (`wandb leet inspect`)."""
    (log,) = (runs.run / "wandb").glob("offline-run-*/run-*.wandb")
    read = subprocess.run([str(BIN / "wandb"), "leet", "inspect", "--json", str(log.parent)], capture_output=True,
                          text=True, timeout=60, check=True)
    records = [json.loads(line) for line in read.stdout.splitlines()]
    (started,) = [r["run"] for r in records if r["type"] == "run"]
    assert (started["project"], started["display_name"]) == ("w-env", "run")  # WANDB_PROJECT, the folder's name
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [h["_step"] for h in history if "train/loss" in h] == [2, 4, 6, 8]
    s = summary(runs.run)
    final = next(h for h in history if "final/eval_accuracy" in h)
    assert final["final/eval_accuracy"] == pytest.approx(s["eval"]["accuracy"]) and final["_step"] == 8
    (artifact,) = [r["artifact"] for r in records if r["type"] == "artifact"]
    assert artifact["name"] == "run" and artifact["type"] == "model"
    kept = {e["path"]: e["local_path"] for e in artifact["manifest"]["contents"]}
    assert {"config.yaml", "summary.json", "model.safetensors", "plots/loss.png"} <= set(kept)
    assert Path(kept["model.safetensors"]) == runs.run / "model.safetensors"  # referred to, not copied
    assert any(r["type"] == "exit" for r in records)  # finished


def test_trackio_gets_the_metrics_and_the_final_summary(runs):
    import trackio.utils
    from trackio.sqlite_storage import SQLiteStorage

    assert trackio.utils.TRACKIO_DIR == runs.folder / "trackio"  # its store, outside the run folder
    assert SQLiteStorage.get_runs("acc_trainer") == ["run"]
    logs = SQLiteStorage.get_logs("acc_trainer", "run")
    assert [entry["step"] for entry in logs if "train/loss" in entry] == [2, 4, 6, 8]
    assert logs[-1]["final/best_accuracy"] == pytest.approx(summary(runs.run)["best"]["value"])
    assert SQLiteStorage.get_run_config("acc_trainer", "run")["batch_size"] == 64


def _artifacts(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for item in client.list_artifacts(run_id, path):
        out += _artifacts(client, run_id, item.path) if item.is_dir else [item.path]
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
