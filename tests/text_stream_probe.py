"""Streams of text through acc_trainer, several runs in one launch of 1 or 2 processes: lm_probe's tiny Llama on its
chats of random words and dpo_probe's preference pairs, streamed (a user's IterableDataset, a JSON Lines file read as a
stream by `--dataset FILE.jsonl --dataset-args '{stream: true}'`, a `datasets` stream of that file) and, to compare
with, the same samples held in memory.

    python tests/text_stream_probe.py DATA_DIR OUT_DIR [JOB ...]                                   (1 process)
    acc-trainer launch --multi_gpu --num_processes 2 tests/text_stream_probe.py DATA_DIR OUT_DIR [JOB ...]
    text_stream_probe.run_jobs(DATA_DIR, OUT_DIR, [JOB ...])                                       (the test's process)

DATA_DIR holds what `write` puts there: the tokenizer, 16 and 48 chats and 6 evaluation chats as JSON Lines. Each
job's run folder is OUT_DIR/<job>. The runs compared with a run held in memory make one step of the whole set per
epoch, so that the map-style loader's shuffle (a stream is read in its order) changes nothing but summation order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dpo_probe import pairs
from lm_probe import TEMPLATE_PLAIN, base_model, chat_tokenizer, conversations, end_launched, fresh_accelerate
from torch.utils.data import IterableDataset

CHATS, EVAL, MORE = conversations(16, 0), conversations(6, 1), conversations(48, 2)
PAIRS = pairs(16, 0, chat=True)
PACK = 32


class Stream(IterableDataset):
    """A user's stream of samples (no saved position: a resume reads it again and skips); `set_epoch` recorded."""

    def __init__(self, rows: list):
        self.rows, self.epochs = rows, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        yield from self.rows


def write(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    chat_tokenizer(TEMPLATE_PLAIN).save_pretrained(folder / "tokenizer")
    for name, rows in (("chats", CHATS), ("eval", EVAL), ("more", MORE)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def blocks(rows: list) -> int:
    """The blocks of PACK tokens `rows` pack into (map-style): the global batch of the packed runs compared."""
    from acc_trainer.config import TrainConfig
    from acc_trainer.data.packing import pack
    from acc_trainer.data.token_cache import TextSets

    return len(pack(TextSets(chat_tokenizer(TEMPLATE_PLAIN), TrainConfig(token_cache="off"))(rows, None, "rows")[0], PACK))


def datasets_stream(folder: Path, name: str):
    from datasets import load_dataset

    return load_dataset("json", data_files=str(folder / f"{name}.jsonl"), split="train", streaming=True)


COMMON = dict(optimizer="sgd", lr=0.2, max_steps=3, progress="none", plots=False)
FIT = {  # fit(model, train, eval, ...): the data, and the options
    "chat_map": (lambda d: (CHATS, EVAL), dict(batch_size=16)),
    "chat_stream": (lambda d: (Stream(CHATS), Stream(EVAL)), dict(batch_size=16)),
    "datasets_stream": (lambda d: (datasets_stream(d, "chats"), datasets_stream(d, "eval")), dict(batch_size=16)),
    "packed_map": (lambda d: (MORE, None), dict(pack=PACK, batch_size="blocks")),
    "packed_stream": (lambda d: (Stream(MORE), None), dict(pack=PACK, batch_size="blocks")),
    "dpo_map": (lambda d: (PAIRS, None), dict(objective="dpo", lr=2.0, batch_size=16)),
    "dpo_stream": (lambda d: (Stream(PAIRS), None), dict(objective="dpo", lr=2.0, batch_size=16)),
    # 2 epochs of 6 steps, a checkpoint at step 4 (resumed from the stream's saved position)
    "datasets_more": (lambda d: (datasets_stream(d, "more"), datasets_stream(d, "eval")),
                      dict(batch_size=8, max_steps=None, epochs=2, checkpoint_every="4")),
}
# `acc-trainer --dataset more.jsonl --dataset-args '{stream: true, eval: eval.jsonl}'`, 2 epochs of 6 (unpacked: the
# file's saved position) or 9 steps (packed: read again and skipped), a checkpoint at step 4.
TRAIN = {"jsonl": dict(batch_size=8), "jsonl_packed": dict(pack=PACK, batch_size=4)}
RESUMED = ("datasets_more", *TRAIN)  # each also resumed from its step-4 checkpoint, as <job>_resumed


def run_jobs(data: Path, out: Path, names=None) -> None:
    import acc_trainer
    from acc_trainer.config import make_config

    names = names or [*FIT, *TRAIN, *(f"{name}_resumed" for name in RESUMED)]
    for name in names:
        base = name.removesuffix("_resumed")
        resume = {"resume": str(out / base / "checkpoints/step-00000004")} if name != base else {}
        if base in FIT:
            make, options = FIT[base]
            options = {**COMMON, **options, **resume}
            if options["batch_size"] == "blocks":
                options["batch_size"] = blocks(MORE)
            acc_trainer.fit(base_model(), *make(data), tokenizer=chat_tokenizer(TEMPLATE_PLAIN), output_dir=str(out / name),
                            **options)
        else:
            acc_trainer.train(make_config(dict(
                model="lm_probe:base_model", dataset=str(data / "more.jsonl"), tokenizer=str(data / "tokenizer"),
                dataset_args={"stream": True, "eval": str(data / "eval.jsonl")}, epochs=2, checkpoint_every="4",
                optimizer="sgd", lr=0.2, progress="none", plots=False, output_dir=str(out / name), **TRAIN[base],
                **resume)))
        fresh_accelerate()


if __name__ == "__main__":
    run_jobs(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] or None)
    end_launched()
