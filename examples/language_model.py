"""A causal language model on variable-length sequences: GPT-2 from a config (no download), padded per batch.

Each sample is one sequence of 6 to 24 tokens; `pad` makes a batch of them: `input_ids` padded with 0,
an `attention_mask`, and `labels` of -100 on the padding. Given labels, the model computes its own
loss, a mean over the tokens it predicts. acc_trainer counts those tokens (it reads off the first batch
that the loss is a next-token cross-entropy) and divides the summed loss by the tokens of the whole
global batch, so 1 process, 2 processes and --grad-accum 2 train the same model.

    cd examples
    acc-trainer --config language_model.yaml
    accelerate launch --multi_gpu --num_processes 2 -m acc_trainer --config language_model.yaml
    acc-trainer check --config language_model.yaml

The sequences count upwards from a random start in steps of 1, 2 or 3 (modulo the vocabulary): after
two tokens, every next one is predictable.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

VOCAB = 64  # token 0 is the padding


class Counting(Dataset):
    """Sample i: start s, step d and length L drawn from (seed, i) alone: the same on every process."""

    def __init__(self, size: int, seed: int = 0, min_length: int = 6, max_length: int = 24, padded: bool = False):
        self.size, self.seed, self.lengths, self.padded = size, seed, (min_length, max_length), padded

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start, step = torch.randint(1, VOCAB, (1,), generator=g).item(), torch.randint(1, 4, (1,), generator=g).item()
        length = torch.randint(self.lengths[0], self.lengths[1] + 1, (1,), generator=g).item()
        ids = (start - 1 + step * torch.arange(length)) % (VOCAB - 1) + 1
        if not self.padded:
            return {"input_ids": ids}
        # Padded in the dataset, to one length: torch's default_collate stacks these.
        return {name: values[0] for name, values in pad([{"input_ids": ids}], self.lengths[1]).items()}


def counting(train_size: int = 2048, eval_size: int = 256, seed: int = 0, padded: bool = False):
    """`--dataset language_model:counting`: (training set, evaluation set)."""
    return Counting(train_size, seed, padded=padded), Counting(eval_size, seed + 1, padded=padded)


def pad(samples: list[dict], length: int | None = None) -> dict:
    """`--collate language_model:pad`: sequences padded to the longest (or `length`), labels -100 on the padding."""
    length = length or max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n], mask[row, :n] = sample["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def gpt2(layers: int = 2, width: int = 64, heads: int = 4, max_length: int = 32):
    """`--model language_model:gpt2`: a small GPT-2 built from its config, dropout off (so that 1 and 2
    processes can be compared exactly)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=max_length, n_embd=width, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # transformers finds no loss type in the name GPT2LMHeadModel, and warns
    return model


def next_token_accuracy(outputs, labels: torch.Tensor) -> torch.Tensor:
    """`--metrics language_model:next_token_accuracy`: per sequence, the share of its tokens (after the
    first) that the model predicts from the ones before."""
    predicted = outputs.logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    real = target != -100
    return ((predicted == target) & real).sum(1) / real.sum(1).clamp(min=1)
