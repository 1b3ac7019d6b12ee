"""A Hugging Face transformers model on generated token sequences: dict batches, the model's own loss.

The model is built from a config (no download). Each sample is a dict of `input_ids`,
`attention_mask` and `labels`; acc_trainer calls `model(**batch)`, and the model, given labels,
returns its own loss, which is what trains. Evaluation reports that loss and the accuracy of its
logits against the labels.

    pip install transformers        # (the dev extra has it)
    python examples/tiny_transformer.py
    accelerate launch --multi_gpu --num_processes 2 examples/tiny_transformer.py --epochs 1

The task: does the sequence hold the token 7 more often than the token 8?
"""

import sys

import torch
from torch.utils.data import Dataset

import acc_trainer


class Tokens(Dataset):
    def __init__(self, size: int, length: int = 24, vocab: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (size, length), generator=g)
        self.labels = ((self.ids == 7).sum(1) > (self.ids == 8).sum(1)).long()
        self.classes = ("no", "yes")

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def build_model():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=32, num_labels=2)
    return BertForSequenceClassification(config)


def main(argv: list[str]) -> dict:
    config = acc_trainer.parse_config(["--epochs", "6", "--batch-size", "64", "--optimizer", "adamw",
                                       "--lr", "1e-3", *argv])
    acc_trainer.set_seed(config.seed)
    return acc_trainer.fit(build_model(), Tokens(3072, seed=config.seed), Tokens(512, seed=config.seed + 1),
                           config=config)


if __name__ == "__main__":
    main(sys.argv[1:])
