"""Faults a user runs into: each one gets one clear line (or a warning), and nothing already written is lost."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import BIN, _env, check, free_port, launch, run_cli, run_forked, run_here, summary

SMALL = ["--model", "mlp", "--train-size", "256", "--eval-size", "64", "--batch-size", "64", "--progress", "none", "--no-plots"]


def test_max_steps_wins_over_epochs(train_in_process):
    """4 steps per epoch and the default 3 epochs (12 steps): --max-steps 14 trains 14 steps, in 4 epochs."""
    s = train_in_process(model="mlp", train_size=256, eval_size=64, batch_size=64, max_steps=14)
    assert s["steps"] == 14 and s["epochs"] == 4 and s["train_samples"] == 14 * 64
    assert [e["step"] for e in s["evals"]] == [4, 8, 12, 14]


def test_bench_output_dir_is_the_bench_folder(tmp_path):
    from acc_trainer.config import ConfigError
    from acc_trainer.tools.bench import parse

    args, cfg = parse(["--output-dir", str(tmp_path / "b"), "--model-args", "{width: 3}", "--metrics", "accuracy,top5"])
    assert args.bench_dir == str(tmp_path / "b") and cfg.output_dir is None
    from acc_trainer.tools.bench import _options

    assert parse(_options(cfg))[1] == cfg  # the flags each measured run gets read back to the same options
    try:
        parse(["--output-dir", "x", "--bench-dir", "y"])
    except ConfigError as e:
        assert "--bench-dir or --output-dir, not both" in str(e)
    else:
        raise AssertionError("both folders were accepted")


FINISHED = [*SMALL, "--max-steps", "4", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """`python -m acc_trainer FINISHED --output-dir RUN` in a fresh process (its module run as -m runs it),
    which then prints on stdout whether the run imported DeepSpeed: (RUN, the process's result). RUN holds
    checkpoints at steps 2 and 4; a test that changes it works on a copy (`copy_of`)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    args = [*FINISHED, "--output-dir", str(out)]
    code = (f"import runpy, sys; sys.argv = ['acc_trainer', *{args!r}]; "
            "runpy.run_module('acc_trainer', run_name='__main__', alter_sys=True); print('deepspeed' in sys.modules)")
    return out, check(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                                     timeout=300))


def copy_of(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def test_no_noise_from_libraries_the_run_does_not_use(tmp_path, finished_run):
    """DeepSpeed (installed by the dev extra) is not imported by a plain run, and resuming does not print
    torch's warning about the pickle protocol of Accelerate's own files."""
    run, first = finished_run
    out = copy_of(run, tmp_path)
    again = check(run_cli(*FINISHED, "--output-dir", out, "--resume", str(out / "checkpoints" / "step-00000002")))
    for result in (first, again):
        assert "real_accelerator" not in result.stderr and "Setting accelerator to CPU" not in result.stderr
        assert "pickle protocol" not in result.stderr and "Warning" not in result.stderr, result.stderr
    # 'deepspeed' in sys.modules once the run has ended; before it, only the run's result line (--progress none)
    assert first.stdout.strip().splitlines()[-1] == "False" and first.stdout.startswith("final eval loss")


def test_one_process_where_two_were_meant_is_said(tmp_path):
    result = check(launch(*SMALL, "--max-steps", "2", "--output-dir", tmp_path / "run",
                          launcher_args=["--num_processes", "2"]))
    assert summary(tmp_path / "run")["world_size"] == 1
    assert ("acc-trainer: warning: accelerate launch started ONE process (without --multi_gpu it starts several only "
            "on GPUs); for N: accelerate launch --multi_gpu --num_processes N -m acc_trainer") in result.stderr


class _RunsCode:
    """A pickle that would create a file when unpickled without weights-only protection."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_whose_rng_states_cannot_be_restored_is_refused(tmp_path, main_in_process, finished_run):
    from acc_trainer.outputs.checkpoints import write_sums

    out = copy_of(finished_run[0], tmp_path)  # a finished run, FINISHED: checkpoints at steps 2 and 4
    checkpoint = out / "checkpoints" / "step-00000002"
    marker = tmp_path / "code-ran"
    with open(checkpoint / "random_states_0.pkl", "wb") as f:
        pickle.dump({"random_state": _RunsCode(marker)}, f)
    write_sums(checkpoint)  # its digests rewritten to match: the states are checked all the same
    code, _, stderr = main_in_process(*FINISHED, "--output-dir", out, "--resume", checkpoint)
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert (f"acc-trainer: error: checkpoint {checkpoint}: the random number generator states of process 0 cannot be "
            "restored (random_states_0.pkl: it holds more than plain data and was refused)") in stderr
    assert not marker.exists()  # the pickle's code never ran
    # A file of the right kind holding other states (not this checkpoint's) is refused too.
    import torch

    states = torch.load(checkpoint.parent / "step-00000004" / "random_states_0.pkl", weights_only=False)
    states["torch_manual_seed"] = torch.random.default_generator.get_state()[:0]  # empty: set_rng_state fails
    torch.save(states, checkpoint / "random_states_0.pkl")
    write_sums(checkpoint)
    code, _, stderr = main_in_process(*FINISHED, "--output-dir", out, "--resume", checkpoint)
    assert code == 2 and "the random number generator states of process 0 cannot be restored" in stderr


def test_two_runs_on_one_folder_and_a_killed_runs_lock(tmp_path):
    out = tmp_path / "run"
    job = [*SMALL, "--model", "lenet", "--train-size", "2048", "--max-steps", "200", "--checkpoint-every", "5",
           "--output-dir", out]
    from conftest import _env

    first = subprocess.Popen([sys.executable, "-m", "acc_trainer", *map(str, job)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env=_env())
    try:
        deadline = time.monotonic() + 120
        while not list((out / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)  # paused mid-run, holding its lock, whatever the machine's speed
        assert first.poll() is None, "the first run ended before the second started"
        second = run_forked(*SMALL, "--max-steps", "4", "--output-dir", out)
        assert second.returncode == 2
        assert second.stderr == (f"acc-trainer: error: --output-dir {out} is in use by another run (process "
                                 f"{first.pid}); wait for it to end, or choose another folder\n")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The killed run held the lock; the operating system released it with the process (this process takes
    # it now, continuing the run to its end).
    resumed = check(run_here(*job, "--resume", "auto"))
    assert summary(out)["resumed_from"] and summary(out)["steps"] == 200, resumed.stderr


def _with_file_size_limit(limit: int):
    """A child whose files cannot grow past `limit` bytes: writes fail with EFBIG (SIGXFSZ ignored)."""
    import resource

    def limit_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_files


def test_a_checkpoint_that_does_not_fit_on_the_disk(tmp_path):
    """The MLP's Adam state (12.6 MB) cannot be written under an 8 MB file size limit."""
    out = tmp_path / "run"
    result = run_forked(*SMALL, "--plots", "--max-steps", "8", "--checkpoint-every", "4", "--log-every", "2",
                        "--output-dir", out, before=_with_file_size_limit(8 << 20))
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"acc-trainer: writing checkpoint {out}/checkpoints/step-00000004 failed: File too large (the file size "
        "limit, ulimit -f, is 8,388,608 bytes); no complete checkpoint was written")
    assert "Traceback" not in result.stderr
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the half-written checkpoint is gone
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "eval_loss" in r) for r in records] == [(2, False), (4, False), (4, True)]
    assert (out / "plots" / "loss.png").exists()  # what the run did up to then is kept, and drawn


def test_final_weights_that_do_not_fit(tmp_path):
    out = tmp_path / "run"
    result = run_forked(*SMALL, "--max-steps", "4", "--output-dir", out, before=_with_file_size_limit(4 << 20))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"acc-trainer: writing the final weights {out}/model.safetensors failed: File too large (the file size limit, "
        "ulimit -f, is 4,194,304 bytes); no checkpoint was saved")
    assert (out / "metrics.jsonl").exists()


def _photos_with_a_truncated_one(root):
    """An ImageFolder of real PNGs (3 classes; 16 training, 5 evaluation images each) in which one training
    image is cut in half."""
    from test_data import write_imagefolder

    write_imagefolder(root, {"train": 16, "val": 5})
    broken = root / "train" / "green" / "5.png"
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])
    return broken


PHOTOS = ["--dataset", "imagefolder", "--image-size", "16", "--model", "mlp", "--batch-size", "8", "--epochs", "2",
          "--progress", "none"]


def test_an_unreadable_sample_stops_with_its_name_after_a_checkpoint(tmp_path):
    broken = _photos_with_a_truncated_one(tmp_path / "photos")
    out = tmp_path / "run"
    result = run_forked(*PHOTOS, "--data-dir", tmp_path / "photos", "--output-dir", out)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"acc-trainer: training sample {broken} (OSError: image file is truncated")
    step = int(line.split("cannot be read, at step ")[1].split(";")[0])
    assert line.endswith(f"checkpoint saved in {out}/checkpoints/step-{step - 1:08d}; acc-trainer check-data lists "
                         "every such sample; --skip-bad-samples skips them")
    assert (out / "checkpoints" / f"step-{step - 1:08d}" / "trainer_state.json").exists()

    # --skip-bad-samples: the steps whose batch held it are skipped, on every epoch, counted and named.
    skipping = check(run_here(*PHOTOS, "--data-dir", tmp_path / "photos", "--output-dir", tmp_path / "skip",
                              "--skip-bad-samples"))
    s = summary(tmp_path / "skip")
    assert s["bad_sample_steps"] == len(s["unreadable_samples"]) == 2 and s["steps"] == 12, skipping.stderr
    assert all(name.startswith(str(broken)) for name in s["unreadable_samples"])

    # acc-trainer check-data lists it before a long run starts.
    listed = run_here("check-data", *PHOTOS, "--data-dir", tmp_path / "photos")
    assert listed.returncode == 1
    assert f"unreadable training sample: {broken} (OSError: image file is truncated" in listed.stdout
    assert "training: 47 of 48 samples read" in listed.stdout and "evaluation: 15 of 15 samples read" in listed.stdout


def test_an_unreadable_sample_stops_every_process(tmp_path):
    broken = _photos_with_a_truncated_one(tmp_path / "photos")
    out = tmp_path / "run"
    result = launch(*PHOTOS, "--data-dir", tmp_path / "photos", "--output-dir", out,
                    launcher_args=["--multi_gpu", "--num_processes", "2"])
    assert result.returncode != 0
    assert f"acc-trainer: training sample {broken} (OSError: image file is truncated" in result.stderr
    assert result.stderr.count("cannot be read, at step") == 1  # said once, by the main process
    assert list((out / "checkpoints").glob("step-*"))


LINREG = ["--model", "linreg", "--dataset", "linear", "--eval-size", "64", "--batch-size", "32", "--optimizer", "sgd",
          "--progress", "none"]


def test_run_files_that_do_not_fit(tmp_path):
    """metrics.jsonl, then summary.json, cannot grow past the file size limit: one line each, naming the
    file and the checkpoint to resume from; what was written before is kept."""
    def under_limit(limit, *args):
        return run_forked(*LINREG, *args, before=_with_file_size_limit(limit))

    # A log line every step fills metrics.jsonl (20 kB) near step 80; linreg's checkpoints (15 kB) fit.
    out = tmp_path / "log"
    result = under_limit(20_000, "--train-size", "4096", "--max-steps", "200", "--log-every", "1",
                         "--checkpoint-every", "10", "--output-dir", out)
    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert result.stderr == (
        f"acc-trainer: writing {out}/metrics.jsonl failed: File too large (the file size limit, ulimit -f, is 20,000 "
        f"bytes); the last complete checkpoint is {last} (continue with --resume auto --output-dir {out}); the plots "
        "could not be written either (the same reason)\n")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()[:-1]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > int(last.name[5:])  # every whole line kept

    # Five evaluations and no checkpoint: the summary (2.06 kB) is the first file that does not fit (config.yaml, every
    # option: 1.89 kB).
    out = tmp_path / "summary"
    result = under_limit(1950, "--train-size", "256", "--epochs", "5", "--log-every", "100", "--output-dir", out)
    assert result.returncode == 1
    assert result.stderr == (f"acc-trainer: writing {out}/summary.json failed: File too large (the file size limit, "
                             "ulimit -f, is 1,950 bytes); no complete checkpoint was written\n")
    assert sorted(p.name for p in out.iterdir()) == [".lock", "SHA256SUMS", "config.yaml", "metrics.jsonl",
                                                     "model.safetensors"]


def _small_disk(path, size):
    """A tmpfs of `size` at `path` (root only); skips the test where it cannot be mounted."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("a small file system needs root and mount")


def test_a_checkpoint_on_a_full_disk(tmp_path):
    """The issue's case on a real file system: 24 MB hold one checkpoint of the MLP with Adam (19 MB), not two."""
    disk = tmp_path / "disk"
    _small_disk(disk, "24m")
    try:
        out = disk / "run"
        result = run_forked(*SMALL, "--plots", "--batch-size", "32", "--train-size", "512", "--max-steps", "12",
                            "--log-every", "2", "--checkpoint-every", "4", "--keep-last", "1", "--output-dir", out)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stderr == (f"acc-trainer: writing checkpoint {out}/checkpoints/step-00000008 failed: No space "
                                 f"left on device; the last complete checkpoint is {out}/checkpoints/step-00000004\n")
        assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000004"]  # no .tmp- folder left
        assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6, 8]
        assert (out / "plots" / "loss.png").exists()
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_final_weights_that_do_not_fit_on_two_processes(tmp_path):
    """Only the main process writes them: it stops alone, without waiting for the others at a barrier
    (which failed with gloo's "Connection closed by peer" once they had finished); the launcher ends them."""
    out = tmp_path / "run"
    cmd = [str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port()), "--multi_gpu", "--num_processes",
           "2", "-m", "acc_trainer", *SMALL, "--max-steps", "4", "--output-dir", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), preexec_fn=_with_file_size_limit(4 << 20),
                            timeout=300)
    assert result.returncode == 1
    said = [line for line in result.stderr.splitlines() if line.startswith(("acc-trainer", "[rank"))]
    assert said == [f"acc-trainer: writing the final weights {out}/model.safetensors failed: File too large (the file "
                    "size limit, ulimit -f, is 4,194,304 bytes); no checkpoint was saved"], result.stderr[-3000:]


def test_two_runs_started_together_on_one_folder(tmp_path):
    """The issue's case: both pass the start-up check on an empty folder; only one may write to it."""
    out = tmp_path / "run"
    runs = [subprocess.Popen([sys.executable, "-m", "acc_trainer", *SMALL, "--max-steps", "4", "--log-every", "1",
                              "--output-dir", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=_env()) for _ in range(2)]
    results = [(run.wait(timeout=300), run.stderr.read()) for run in runs]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert refused.count("\n") == 1 and refused.startswith(f"acc-trainer: error: --output-dir {out} "), refused
    assert "is in use by another run" in refused or "already holds a run" in refused  # still running, or done
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3, 4, 4]


def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path, main_in_process):
    """A parent that is a file, and a read-only file system (mounted here where root can): one line, exit 2,
    nothing written."""
    (tmp_path / "a file").write_text("")
    code, _, stderr = main_in_process(*SMALL, "--max-steps", "2", "--output-dir", tmp_path / "a file" / "run")
    assert (code, stderr) == (2, f"acc-trainer: error: --output-dir {tmp_path}/a file/run cannot be written (Not a "
                                 f"directory: {tmp_path}/a file is not a folder); choose another folder\n")
    disk = tmp_path / "read-only"
    _small_disk(disk, "1m")
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        code, _, stderr = main_in_process(*SMALL, "--max-steps", "2", "--output-dir", disk / "run")
        assert (code, stderr) == (2, f"acc-trainer: error: --output-dir {disk}/run cannot be written (Read-only file "
                                     "system); choose another folder\n")
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_class_labels_out_of_range_are_one_line_and_a_stray_one_a_note(tmp_path, torch_on_one_thread):
    """A negative label, or one past the classes a dataset declares, is one line at start (not an IndexError
    inside the loss at whatever step first draws it); a count inferred from the largest label while fewer labels
    appear gets a note: one label of 57 in a 4-class set would otherwise make a 58-class head in silence."""
    from conftest import reset_accelerate

    import acc_trainer
    from acc_trainer.config import ConfigError

    class Declared(torch.utils.data.TensorDataset):
        classes = ["a", "b", "c", "d"]

    x = torch.randn(64, 4)

    def labels(last):
        return torch.tensor([0, 1, 2, 3] * 15 + [0, 1, 2, last])

    with pytest.raises(ConfigError, match=r"^the training labels of TensorDataset include -3 \(sample 63\): class "
                                          r"labels run from 0 to the number of classes - 1$"):
        acc_trainer.fit(torch.nn.Linear(4, 4), torch.utils.data.TensorDataset(x, labels(-3)))
    with pytest.raises(ConfigError, match=r"^the evaluation labels of Declared include 57 \(sample 63\), and Declared "
                                          r"declares 4 classes \(labels 0 to 3\)$"):
        acc_trainer.fit(torch.nn.Linear(4, 4), Declared(x, labels(3)), Declared(x, labels(57)))
    reset_accelerate()
    s = acc_trainer.fit(torch.nn.Linear(4, 58), torch.utils.data.TensorDataset(x, labels(57)), max_steps=1,
                        batch_size=16, progress="none", plots=False, output_dir=str(tmp_path / "run"))
    reset_accelerate()
    assert s["notes"] == ["note: 58 classes inferred from the largest training label (57), but only 5 distinct labels "
                          "appear; give the dataset `classes` or `num_classes` to declare them"]


SLOW_DATA = '''
import time

import torch


class Slow(torch.utils.data.Dataset):
    """Images of two classes, 5 ms each to read."""

    classes = ["even", "odd"]

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.full((3, 8, 8), float(i % 7)), i % 2


def load(eval_size=8):
    return Slow(64), Slow(eval_size)
'''


def test_predict_stopped_by_sigterm_leaves_no_temporary_files(tmp_path):
    """The rows go to a folder of their own beside the output until the file is whole; a SIGTERM midway removes
    it and says so in one line, exit 143."""
    from conftest import _env

    (tmp_path / "slow.py").write_text(SLOW_DATA)
    run = tmp_path / "run"
    check(run_forked("--model", "mlp", "--dataset", "slow:load", "--batch-size", "32", "--max-steps", "1", "--no-plots",
                     "--progress", "none", "--output-dir", run, cwd=tmp_path))
    output = tmp_path / "rows.jsonl"
    predicting = subprocess.Popen([sys.executable, "-m", "acc_trainer", "predict", str(run), "--output", str(output),
                                   "--eval-batch-size", "100", "--dataset-args", "{eval_size: 4000}"], cwd=tmp_path,
                                  env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".predict-*")) and time.time() < deadline and predicting.poll() is None:
        time.sleep(0.05)
    assert list(tmp_path.glob(".predict-*")), "predict never started writing"
    predicting.send_signal(signal.SIGTERM)
    _, stderr = predicting.communicate(timeout=120)
    assert predicting.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == f"acc-trainer: predict stopped by SIGTERM; nothing was written to {output}"
    assert not list(tmp_path.glob(".predict-*")) and not output.exists()
