"""Text classification on variable-length token sequences, from the command line, with a padding collate function.

    cd examples
    acc-trainer --model text_classification:BagOfEmbeddings --dataset text_classification:reviews \
        --collate text_classification:pad --epochs 3 --batch-size 64

Each sample is `(tokens, label)`, the tokens a sequence of 4 to 40 ids; `pad` batches them as
`((tokens, mask), labels)`, the tokens padded with 0 to the longest of the batch (each process pads
its own share of the global batch). The model is called as `model(tokens, mask)`.

The task: is a "review" positive? It holds words of praise (ids 1-8) and of blame (ids 9-16) among
neutral ones (17-63); the label says whether praise outnumbers blame.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB = 64  # id 0 is the padding


class Reviews(Dataset):
    def __init__(self, size: int, seed: int = 0, min_length: int = 4, max_length: int = 40):
        self.size, self.seed, self.lengths = size, seed, (min_length, max_length)
        self.classes = ("negative", "positive")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)  # each sample from (seed, index) alone
        length = torch.randint(self.lengths[0], self.lengths[1] + 1, (1,), generator=g).item()
        tokens = torch.randint(1, VOCAB, (length,), generator=g)
        praise, blame = ((tokens >= 1) & (tokens <= 8)).sum(), ((tokens >= 9) & (tokens <= 16)).sum()
        return tokens, int(praise > blame)


def reviews(train_size: int = 4096, eval_size: int = 512, seed: int = 0):
    """`--dataset text_classification:reviews`: (training set, evaluation set)."""
    return Reviews(train_size, seed), Reviews(eval_size, seed + 1)


def pad(samples: list[tuple[torch.Tensor, int]]):
    """`--collate text_classification:pad`: ((tokens [B, T], mask [B, T]), labels [B])."""
    length = max(len(tokens) for tokens, _ in samples)
    tokens = torch.zeros(len(samples), length, dtype=torch.long)
    for row, (sequence, _) in enumerate(samples):
        tokens[row, : len(sequence)] = sequence
    return (tokens, tokens != 0), torch.tensor([label for _, label in samples])


class BagOfEmbeddings(nn.Module):
    """`--model text_classification:BagOfEmbeddings`: the mean of the tokens' embeddings, then an MLP."""

    def __init__(self, num_classes: int = 2, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width, padding_idx=0)
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = mask.unsqueeze(-1).float()
        mean = (self.embed(tokens) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(mean)
