"""QLoRA (--load-in-4bit): LoRA adapters on the --init-from folder's model loaded in 4 bits through bitsandbytes, on
this CPU. 1 and 2 processes end within 1e-5 (one launch); a resumed run ends bit for bit where the run without a stop
ends; checkpoints and the run folder hold the adapter alone, which loads with PeftModel.from_pretrained on the base
loaded in 4 bits again and gives the run's evaluation; the start line and summary.json give the base's memory in 4
bits against float32; DPO on a model its user loaded in 4 bits trains against the model with its adapters off; bad
input is one line, nothing written."""

from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

import qlora_probe  # noqa: E402 - after the skips
from conftest import forked_cli, metrics, one_thread, reset_accelerate, summary  # noqa: E402
from lm_probe import base_model, chat_tokenizer, documents, pad  # noqa: E402

TOLERANCE = 1e-5
# The tiny Llama's weights in float32: 20,640 parameters (the output layer tied to the embeddings), 4 bytes each.
FLOAT32_BYTES = 4 * sum(p.numel() for p in base_model().parameters())


LM_DATA = ("--dataset", "qlora_probe:data", "--collate", "lm_probe:pad")
# DPO's: preference pairs of random words (dpo_probe's) as text, tokenized with lm_probe's word-level tokenizer
PAIRS = ("--dataset", "qlora_probe:preference_pairs", "--tokenizer", "lm_probe:chat_tokenizer", "--objective", "dpo")


def options(base, folder, *extra, lora: bool = True, data=LM_DATA) -> list[str]:
    return ["--model", "qlora_probe:llama", *data, "--init-from", base, "--load-in-4bit", *["--lora", "4"] * lora,
            "--batch-size", "8", "--max-steps", "6", "--checkpoint-every", "3", "--eval-every", "3", "--optimizer", "adamw",
            "--lr", "2e-2", "--metrics", "perplexity", "--no-plots", "--output-dir", folder, *extra]


def in_process(*args) -> None:
    """`acc-trainer ARGS` in this process, on one thread (as the launched processes compute)."""
    from acc_trainer.cli import main

    reset_accelerate()
    try:
        with one_thread():
            main([str(a) for a in args])
    finally:
        reset_accelerate()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the base folder, the 1-process run, the 2-process run and its launch's stdout): the same command."""
    root = tmp_path_factory.mktemp("qlora")
    base = qlora_probe.write_base(root / "base")
    one, two = root / "one", root / "two"
    in_process(*options(base, one, "--progress", "none"))
    forked_cli(*options(base, two, "--progress", "plain"), output=root / "two.out")
    return base, one, two, (root / "two.out").read_text()


def adapter(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def test_one_and_two_processes_end_on_the_same_adapter(runs):
    _, one, two, _ = runs
    first, second = adapter(one), adapter(two)
    assert first.keys() == second.keys() and len(first) == 2 * 2 * 7  # lora_A and lora_B of 7 layers in 2 blocks
    assert any(v.abs().sum() > 0 for k, v in first.items() if "lora_B" in k)  # lora_B starts at zero: it trained
    assert max((first[k] - second[k]).abs().max().item() for k in first) < TOLERANCE
    assert summary(two)["world_size"] == 2 and summary(one)["eval"]["loss"] == pytest.approx(summary(two)["eval"]["loss"],
                                                                                             abs=TOLERANCE)


def test_checkpoints_hold_the_adapter_and_a_resumed_run_ends_bit_for_bit(runs, tmp_path):
    from safetensors import safe_open

    base, one, _, _ = runs
    checkpoint = one / "checkpoints" / "step-00000003"
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:  # no 4-bit weight, no quantization state
        assert sorted(f.keys()) == sorted(f"{k.removesuffix('.weight')}.default.weight" for k in adapter(one))
    # The frozen base: its 20 parameters (14 layers in 4 bits, the embeddings and 5 norms), their digest checked on resume
    assert json.loads((checkpoint / "trainer_state.json").read_text())["frozen"]["parameters"] == 20
    again = tmp_path / "again"
    shutil.copytree(checkpoint, again / "checkpoints" / checkpoint.name)  # as a run stopped after its step 3 left it
    in_process(*options(base, again, "--progress", "none", "--resume", "auto"))
    assert summary(again)["resumed_from"].endswith("step-00000003")
    first, second = adapter(one), adapter(again)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_the_adapter_loads_on_the_base_in_4_bits_and_gives_the_runs_evaluation(runs):
    from peft import PeftModel

    base, one, _, _ = runs
    config = json.loads((one / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 4
    assert not (one / "model.safetensors").exists()
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization)
    for module in model.modules():  # as the run computed (docs/language-models.md#qlora-4-bit-base)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    model = PeftModel.from_pretrained(model, one).eval()
    with torch.no_grad():  # the evaluation documents all at once: the mean over their tokens
        loss = model(**pad(documents(16, 1))).loss.item()
    assert loss == pytest.approx(summary(one)["eval"]["loss"], abs=TOLERANCE)


def test_the_start_line_and_the_summary_give_the_bases_memory(runs):
    _, one, two, stdout = runs
    four_bit = summary(one)["init"]["in_4bit"]
    assert four_bit == summary(two)["init"]["in_4bit"]
    assert (four_bit["quant_type"], four_bit["compute_dtype"], four_bit["dtype"]) == ("nf4", "float32", "float32")
    assert four_bit["bytes_unquantized"] == FLOAT32_BYTES
    # 4 bits a weight of the 14 linear layers (18,432 weights) and their scales (one float32 per 64), plus a few
    # hundred bytes of their state; the embeddings (tied to the output layer) and norms kept in float32.
    linear = 18_432
    least = FLOAT32_BYTES - 4 * linear + linear // 2 + 4 * linear // 64
    assert least <= four_bit["bytes"] <= least + 14 * 200
    said = f"the base takes {four_bit['bytes'] / 1e3:.2f} kB in 4 bits, {FLOAT32_BYTES / 1e3:.2f} kB in float32"
    assert said in stdout and said in " ".join(summary(one)["notes"])
    assert summary(one)["parameters"] == {"trainable": 4_096, "total": FLOAT32_BYTES // 4 + 4_096}


def test_dpo_on_a_model_loaded_in_4_bits_trains_against_its_adapters_off(runs, tmp_path):
    from dpo_probe import pairs
    from lm_probe import TEMPLATE_PLAIN, chat_tokenizer

    import acc_trainer

    base = runs[0]
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                                                   bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    reset_accelerate()
    with one_thread():
        result = acc_trainer.fit(model, pairs(21, 0, False), pairs(5, 1, False), tokenizer=chat_tokenizer(TEMPLATE_PLAIN),
                                 objective="dpo", lora=4, batch_size=8, eval_batch_size=4, max_steps=4, optimizer="adamw",
                                 lr=5e-2, eval_every=2, log_every=1, progress="none", plots=False,
                                 output_dir=str(tmp_path / "dpo"))
    reset_accelerate()
    assert "--objective dpo: the reference is the model with its LoRA adapters off" in result["notes"]
    assert result["init"]["in_4bit"]["quant_type"] == "fp4"
    steps = [m for m in metrics(tmp_path / "dpo") if "loss" in m]
    # The adapters start at zero: at the first step the model is its reference, the loss log 2; then they move it.
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and len(steps) == 4
    assert abs(result["eval"]["reward_margin"]) > 1e-4
    base_weights = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in model.named_parameters()
                    if "lora_" not in n}
    assert base_weights.keys() == frozen.keys() and all(torch.equal(p, frozen[n]) for n, p in base_weights.items())


def test_grpo_on_a_base_loaded_in_4_bits_trains_its_adapters_against_them_off(runs, tmp_path):
    """--objective grpo with --load-in-4bit: the reference is the model with its adapters off (the KL 0 at the first
    step, where the adapters are zero), the adapters move, the same completions when the run is made again."""
    import grpo_probe

    import acc_trainer

    options = dict(objective="grpo", rewards=grpo_probe.REWARDS, load_in_4bit=True, lora=4, init_from=str(runs[0]),
                   grpo_beta=0.1, batch_size=12, num_generations=2, max_completion_length=6, max_steps=3,
                   optimizer="sgd", lr=0.5, log_every=1, log_completions=1, progress="none", plots=False)
    for name in ("grpo", "again"):
        reset_accelerate()
        with one_thread():
            result = acc_trainer.fit(base_model(), *grpo_probe.data("base"), tokenizer=chat_tokenizer(),
                                     output_dir=str(tmp_path / name), **options)
        reset_accelerate()
    assert "the reference is the model with its LoRA adapters off" in " ".join(result["notes"])
    steps = [m for m in metrics(tmp_path / "grpo") if "loss" in m]
    assert steps[0]["kl"] == pytest.approx(0, abs=1e-7) and len(steps) == 3
    assert max(v.abs().max().item() for k, v in adapter(tmp_path / "grpo").items() if "lora_B" in k) > 1e-4
    made = [(tmp_path / name / "completions.jsonl").read_text() for name in ("grpo", "again")]
    assert made[0] == made[1] and made[0].count("\n") == 36


@pytest.mark.parametrize("case", ["no bitsandbytes", "no lora", "fsdp", "reference copy"])
def test_bad_input_is_one_line_and_writes_nothing(case, main_in_process, monkeypatch, tmp_path):
    base = qlora_probe.write_base(tmp_path / "base")
    extra, said = {
        "no bitsandbytes": ([], '--load-in-4bit needs bitsandbytes and transformers: pip install -e ".[qlora]"'),
        "no lora": ([], "--load-in-4bit trains LoRA adapters on the frozen 4-bit base: give --lora RANK"),
        "fsdp": ([], "the accelerate config selects FSDP, which cannot hold a 4-bit base"),
        "reference copy": (["--dpo-reference", "copy"],
                           "--dpo-reference copy with --load-in-4bit: the reference is the model with its LoRA adapters off"),
    }[case]
    if case == "no bitsandbytes":
        monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as where it is not installed: its import fails
    if case == "fsdp":
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` with accelerate_configs/fsdp.yaml sets
    code, out, err = main_in_process(*options(base, tmp_path / "run", "--progress", "none", *extra, lora=case != "no lora",
                                              data=PAIRS if case == "reference copy" else LM_DATA))
    assert (code, out) == (2, "") and err.startswith(f"acc-trainer: error: {said}") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
