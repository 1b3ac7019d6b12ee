"""Language-model runs through acc_trainer.fit, several in one launch of 1 or 2 processes (starting processes
costs more than these small runs): a small Llama-style causal LM built from its config (no download) on
documents of random tokens, or on chats of random words with a word-level tokenizer built here.

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


# A ChatML-like chat template with {% generation %} blocks around what the assistant writes (its content, its
# end-of-turn token and the newline after it), and the same rendering without them (as most templates are).
# Jinja in transformers drops a newline written right after a block tag: hence {{ '\n' }}.
TEMPLATE_GEN = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endgeneration %}"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATE_PLAIN = TEMPLATE_GEN.replace("{% generation %}", "").replace("{% endgeneration %}", "")
WORDS = ("user assistant system what is the capital of france paris say hello there name a colour blue red not good "
         "answer cat sat on mat dog ate bone sky tell me short story once upon time no thanks you are welcome").split()


def chat_tokenizer(template: str | None = TEMPLATE_GEN):
    """A word-level tokenizer (fewer ids than the model's vocabulary) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[PAD]", "[EOS]", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*specials, *WORDS])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]",
                                   additional_special_tokens=specials[3:])
    fast.chat_template = template
    return fast


def conversations(n: int, seed: int) -> list[dict]:
    """Chats of 1 or 2 exchanges (some with a system message) of random words."""
    g = torch.Generator().manual_seed(seed)

    def words() -> str:
        picks = torch.randint(0, len(WORDS), (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        return " ".join(WORDS[i] for i in picks)

    chats = []
    for _ in range(n):
        messages = [{"role": "system", "content": words()}] if torch.rand(1, generator=g) < 0.3 else []
        for _ in range(int(torch.randint(1, 3, (1,), generator=g))):
            messages += [{"role": "user", "content": words()}, {"role": "assistant", "content": words()}]
        chats.append({"messages": messages})
    return chats


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
    # chat data as users have it: the template applied, the loss on the assistant's tokens, padded by the built-in
    # collate; a prompt given as chat messages; and the same with accumulation (2 samples a pass)
    "chat": dict(chat=True, collate_fn=None, prompts=[[{"role": "user", "content": "say hello"}]], max_new_tokens=3),
    "chat_accumulated": dict(chat=True, collate_fn=None, micro_batch="2"),
}


def run_jobs(out: Path, names=None) -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    import acc_trainer

    for name in names or JOBS:
        options = dict(JOBS[name])
        model = base_model(**options.pop("model", {}))
        if options.pop("chat", False):
            data, options["tokenizer"] = (conversations(48, 0), conversations(16, 1)), chat_tokenizer(TEMPLATE_PLAIN)
        else:
            data = documents(48, 0), documents(16, 1)
        acc_trainer.fit(model, *data, output_dir=str(out / name), **{**COMMON, **options})
        if PartialState().is_main_process:
            with torch.no_grad():
                torch.save(model.eval()(input_ids=held_out_ids()).logits, out / f"{name}.logits.pt")
            (out / f"{name}.checkpointing").write_text(str(model.is_activation_checkpointing))
        GradientState._reset_state()  # the next fit's Accelerator starts from a fresh state, on the same processes
        AcceleratorState._reset_state()


if __name__ == "__main__":
    run_jobs(Path(sys.argv[1]))


def fresh_accelerate() -> None:
    """The next fit's Accelerator starts from a fresh state, on the same processes (a launch's several runs)."""
    from accelerate.state import AcceleratorState, GradientState

    GradientState._reset_state()
    AcceleratorState._reset_state()


def end_launched() -> None:
    """A probe's launched process ends as the command line ends a finished one: torch 2.14's gloo may abort one in the
    interpreter's teardown."""
    from accelerate import PartialState

    from acc_trainer.patches import leave_without_teardown

    PartialState().destroy_process_group()
    leave_without_teardown(0)

