"""Streams (iterable datasets) keep every guarantee: the same steps on 1, 2 and 3 processes, evaluation of every
sample once, bit-identical resume, checkpoints that continue on another number of processes, and faults in
one line. The streams are a user's IterableDataset (with and without a saved position; variable-length text
with the text example's padding collate and model; dict batches for a model that takes its targets and returns
its own loss) and Hugging Face `datasets` streams of parquet shards the
tests write (tests/streams_data.py).

Every run trains one small regression MLP (no dropout) with SGD for 2 epochs of 8 steps (100 samples, global
batch 12: 4 left out per epoch), a checkpoint at step 5. The runs are made once, in three phases: on 1
process in this process, on 2 processes forked from it (conftest.forked), then 1 process again and 3 forked (the
elastic resumes need the checkpoints of the others).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import streams_data
import torch
from conftest import REPO, _env, check, forked, metrics, one_thread, reset_accelerate, run_here, summary
from safetensors.torch import load_file

KINDS = ("numbers", "positioned", "parquet", "parquet_shuffled", "map", "text", "own_loss")
OPTIONS = {"epochs": 2, "batch_size": 12, "checkpoint_every": "5", "log_every": 2}
MID = "checkpoints/step-00000005"


def jobs(out: Path, parquet: Path, kinds=KINDS, workers: int = 0) -> list[dict]:
    """A full run of each kind and its resume from its own step-5 checkpoint. The user's streams are read by a
    thread (they count what they produce in this process), the `datasets` streams by a reader worker process
    with `workers` 1."""
    made = []
    for kind in kinds:
        options = {**OPTIONS, "num_workers": workers} if kind.startswith("parquet") else OPTIONS
        made.append({"name": kind, "data": kind, "parquet": str(parquet), "options": options})
        made.append({"name": f"{kind}_resumed", "data": kind, "parquet": str(parquet), "options": options,
                     "resume": str(out / kind / MID)})
    return made


def elastic(source: Path, parquet: Path, kinds=("map", "parquet")) -> list[dict]:
    return [{"name": f"{kind}_from_{source.name}", "data": kind, "parquet": str(parquet), "options": OPTIONS,
             "resume": str(source / kind / MID)} for kind in kinds]


def in_process(jobs_: list[dict], out: Path) -> None:
    import stream_probe

    out.mkdir(parents=True, exist_ok=True)
    reset_accelerate()
    try:
        with one_thread():
            stream_probe.run_jobs(jobs_, out)
    finally:
        reset_accelerate()


def launched(processes: int, jobs_: list[dict], out: Path) -> None:
    import stream_probe

    out.mkdir(parents=True, exist_ok=True)
    forked(stream_probe.run_jobs, jobs_, out, processes=processes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("streams")
    parquet, broken = root / "parquet", root / "broken"
    streams_data.write_parquet(parquet)
    streams_data.write_parquet(broken)
    good_shard = (broken / "train-00001.parquet").read_bytes()
    (broken / "train-00001.parquet").write_bytes(b"not a parquet file")
    one, two, one_more, three = root / "one", root / "two", root / "one_more", root / "three"
    inference = [{"name": f"inference_{kind}", "data": kind, "parquet": str(parquet), "inference": True}
                 for kind in ("map", "parquet")]
    in_process(jobs(one, parquet, workers=1) + inference + [
        {"name": "max_steps", "data": "parquet", "parquet": str(parquet), "options": {**OPTIONS, "max_steps": 11}}], one)
    launched(2, jobs(two, parquet) + elastic(one, parquet) + inference + [
        {"name": "broken", "data": "parquet", "parquet": str(broken), "options": {**OPTIONS, "num_workers": 1}},
        {"name": "by_process", "data": "by_process", "options": OPTIONS}], two)
    (broken / "train-00001.parquet").write_bytes(good_shard)  # repaired: the stopped run continues
    in_process(elastic(two, parquet) + [{"name": "repaired", "data": "parquet", "parquet": str(broken),
                                         "options": OPTIONS, "resume": str(two / "broken" / "checkpoints/step-00000003")}],
               one_more)
    launched(3, elastic(two, parquet), three)
    return {"one": one, "two": two, "one_more": one_more, "three": three, "parquet": parquet}


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model.safetensors")


def largest_difference(a: Path, b: Path) -> float:
    first, second = weights(a), weights(b)
    assert first.keys() == second.keys()
    return max((first[k] - second[k]).abs().max().item() for k in first)


def test_streams_train_alike_on_one_and_two_processes(runs):
    """--batch-size is the global batch of a stream too: the same steps on 1 and 2 processes (1e-5), whatever
    the shards (three of 37, 45 and 18 rows), every process making as many; every evaluation sample once. The
    `datasets` streams are read by a worker process on 1 process and by a thread on 2."""
    for kind in KINDS:
        one, two = summary(runs["one"] / kind), summary(runs["two"] / kind)
        assert largest_difference(runs["one"] / kind, runs["two"] / kind) < 1e-5, kind
        assert one["steps"] == two["steps"] == 16 and one["epochs"] == two["epochs"] == 2, kind
        assert two["world_size"] == 2 and two["ranks_agree"]
        assert one["train_samples"] == two["train_samples"] == 16 * 12
        assert one["eval_samples"] == two["eval_samples"] == streams_data.EVAL, kind
        # The weights end up to 6.3e-7 apart (float32 sums of the gradients in another order: "map" measured, the same
        # on the code before the sub-package split), which moves a loss of 2.56 by 1.1e-6: relative, not absolute.
        assert abs(one["eval"]["loss"] - two["eval"]["loss"]) <= 1e-6 * max(1.0, abs(one["eval"]["loss"])), kind
    for run in runs["three"].iterdir():  # 31 samples on 3 processes (global evaluation batches of 12)
        if run.is_dir():
            assert summary(run)["eval_samples"] == streams_data.EVAL
    # Training changed the model: the comparison above is not of untouched weights.
    before = streams_data.model().state_dict()
    assert max((before[k] - weights(runs["one"] / "parquet")[k]).abs().max().item() for k in before) > 1e-2


def test_a_streams_length_is_learnt_and_max_steps_is_enough(runs):
    """No __len__: the first epoch is read to its end (8 whole batches of 100 samples), the progress then knows
    the run's 16 steps; --max-steps 11 runs into the second epoch and stops there."""
    full, short = summary(runs["one"] / "parquet"), summary(runs["one"] / "max_steps")
    assert [e["step"] for e in full["evals"]] == [8, 16]
    assert short["steps"] == 11 and short["epochs"] == 2 and [e["step"] for e in short["evals"]] == [8, 11]
    assert [r["step"] for r in metrics(runs["one"] / "max_steps") if "loss" in r][-1] == 11


@pytest.mark.parametrize("where", ["one", "two"])
def test_a_resumed_stream_is_the_same_run(runs, where):
    """Resumed from the checkpoint of step 5 (in the first epoch, whose length is not yet known), every
    stream ends bit-identical to its uninterrupted run. Streams that save their position load it (the
    user's stream produces none of the 60 samples consumed again); the others are read again and skipped."""
    out = runs[where]
    for kind in KINDS:
        assert largest_difference(out / kind, out / f"{kind}_resumed") == 0.0, kind
        resumed = summary(out / f"{kind}_resumed")
        assert resumed["resumed_from"].endswith(MID) and resumed["steps"] == 16
        assert resumed["evals"] == summary(out / kind)["evals"], kind
        how = resumed["stream_resume"]
        if kind == "map":
            assert how is None
            continue
        assert how["samples"] == 60
        assert how["how"] == ("saved state" if kind in ("positioned", "parquet") else "skipped"), kind
    produced = {kind: json.loads((out / kind / "produced.json").read_text()) for kind in
                ("numbers", "numbers_resumed", "positioned", "positioned_resumed")}
    assert produced["numbers_resumed"] == produced["numbers"]  # read again from the epoch's start
    assert produced["positioned_resumed"] == produced["positioned"] - 60  # from its saved position


def test_a_checkpoint_continues_on_another_number_of_processes(runs):
    """2 -> 1, 1 -> 2 and 2 -> 3 processes, map-style and streams: the same samples make the remaining steps,
    the final weights within 1e-5 of the uninterrupted run, the interval's loss carried over whole."""
    for resumed, source in ((runs["one_more"], runs["two"]), (runs["two"], runs["one"]), (runs["three"], runs["two"])):
        for kind in ("map", "parquet"):
            run = resumed / f"{kind}_from_{source.name}"
            result, original = summary(run), summary(source / kind)
            assert result["world_size"] != original["world_size"]
            assert largest_difference(run, source / kind) < 1e-5, run
            assert any(f"written by {original['world_size']} process(es) and continues on {result['world_size']}" in n
                       for n in result["notes"])
            logged = {r["step"]: r["loss"] for r in metrics(source / kind) if "loss" in r}
            after = {r["step"]: r["loss"] for r in metrics(run) if "loss" in r}
            assert 6 in after and abs(after[6] - logged[6]) < 1e-5  # its interval began before the checkpoint
            assert [e["samples"] for e in result["evals"]] == [streams_data.EVAL] * 2


def test_an_unreadable_shard_stops_every_process_after_a_checkpoint(runs):
    """The second shard is not parquet: both processes stop at the step that reaches it (samples 37 on: step 4),
    with one line naming the file, after a checkpoint of step 3; repaired, the run continues to the same end."""
    stopped = json.loads((runs["two"] / "broken.stopped.json").read_text())
    assert stopped["code"] == 1 and "\n" not in stopped["message"]
    assert "train-00001.parquet" in stopped["message"] and "at step 4" in stopped["message"]
    assert "step-00000003" in stopped["message"]
    assert (runs["two"] / "broken" / "checkpoints" / "step-00000003" / "model.safetensors").is_file()
    repaired = runs["one_more"] / "repaired"
    assert summary(repaired)["steps"] == 16
    assert largest_difference(repaired, runs["two"] / "parquet") < 1e-5


def test_a_finished_model_evaluates_and_predicts_a_stream(runs):
    """acc_trainer.after_training.inference on a stream: every sample once (31 in global batches of 8 on 2 processes), the
    results and the predictions, in the stream's order, those of the same samples held in memory."""
    reference = json.loads((runs["one"] / "inference_map.json").read_text())
    for where in ("one", "two"):
        streamed = json.loads((runs[where] / "inference_parquet.json").read_text())
        assert streamed["evaluate"]["samples"] == reference["evaluate"]["samples"] == streams_data.EVAL
        assert abs(streamed["evaluate"]["loss"] - reference["evaluate"]["loss"]) < 1e-6
        assert [r["index"] for r in streamed["predict"]] == list(range(streams_data.EVAL))
        assert all(abs(a["output"] - b["output"]) < 1e-6 for a, b in zip(streamed["predict"], reference["predict"]))


def test_a_stream_split_by_process_is_refused(runs):
    stopped = json.loads((runs["two"] / "by_process.stopped.json").read_text())
    assert stopped["code"] == 2 and "do not split it by process" in stopped["message"]
    assert not (runs["two"] / "by_process").exists()  # refused before the run folder was made


# ----------------------------------------------------------------------------------------- in this process


def test_empty_and_short_streams_are_one_line(tmp_path, monkeypatch):
    """At start, before anything is written: the command line exits 2 with one line."""
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    for samples, expected in ((0, "is empty"), (5, "gives 5 samples, fewer than one global batch (--batch-size 12)")):
        result = run_here("--model", "streams_data:model", "--dataset", "streams_data:factory", "--dataset-args",
                          f"{{kind: short, samples: {samples}}}", "--batch-size", "12", "--output-dir", tmp_path / "run")
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not (tmp_path / "run").exists()


def test_a_schedule_over_the_run_needs_its_length(tmp_path, torch_on_one_thread):
    from acc_trainer import fit
    from acc_trainer.config import ConfigError

    reset_accelerate()
    with pytest.raises(ConfigError, match="--scheduler cosine needs the run's length.*give --max-steps"):
        fit(streams_data.model(), streams_data.Numbers(), scheduler="cosine", epochs=2, batch_size=12,
            output_dir=str(tmp_path / "run"), progress="none")
    reset_accelerate()
    # The step schedule counts epochs, whose length such a stream does not say: one line, not a TypeError
    # from inside the schedule, and nothing written.
    with pytest.raises(ConfigError, match="--scheduler step decays every --lr-step-epochs epochs.*no __len__"):
        fit(streams_data.model(), streams_data.Numbers(), scheduler="step", max_steps=4, batch_size=12,
            output_dir=str(tmp_path / "step"), progress="none")
    assert not (tmp_path / "step").exists()
    reset_accelerate()


def test_an_iterator_that_can_be_read_only_once_is_refused(tmp_path, torch_on_one_thread):
    """A generator (or a database cursor) gives its samples once: the checks at start would take the first ones and
    the second epoch would get none. One line, before anything is written."""
    from acc_trainer import fit
    from acc_trainer.config import ConfigError

    reset_accelerate()
    for train, eval_, split in ((iter(streams_data.Numbers()), None, "training"),
                                (streams_data.Numbers(), iter(streams_data.Numbers(31, 2)), "evaluation")):
        with pytest.raises(ConfigError, match=rf"the {split} data of \w+ is an iterator \(generator\), which can be read "
                                              r"only once .* give an object whose __iter__ starts it anew"):
            fit(streams_data.model(), train, eval_, epochs=2, batch_size=12, output_dir=str(tmp_path / "run"),
                progress="none")
        assert not (tmp_path / "run").exists()
    reset_accelerate()


def test_an_evaluation_that_fails_is_made_again_on_resume(tmp_path, torch_on_one_thread):
    """The evaluation stream cannot be read after the last step: the checkpoint then is of the epoch's end before
    its evaluation, so the resumed run evaluates it, and ends with the uninterrupted run's evaluations."""
    from acc_trainer import fit
    from acc_trainer.stopping import TrainingStopped

    options = {"epochs": 2, "batch_size": 12, "optimizer": "sgd", "lr": 0.05, "progress": "none", "plots": False}
    reset_accelerate()
    full = fit(streams_data.model(), streams_data.Numbers(), streams_data.Numbers(31, 2), output_dir=str(tmp_path / "full"),
               **options)
    reset_accelerate()
    eval_stream = streams_data.FailsOnce(31, 2, fail_at=3)  # the first pass is the check at start
    with pytest.raises(TrainingStopped, match=r"evaluation stream .* cannot be read .*eval-shard-0.bin.*at step 16"):
        fit(streams_data.model(), streams_data.Numbers(), eval_stream, output_dir=str(tmp_path / "run"), **options)
    reset_accelerate()
    resumed = fit(streams_data.model(), streams_data.Numbers(), streams_data.Numbers(31, 2),
                  output_dir=str(tmp_path / "run"), resume="auto", **options)
    reset_accelerate()
    assert resumed["resumed_from"].endswith("step-00000016") and resumed["evals"] == full["evals"]
    assert largest_difference(tmp_path / "full", tmp_path / "run") == 0.0


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bug_in_the_streams_code_keeps_its_traceback(tmp_path, torch_on_one_thread, workers):
    from acc_trainer import fit

    class Buggy(streams_data.Numbers):
        def __iter__(self):
            for i, sample in enumerate(super().__iter__()):
                if i == 30:
                    raise KeyError("the user's bug")
                yield sample

    reset_accelerate()
    with pytest.raises(KeyError, match="the user's bug") as raised:
        fit(streams_data.model(), Buggy(), epochs=1, batch_size=12, output_dir=str(tmp_path / "run"), progress="none",
            num_workers=workers)
    reset_accelerate()
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "raised in epoch 1, after optimizer step 2" in notes
    assert ("stream reader (a DataLoader worker process)" in notes and "in __iter__" in notes) == bool(workers)


def test_a_saved_position_a_checkpoint_cannot_hold_is_one_line(tmp_path, torch_on_one_thread):
    from acc_trainer import fit
    from acc_trainer.config import ConfigError

    class TensorState(streams_data.Positioned):
        def state_dict(self):
            return {"read": torch.tensor(self.read)}

    reset_accelerate()
    with pytest.raises(ConfigError, match=r"its state_dict\(\) must be plain data"):
        fit(streams_data.model(), TensorState(), epochs=1, batch_size=12, output_dir=str(tmp_path / "run"), progress="none")
    reset_accelerate()
    assert not (tmp_path / "run").exists()


def loaders(dataset, world: int, batch: int = 12, parts: int = 2, train: bool = True, collate=None):
    """One StreamLoader per process of `world`, each agreeing with the others as when all have the same stream."""
    from acc_trainer.data.streams import StreamLoader

    return [StreamLoader(dataset, batch, parts, world, rank, collate, torch.device("cpu"),
                         (lambda values: [v * world for v in values]) if world > 1 else None, "test", train=train)
            for rank in range(world)]


def test_each_process_takes_its_own_slice_of_every_micro_batch():
    """Over the processes' shares, each step's micro-batches are the stream's next 12 samples in order, no
    sample twice; the 4 samples that do not fill a last step are left out; evaluation shares cover every
    sample once, an empty share marked as such."""
    stream = streams_data.Numbers()
    order = stream.order()
    expected = stream.x[order]
    for world in (1, 2, 3):
        shares = [list(loader.epoch(0, {"epoch": 0, "samples": 0, "state": None})) for loader in loaders(stream, world)]
        assert all(len(s) == len(shares[0]) == 16 for s in shares)  # 8 steps x 2 micro-batches, on every process
        seen = torch.cat([torch.cat([s[i][0] for s in shares]) for i in range(16)])
        assert torch.equal(seen, expected[:96])
    evaluation = [list(loader) for loader in loaders(streams_data.Numbers(31, 2), 3, batch=12, parts=1, train=False)]
    last = [batches[-1] for batches in evaluation]
    assert [b.real for b in last] == [3, 2, 2]  # 31 = 12 + 12 + 7
    assert sum(b.real for batches in evaluation for b in batches) == 31


def test_a_stream_of_another_length_on_one_process_is_one_line():
    from acc_trainer.config import ConfigError
    from acc_trainer.data.streams import StreamLoader

    # The other process always has a step: at this one's end, one of the two has none.
    loader = StreamLoader(streams_data.Numbers(), 12, 1, 2, 0, None, torch.device("cpu"),
                          lambda values: [values[0] + 1, values[1]], "test")
    with pytest.raises(ConfigError, match="gives the processes different numbers of samples"):
        list(loader.epoch(0, {"epoch": 0, "samples": 0, "state": None}))


def test_the_loader_reads_ahead_while_a_step_trains():
    """While the first step is being trained (the consumer holds it), the reader thread prepares the next ones."""
    stream = streams_data.Numbers()
    before = streams_data.Numbers.produced
    batches = loaders(stream, 1, parts=1)[0].epoch(0, {"epoch": 0, "samples": 0, "state": None})
    next(batches)
    deadline = time.monotonic() + 20
    while streams_data.Numbers.produced - before < 3 * 12 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert streams_data.Numbers.produced - before >= 3 * 12  # this step and 2 ahead
    batches.close()
    assert not [t for t in threading.enumerate() if t.name == "acc_trainer-stream"]


def test_a_shuffled_datasets_stream_is_reshuffled_every_epoch(tmp_path):
    streams_data.write_parquet(tmp_path)
    stream, _ = streams_data.datasets("parquet_shuffled", tmp_path)
    loader = loaders(stream, 1, parts=1, collate=streams_data.pairs)[0]

    def epoch(e: int) -> torch.Tensor:
        return torch.cat([x for x, _ in loader.epoch(e, {"epoch": e, "samples": 0, "state": None})])

    first, again, second = epoch(0), epoch(0), epoch(1)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    assert len(first) == len(second) == 96


def test_the_large_data_page_runs_as_written(tmp_path, monkeypatch):
    """docs/large-data.md's commands, in a copy of examples/, the training one shorter (--max-steps 100)."""
    import shlex
    import subprocess
    import sys

    from test_readme import bash_block

    lines = (REPO / "docs" / "large-data.md").read_text().splitlines()
    write, train = bash_block(lines, lines.index("```bash"))
    examples = tmp_path / "examples"
    examples.mkdir()
    (examples / "large_data.py").write_text((REPO / "examples" / "large_data.py").read_text())
    folder, _, command = write.partition(" && ")
    assert folder == "cd examples" and command.startswith("python large_data.py ")
    check(subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=examples, capture_output=True, text=True))
    assert len(list((examples / "shards").glob("train-*.parquet"))) == 8
    words = shlex.split(train.partition(" && ")[2])
    assert words[0] == "acc-trainer"
    monkeypatch.syspath_prepend(str(examples))
    result = run_here(*words[1:], "--max-steps", "100", "--progress", "none", cwd=examples)
    assert result.returncode == 0, result.stderr[-3000:]
    done = summary(examples / "runs" / "stream")
    assert done["steps"] == 100 and done["eval_samples"] == 2000 and done["eval"]["accuracy"] > 0.6
    assert (examples / "runs" / "stream" / "checkpoints" / "step-00000100").is_dir()


def test_the_reader_worker_returns_samples_as_they_were(torch_on_one_thread):
    """--num-workers 1: tensors travel as numpy arrays, except what numpy cannot hold (bfloat16) and tensor
    subclasses (torchvision's BoundingBoxes keep their class and format); a sample that cannot travel is an
    error of this step, not a hang."""
    from torchvision import tv_tensors

    from acc_trainer.data.streams import StreamLoader

    class Boxes(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(6):
                boxes = tv_tensors.BoundingBoxes([[0, 0, i + 1, i + 1]], format="XYXY", canvas_size=(8, 8))
                yield {"boxes": boxes, "half": torch.full((2,), i, dtype=torch.bfloat16), "id": f"s{i}"}

    loader = StreamLoader(Boxes(), 3, 1, 1, 0, lambda samples: samples, torch.device("cpu"), None, "test", workers=1)
    batches = list(loader.epoch(0, {"epoch": 0, "samples": 0, "state": None}))
    samples = [s for batch in batches for s in batch]
    assert [s["id"] for s in samples] == [f"s{i}" for i in range(6)]
    assert all(type(s["boxes"]) is tv_tensors.BoundingBoxes and s["boxes"].format.value == "XYXY" for s in samples)
    assert all(s["half"].dtype == torch.bfloat16 and s["half"][0].item() == i for i, s in enumerate(samples))

    class Unpicklable(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(2), (lambda: None)

    loader = StreamLoader(Unpicklable(), 1, 1, 1, 0, None, torch.device("cpu"), None, "test", workers=1)
    with pytest.raises(Exception, match="pickle|lambda"):
        list(loader.epoch(0, {"epoch": 0, "samples": 0, "state": None}))


def test_a_map_style_evaluation_that_fails_is_made_again_on_resume(tmp_path, torch_on_one_thread):
    """The same for a dataset held in memory: the epoch-1 evaluation reads a sample that cannot be opened, the run
    stops after a checkpoint of step 8; resumed, it evaluates epoch 1 before training epoch 2."""
    from torch.utils.data import Dataset

    from acc_trainer import fit
    from acc_trainer.stopping import TrainingStopped

    class Flaky(Dataset):
        def __init__(self, fail: bool):
            self.x, self.y = streams_data.tensors(streams_data.EVAL, 2)
            self.fail = fail

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            if self.fail and i == 5:
                raise OSError(5, "Input/output error", "eval/5.bin")
            return self.x[i], self.y[i]

    train = streams_data.in_memory()
    options = {"epochs": 2, "batch_size": 12, "optimizer": "sgd", "lr": 0.05, "progress": "none", "plots": False}
    reset_accelerate()
    full = fit(streams_data.model(), train, Flaky(False), output_dir=str(tmp_path / "full"), **options)
    reset_accelerate()
    with pytest.raises(TrainingStopped, match="evaluation sample .*eval/5.bin.* at step 8"):
        fit(streams_data.model(), train, Flaky(True), output_dir=str(tmp_path / "run"), **options)
    reset_accelerate()
    resumed = fit(streams_data.model(), train, Flaky(False), output_dir=str(tmp_path / "run"), resume="auto", **options)
    reset_accelerate()
    assert resumed["resumed_from"].endswith("step-00000008") and resumed["evals"] == full["evals"]
    assert largest_difference(tmp_path / "full", tmp_path / "run") == 0.0


def test_a_stream_blocked_in_a_read_does_not_keep_the_run_waiting(tmp_path):
    """Read in the code: when the run stops reading a stream (its last step), the reader thread was waited for until it
    ended, and a reader blocked in the stream's own read never does. Confirmed (the run never returned) and mended: the
    reader gets LET_GO seconds, then is left to end with the process, with a warning."""
    script = tmp_path / "blocked.py"
    script.write_text(
        "import sys, threading, torch, acc_trainer\n"
        "class Blocks(torch.utils.data.IterableDataset):\n"
        "    def __iter__(self):\n"
        "        for i in range(40):\n"
        "            yield torch.full((4,), float(i)), i % 2\n"
        "        threading.Event().wait()  # a read that never returns (a stalled network share)\n"
        "acc_trainer.fit(torch.nn.Linear(4, 2), Blocks(), None, max_steps=2, batch_size=16, progress='none',\n"
        "                plots=False, output_dir=sys.argv[1])\n"
        "print('fit returned', flush=True)\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                            timeout=120, env=_env())
    assert result.returncode == 0 and "fit returned" in result.stdout, result.stderr[-3000:]
    assert "is still in a read 5 s after the run stopped reading it" in result.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2 and time.monotonic() - started < 60
