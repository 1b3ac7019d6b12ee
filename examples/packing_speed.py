"""Packed against padded: real tokens per second on the same documents (docs/language-models.md#packing).

    python examples/packing_speed.py [--files 300] [--length 512] [--steps 30] [--repeats 3]

The documents: the first FILES `.py` files of Python's standard library (sorted by path), a byte a token (no
tokenizer to train, nothing downloaded), each file cut into documents of 16 to LENGTH bytes (lengths drawn
with seed 0). The model: a Llama (hidden 64, 2 layers, sdpa) built from its config. Each way trains STEPS
optimizer steps with `acc_trainer.fit`, REPEATS times from the same weights, and prints the median of the
runs' real tokens per second (the documents' tokens, padding left out: the run's samples per second times
the real tokens of a sample):

- packed: `pack=LENGTH`, 8 blocks a step;
- padded: 16 documents a step (about as many real tokens), padded to the longest of their batch, with an
  attention_mask and labels of -100 on the padding (transformers' DataCollatorWithPadding's way).
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import tempfile
from pathlib import Path

import torch

import acc_trainer
from acc_trainer.data.packing import pack


def documents(files: int, longest: int, seed: int = 0) -> list[torch.Tensor]:
    """The library's first `files` sources as bytes, cut into documents of 16 to `longest` bytes."""
    paths = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "site-packages" not in p.parts)
    g = torch.Generator().manual_seed(seed)
    docs = []
    for path in paths[:files]:
        data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
        at = 0
        while at < len(data):
            n = int(torch.randint(16, longest + 1, (1,), generator=g))
            docs.append(data[at:at + n])
            at += n
    return docs


def pad(samples: list[dict]) -> dict:
    """Documents padded to the longest of the batch."""
    ids = torch.zeros(len(samples), max(len(s["input_ids"]) for s in samples), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sample in enumerate(samples):
        ids[row, :len(sample["input_ids"])], mask[row, :len(sample["input_ids"])] = sample["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                        attn_implementation="sdpa"))


def tokens_per_second(docs: list[torch.Tensor], length: int, steps: int, packed: bool) -> float:
    """One short run's real tokens per second."""
    from accelerate.state import AcceleratorState, GradientState

    data = pack(docs, length) if packed else [{"input_ids": d} for d in docs]
    per_sample = data.tokens / len(data) if packed else sum(len(d) for d in docs) / len(docs)
    options = dict(batch_size=8) if packed else dict(batch_size=16, collate_fn=pad)
    with tempfile.TemporaryDirectory() as out:
        summary = acc_trainer.fit(llama(), data, max_steps=steps, optimizer="adamw", lr=1e-3, progress="none",
                                  plots=False, output_dir=out, **options)
    GradientState._reset_state()  # the next fit starts from fresh Accelerate state, as in a new process
    AcceleratorState._reset_state(reset_partial_state=True)
    return summary["samples_per_s"] * per_sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    docs = documents(args.files, args.length)
    blocks = pack(docs, args.length)
    print(f"{len(docs):,} documents, {blocks.tokens:,} tokens; packed: {len(blocks):,} blocks of {args.length}, "
          f"{blocks.tokens / (len(blocks) * args.length):.1%} real tokens")
    speeds = {}
    for packed in (False, True):
        runs = [tokens_per_second(docs, args.length, args.steps, packed) for _ in range(args.repeats)]
        speeds[packed] = statistics.median(runs)
        print(f"{'packed' if packed else 'padded'}: {speeds[packed]:,.0f} real tokens/s (median of "
              f"{', '.join(f'{r:,.0f}' for r in runs)})", flush=True)
    print(f"packed / padded: {speeds[True] / speeds[False]:.2f}x")


if __name__ == "__main__":
    main()
