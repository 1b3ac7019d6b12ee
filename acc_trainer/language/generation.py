"""Text a language model generates: samples from the user's prompts at each evaluation of a training run
(`--prompts`, `write_samples`), and `acc-trainer predict --generate`'s text for each input (`generated_rows`).

Decoding is greedy (`do_sample=False`, one beam): the same weights give the same text, so the samples of two
evaluations differ only because the model did. Generation runs under `torch.no_grad` in evaluation mode, with
the random generators of the CPU and the device saved and put back (`torch.random.fork_rng`): a run with prompts
trains exactly the weights of the same run without them (tests/test_generation.py).

During training the main process alone generates, with the evaluated model unwrapped (the EMA's with --ema): no
collective call is made, and the other processes wait for it at their next one. Under FSDP and DeepSpeed each
process holds a shard of the weights, which one process cannot run alone: there every process generates, each
forward pass gathering the weights (transformers' `synced_gpus`: every process runs as many passes as the longest
continuation needs), and the main process writes the samples.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ..config import ConfigError, TrainConfig, first_line
from ..data.datasets import IGNORE_INDEX
from ..workload.components import load_tokenizer

SAMPLES = "samples.jsonl"
# The trackers whose Accelerate `log` takes text: TensorBoard's add_text, wandb's log, Comet's log_other (one value,
# the latest). MLflow, ClearML and DVCLive drop text with a warning; Aim and SwanLab want their own text types.
TEXT_TRACKERS = ("tensorboard", "wandb", "comet_ml")


def ready(cfg: TrainConfig, job) -> None:
    """Before anything is written: the run's tokenizer (`--tokenizer`, unless `fit` gave an object) loaded into
    `job.tokenizer`, and `--prompts` checked (a model that generates, a tokenizer, an evaluation set, weights that
    are whole on the main process), one line each."""
    if job.tokenizer is None and cfg.tokenizer:
        job.tokenizer = load_tokenizer(cfg.tokenizer)
    if not cfg.prompts:
        return
    check_generates(job.model, job.tokenizer, "--prompts", "--tokenizer (or fit(tokenizer=...))")
    if job.data.eval is None:
        raise ConfigError("--prompts: samples are generated at each evaluation, and this run has no evaluation set")
    for prompt in cfg.prompts:
        if isinstance(prompt, list) and not getattr(job.tokenizer, "chat_template", None):
            raise ConfigError(f"--prompts: {prompt!r} is chat messages, and the tokenizer has no chat template to "
                              "render them (--chat-template FILE gives one)")
        if not len(_encoded(job.tokenizer, prompt)):
            raise ConfigError(f"--prompts: {prompt!r} gives no tokens with the tokenizer")


def check_generates(model, tokenizer, what: str, give: str) -> None:
    """One line for a model that cannot generate, or no tokenizer; `give`: how to give one."""
    if not callable(getattr(model, "generate", None)) or (hasattr(model, "can_generate") and not model.can_generate()):
        raise ConfigError(f"{what}: {type(model).__name__} cannot generate text (it has no generate(), or its "
                          "can_generate() is False); a transformers model with a language-model head (...ForCausalLM) can")
    if tokenizer is None:
        raise ConfigError(f"{what} needs a tokenizer, to turn the text into tokens and back: give {give}")


def write_samples(r) -> None:
    """At an evaluation (main process only): each prompt's continuation by the evaluated model, printed,
    written to <run>/samples.jsonl (step, prompt, text) and sent to a tracker that takes text."""
    cfg, accelerator, step = r.cfg, r.accelerator, r.state.step
    together = r.engine.shards  # sharded weights: every process takes part in each forward pass
    if not cfg.prompts or not (together or accelerator.is_main_process):
        return
    trained = r.trained
    model = trained.ema.module if trained.ema else accelerator.unwrap_model(trained.model, keep_torch_compile=False)
    records = []
    for prompt in cfg.prompts:
        r.watch.at("samples", step)  # each prompt is progress: a long list is not a hung process
        try:
            text = continuation(model, r.job.tokenizer, _encoded(r.job.tokenizer, prompt), cfg.max_new_tokens, together)
        except Exception as e:  # noqa: BLE001 - the main process alone generates: raised here, the others would hang
            if not accelerator.is_main_process:
                return
            print(f"acc-trainer: warning: no sample at step {step}: generating from {prompt!r} failed "
                  f"({type(e).__name__}: {first_line(e)}); training goes on", file=sys.stderr)
            return
        records.append({"step": step, "prompt": prompt, "text": text})
    if not accelerator.is_main_process:
        return
    path = r.output.folder / SAMPLES
    with r.output.files.writing(path):
        _append(path, records)
    for record in records:
        r.output.progress.print(f"sample at step {step}: {record['prompt']!r} -> {record['text']!r}", markup=False,
                                emoji=False)
    for tracker in accelerator.trackers:  # those that take text (--log-with may name several): the others warn at each
        if tracker.name in TEXT_TRACKERS:
            tracker.log({f"samples/{i}": f"{x['prompt']}{x['text']}" for i, x in enumerate(records)}, step=step)


def continuation(model, tokenizer, ids: torch.Tensor, max_new_tokens: int, together: bool = False) -> str:
    """The text of the tokens `model` generates greedily after the token ids `ids` (one sequence), at most
    `max_new_tokens` of them; the model's mode and every random generator are as they were after. `together`: every
    process calls this with the same `ids` (sharded weights), and each runs until all are done."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            out = model.generate(ids[None].to(device), attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                                 device=device),
                                 max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, synced_gpus=together,
                                 **({"pad_token_id": pad} if pad is not None else {}))
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def generated_rows(model, tokenizer, batch, max_new_tokens: int, answers: bool = False) -> list[dict]:
    """predict --generate: for each sample of `batch`, its input decoded (`prompt`) and the text generated after it
    (`text`), the batch's prompts generated together (left-padded). A sample's input is its `input_ids` (the tokens
    its `attention_mask` keeps) for a dict, else the inputs of an (inputs, targets) pair. `answers` (chat and
    prompt/completion data, whose labels mark the answer): the prompt is the sample before its last labelled tokens
    (a conversation before its last assistant turn, which the model is to write), and that answer is kept as
    `reference`, never given to the model."""
    if isinstance(batch, dict):
        if "input_ids" not in batch:
            raise ConfigError(f"predict --generate: the batches hold no input_ids (they hold {', '.join(batch)})")
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        ids, mask = batch[0], None
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()):
        raise ConfigError("predict --generate: the inputs are not rows of token ids (an integer tensor [batch, tokens])")
    labels = batch.get("labels") if answers and isinstance(batch, dict) else None
    prompts, references = [], []
    for i, row in enumerate(ids):
        kept = mask[i].bool() if mask is not None else slice(None)
        start = answer_start(labels[i][kept]) if labels is not None else len(row[kept])
        prompts.append(row[kept][:start])
        references.append(row[kept][start:])
    texts = continuations(model, tokenizer, prompts, max_new_tokens)
    return [{"prompt": tokenizer.decode(prompt, skip_special_tokens=True), "text": text,
             **({"reference": tokenizer.decode(reference, skip_special_tokens=True)} if answers else {})}
            for prompt, text, reference in zip(prompts, texts, references, strict=True)]


def answer_start(labels: torch.Tensor) -> int:
    """Where the last run of labelled tokens begins (the last answer); the whole sample when nothing before it is
    left unlabelled (text, every token labelled)."""
    marked = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
    if not marked:
        return len(labels)
    start = marked[-1]
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start if start > 0 else len(labels)


def continuations(model, tokenizer, prompts: list[torch.Tensor], max_new_tokens: int) -> list[str]:
    """The text `model` generates greedily after each prompt (token ids), all of them in one call, left-padded (as a
    decoder-only model generates a batch); one at a time where the tokenizer has no padding or end token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None or len(prompts) == 1:
        return [continuation(model, tokenizer, prompt, max_new_tokens) for prompt in prompts]
    device = next(model.parameters()).device
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        if len(prompt):
            ids[i, width - len(prompt):], attention[i, width - len(prompt):] = prompt, 1
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            out = model.generate(ids.to(device), attention_mask=attention.to(device), max_new_tokens=max_new_tokens,
                                 do_sample=False, num_beams=1, pad_token_id=pad)
    finally:
        model.train(was_training)
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]


def _encoded(tokenizer, prompt: str | list) -> torch.Tensor:
    """A prompt's token ids: text as the tokenizer makes them; chat messages through the chat template, ending with
    the assistant's turn begun (the generation prompt)."""
    if isinstance(prompt, list):
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)
        return torch.as_tensor(list(ids["input_ids"]), dtype=torch.long)
    return torch.as_tensor(tokenizer(prompt)["input_ids"], dtype=torch.long)


def _append(path: Path, records: list[dict]) -> None:
    """Adds `records` to the samples file, dropping the records of this step and later first: written by an
    earlier attempt of a resumed run, which this one writes again."""
    step = records[0]["step"]
    kept = []
    if path.exists():
        for line in path.read_text().splitlines(keepends=True):
            try:
                if json.loads(line)["step"] < step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept) + "".join(json.dumps(record) + "\n" for record in records))
    os.replace(tmp, path)
