"""Completions sampled so that a run reproduces: each one with a generator of its own, keyed by (seed, step, the
prompt's index in the set, the generation's index), each prompt's group generated alone ([G, prompt length], no
padding, a cache of keys and values), so its logits, and so its tokens, are the same bits whatever the number of
processes, the accumulation, or a resume. A token is the inverse CDF of its row's filtered distribution (temperature,
top-k, top-p, as transformers applies them) at that row's uniform number for that position."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from accelerate.utils import reduce

from ..distributed import engines


@dataclass
class Sampling:
    """How completions are drawn: `temperature` 0 is greedy (evaluation's default)."""

    max_new: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos: tuple[int, ...] = ()
    pad: int = 0




def key(seed: int, step: int, prompt: int, generation: int) -> int:
    """The generator seed of one completion: the same four numbers give the same completion on any topology."""
    digest = hashlib.blake2b(f"{seed}/{step}/{prompt}/{generation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def uniforms(keys: Sequence[int], n: int) -> torch.Tensor:
    """[len(keys), n] float64 uniform numbers, each row from its own key."""
    return torch.stack([torch.rand(n, generator=torch.Generator().manual_seed(k), dtype=torch.float64) for k in keys])


def filtered_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[rows, vocabulary] float32 logits -> the sampling distribution: temperature, then top-k, then top-p (as
    transformers' TopKLogitsWarper and TopPLogitsWarper, in that order)."""
    logits = logits / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        ordered, order = logits.sort(dim=-1)  # ascending, as transformers: the tail removed up to 1 - top_p
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - s.top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits.softmax(-1)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row: the first whose cumulative probability passes the row's uniform number (in float64)."""
    cumulative = probs.double().cumsum(-1)
    picked = torch.searchsorted(cumulative, (u.to(cumulative.device) * cumulative[:, -1]).unsqueeze(1).contiguous())
    return picked.squeeze(1).clamp(max=probs.shape[-1] - 1)


def generate_group(model, prompt: torch.Tensor, keys: Sequence[int] | None, s: Sampling,
                   lockstep: Callable[[bool], bool] | None = None) -> torch.Tensor:
    """The completions of one prompt [P]: one row per key (greedy, one row, when `keys` is None)."""
    return generate_rows(model, [prompt] * (len(keys) if keys is not None else 1), keys, s, lockstep)


@torch.no_grad()
def generate_rows(model, prompts: Sequence[torch.Tensor], keys: Sequence[int] | None, s: Sampling,
                  lockstep: Callable[[bool], bool] | None = None) -> torch.Tensor:
    """A completion of each prompt (1-D token ids), all in one batch: each row sampled with its key (greedy when
    `keys` is None), [rows, <= max_new] padded with `s.pad` after each row's end-of-sequence token. Prompts of
    different lengths are left-padded, their positions counted from each one's first token. The same rows in the same
    order give the same bits on any topology. `lockstep(done)`: under FSDP2 every process takes part in every
    forward, so the loop goes on until every process's rows are done."""
    rows, device = len(prompts), prompts[0].device
    u = uniforms(keys, s.max_new) if keys is not None else None
    width = max(len(p) for p in prompts)
    ids = torch.full((rows, width), s.pad, dtype=torch.long, device=device)
    mask = torch.zeros((rows, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    padded = bool((mask == 0).any())  # without padding the model counts the positions itself
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    past, out, name = None, [], cache_name(model)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    eos = torch.tensor(s.eos or [-1], device=device)
    for t in range(s.max_new):
        result = model(input_ids=ids, attention_mask=mask, use_cache=True, **{name: past},
                       **({"position_ids": positions} if padded else {}))
        past = getattr(result, name)
        logits = result.logits[:, -1].float()
        token = logits.argmax(-1) if u is None or s.temperature == 0 else draw(filtered_probs(logits, s), u[:, t])
        token = torch.where(finished, torch.full_like(token, s.pad), token)
        out.append(token)
        finished |= torch.isin(token, eos)
        done = bool(finished.all())
        if lockstep is not None:
            done = lockstep(done)
        if done:
            break
        ids, mask, positions = token.unsqueeze(1), F.pad(mask, (0, 1), value=1), positions[:, -1:] + 1
    return torch.stack(out, 1)


def cache_name(model) -> str:
    """The forward's keyword for the cache of keys and values: `cache` from transformers 5.2x on (5.24 warns about
    `past_key_values`, removed in 5.40), `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model's: *args, **kwargs
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def completion_mask(completions: torch.Tensor, eos: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [rows, C]: each token up to and with the first end-of-sequence token, and whether each row was cut at
    the maximum length: it has none)."""
    is_eos = torch.isin(completions, torch.tensor(list(eos) or [-1], device=completions.device))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], completions.shape[1],
                                                                                  dtype=torch.long))
    positions = torch.arange(completions.shape[1], device=completions.device)
    return (positions[None] <= first[:, None]).long(), ~is_eos.any(1)


def lockstep(model) -> Callable[[bool], bool] | None:
    """Under FSDP2 (each process holds a shard: every forward gathers the weights from all): a process whose group is
    done keeps taking part in the forwards until every process's is. None for a model each process holds whole."""
    if not engines.FSDP2().holds_model(model):
        return None

    def done_everywhere(done: bool) -> bool:
        flag = torch.tensor([0.0 if done else 1.0], device=next(model.parameters()).device)
        return reduce(flag, "sum").item() == 0

    return done_everywhere
