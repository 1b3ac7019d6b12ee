"""Language-model runs through acc_trainer.fit, several in one launch of 1 or 2 processes (starting processes
costs more than these small runs): a small Llama-style causal LM built from its config (no download) on
documents of random tokens.

    python tests/lm_probe.py OUT_DIR                                           (1 process)
    acc-trainer launch --multi_gpu --num_processes 2 tests/lm_probe.py OUT_DIR
    lm_probe.run_jobs(OUT_DIR)                                                 (1 process: the test's own)

Each job's run folder is OUT_DIR/<job>; the main process also writes OUT_DIR/<job>.logits.pt, the trained
model's logits on a few held-out sequences (what a run folder loaded elsewhere must give), and
OUT_DIR/<job>.checkpointing, whether the model recomputed its activations (gradient checkpointing).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

VOCAB = 64


def base_model(seed: int = 0, dropout: float = 0.0):
    """A Llama-style causal LM with tied embeddings, from its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, attention_dropout=dropout)
    return LlamaForCausalLM(config)


def documents(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g)}
            for _ in range(n)]


def pad(samples: list[dict]) -> dict:
    """Sequences padded to the longest; the padding neither attended to nor trained on."""
    length = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sample in enumerate(samples):
        ids[row, :len(sample["input_ids"])], mask[row, :len(sample["input_ids"])] = sample["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def held_out_ids() -> torch.Tensor:
    return torch.stack([d["input_ids"][:6] for d in documents(4, 7)])


COMMON = dict(collate_fn=pad, batch_size=8, max_steps=6, optimizer="sgd", lr=0.2, eval_every=3, metrics=["perplexity"],
              progress="none", plots=False)
JOBS = {
    "full": dict(save_best="loss"),  # from_pretrained of the final folder and of checkpoints/best
    "lora": dict(lora=4),
    "dropout": dict(model=dict(dropout=0.1)),
    "dropout_checkpointed": dict(model=dict(dropout=0.1), gradient_checkpointing=True),
    "packed": dict(pack=32, collate_fn=None),  # blocks of 32 tokens, documents attending within themselves
    # --compile: the Llama's layers compiled in place (regional compilation), checkpoints at steps 3 and 6
    "compiled": dict(pack=32, collate_fn=None, compile=True, checkpoint_every=3),
}


def run_jobs(out: Path, names=None) -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    import acc_trainer

    for name in names or JOBS:
        options = dict(JOBS[name])
        model = base_model(**options.pop("model", {}))
        acc_trainer.fit(model, documents(48, 0), documents(16, 1), output_dir=str(out / name), **{**COMMON, **options})
        if PartialState().is_main_process:
            with torch.no_grad():
                torch.save(model.eval()(input_ids=held_out_ids()).logits, out / f"{name}.logits.pt")
            (out / f"{name}.checkpointing").write_text(str(model.is_activation_checkpointing))
        GradientState._reset_state()  # the next fit's Accelerator starts from a fresh state, on the same processes
        AcceleratorState._reset_state()


if __name__ == "__main__":
    run_jobs(Path(sys.argv[1]))
