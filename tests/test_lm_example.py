"""The language-model example (examples/stdlib_lm.py, docs/language-models.md#the-example) in a short form: its two
YAMLs run as the docs say (from examples/, `acc-trainer --config ...`), with overrides that make them tiny (4 files,
a 2-layer model of hidden size 64, 12 steps of 8 blocks of 128 tokens), and what they leave is what a user uses."""

from __future__ import annotations

import json
import math

import pytest
from conftest import REPO, metrics, run_here, summary

EXAMPLES = REPO / "examples"
SHORT = ["--model-args", "{hidden_size: 64, layers: 2, intermediate_size: 128}", "--max-steps", "12", "--eval-every", "6",
         "--batch-size", "8", "--pack", "128", "--warmup-steps", "0", "--max-new-tokens", "8", "--no-plots"]


def _evaluations(run) -> list[dict]:
    return [r for r in metrics(run) if "eval_perplexity" in r]


def _samples(run, step: int) -> dict[str, str]:
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    return {r["prompt"]: r["text"] for r in rows if r["step"] == step}


def _greedy(model, tokenizer, prompt: str) -> str:
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The full run, then the LoRA run from its folder (the tokenizer is trained once into examples/runs/)."""
    folder = tmp_path_factory.mktemp("stdlib_lm")
    full, lora = folder / "full", folder / "lora"
    result = run_here("--config", "stdlib_lm.yaml", "--dataset-args", "{max_files: 4, max_eval_files: 1}", *SHORT,
                      "--output-dir", full, cwd=EXAMPLES)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result = run_here("--config", "stdlib_lm_lora.yaml", "--dataset-args", "{packages: [test], max_files: 4, "
                      "max_eval_files: 1}", *SHORT, "--init-from", full, "--tokenizer", full, "--output-dir", lora,
                      cwd=EXAMPLES)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return full, lora


def test_full_training_lowers_perplexity_and_its_run_folder_loads_in_transformers(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full, _ = runs
    first, last = _evaluations(full)
    assert (first["step"], last["step"]) == (6, 12)  # --eval-every 6
    # Better than chance (a uniform guess over the 1,024 tokens has perplexity 1,024), and better with training;
    # the perplexity the summary reports is exp of the token-mean evaluation loss.
    assert last["eval_perplexity"] < first["eval_perplexity"] < 1024
    assert summary(full)["eval"]["perplexity"] == pytest.approx(math.exp(last["eval_loss"]), rel=1e-9)
    # The folder loads where users load models, and its greedy continuations are the samples the run wrote
    # at its last evaluation (the same weights): config, tied weights and tokenizer all came along.
    model, tokenizer = AutoModelForCausalLM.from_pretrained(full), AutoTokenizer.from_pretrained(full)
    samples = _samples(full, 12)
    assert len(samples) == 3 and len(tokenizer) == 1024
    for prompt, text in samples.items():
        assert _greedy(model, tokenizer, prompt) == text


def test_lora_fine_tune_starts_from_the_first_run_and_its_adapter_loads_with_peft(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full, lora = runs
    s = summary(lora)
    assert s["init"]["from"] == str(full) and s["init"]["loaded"] == 20  # every tensor of the first run's file
    assert s["lora"]["rank"] == 16 and s["parameters"]["trainable"] < s["parameters"]["total"] / 4
    # Its evaluation set is test/, which the first run never read: the adapter lowers its perplexity.
    first, last = _evaluations(lora)
    assert last["eval_perplexity"] < first["eval_perplexity"]
    # The first run's model plus the adapter in the LoRA run's folder continue the prompts as the run did.
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(full), lora)
    tokenizer = AutoTokenizer.from_pretrained(lora)
    samples = _samples(lora, 12)
    assert len(samples) == 3
    for prompt, text in samples.items():
        assert _greedy(model, tokenizer, prompt) == text
    # The adapter names its base (the --init-from folder), so peft's Auto class loads both from the run folder alone,
    # offline (it was null: peft then looked for a model on the Hub).
    from peft import AutoPeftModelForCausalLM

    assert json.loads((lora / "adapter_config.json").read_text())["base_model_name_or_path"] == str(full.resolve())
    alone = AutoPeftModelForCausalLM.from_pretrained(lora)
    prompt = next(iter(samples))
    assert _greedy(alone, tokenizer, prompt) == samples[prompt]


def test_each_run_folder_has_a_model_card_whose_command_trains_the_run_again(runs):
    """README.md: the model, the data and what it says of its tokens, the objective, the tokens trained (12 steps of 8
    blocks of 128), the final perplexity, and a command that gives the options of the run's config.yaml."""
    import shlex

    from acc_trainer.flags import parse_config

    full, lora = runs
    for run in runs:
        card = (run / "README.md").read_text()
        assert "LlamaForCausalLM, built by `stdlib_lm:llama`" in card and "the dataset: `stdlib_lm:documents`" in card
        assert "- `lm`: the model's own loss" in card and "- tokens: 12,288 (blocks of 128)" in card
        assert f"perplexity {summary(run)['eval']['perplexity']:.4g}" in card
        command = card.split("```bash\n")[1].split("\n```")[0]
        assert parse_config(shlex.split(command)[1:]) == parse_config(["--config", str(run / "config.yaml")])
    assert "starting weights: the model's own" in (full / "README.md").read_text()
    assert f"starting weights: `--init-from {full}` (20 tensors loaded)" in (lora / "README.md").read_text()


def test_the_pages_commands_followed_top_to_bottom_each_write_their_own_folder_and_files():
    """docs/language-models.md's commands, run in order from examples/: no two write the same run folder or file (the
    2-process run and the instruction section's base run both wrote runs/stdlib-lm, refused the second time; a
    predict wrote pairs.jsonl over the DPO example's pairs)."""
    import re
    import shlex
    from collections import Counter

    import yaml

    text = (REPO / "docs" / "language-models.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    commands += [" ".join(span.split()) for span in re.findall(r"`(acc-trainer [^`]+)`", text)]  # in the prose
    written = []
    for block in blocks:  # the files its here-documents write
        written += re.findall(r'open\("([^"]+)", "w"\)', block) + re.findall(r"^cat > (\S+)", block, re.M)
    written += re.findall(r'output_dir="([^"]+)"', text)  # fit() in the Python examples
    for command in commands:
        words = shlex.split(command, comments=True)
        while words and re.match(r"\w+=", words[0]):  # OMP_NUM_THREADS=1 acc-trainer ...
            words.pop(0)
        if words[:2] == ["acc-trainer", "launch"]:
            words = ["acc-trainer", *words[words.index("acc_trainer") + 1:]]
        if words[:1] != ["acc-trainer"] or len(words) < 2:
            continue
        options = dict(zip(words[1:], words[2:]))
        if words[1] in ("predict", "evaluate") and "--output" in options:
            written.append(options["--output"])
        elif words[1].startswith("-"):  # a training run: its --output-dir, else its YAML's
            given = options.get("--output-dir") or yaml.safe_load((EXAMPLES / options["--config"]).read_text())[
                "output-dir"]
            written.append(given)
    twice = [path for path, count in Counter(written).items() if count > 1]
    assert "runs/stdlib-lm" in written and "pairs.jsonl" in written and not twice, twice


def test_bench_lm_measures_the_three_loops_and_prints_their_ratios(tmp_path):
    """`acc-trainer bench-lm` on the example's workload, made tiny (3 steps of 8 blocks of 64 tokens, the first
    not timed), one process: a row per loop, and acc_trainer's figure is the one its own run folder logged."""
    out = tmp_path / "bench"
    result = run_here("bench-lm", "--config", "stdlib_lm_bench.yaml", "--dataset-args",
                      "{length: 64, max_files: 3, max_eval_files: 1}", "--model-args",
                      "{hidden_size: 64, layers: 2, intermediate_size: 128}", "--batch-size", "8", "--log-every", "1",
                      "--processes", "1", "--steps", "3", "--warmup", "1", "--repeats", "1", "--bench-dir", out,
                      cwd=EXAMPLES)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[1] == "1":
            table[cells[0]] = (float(cells[2].replace(",", "")), cells[5], cells[6], cells[3], float(cells[4]),
                               float(cells[7].replace(",", "")), cells[8])
    assert set(table) == {"acc_trainer", "Hugging Face Trainer", "plain Accelerate loop"}
    assert all(row[0] > 0 for row in table.values())
    # MFU: acc_trainer's model FLOPs per sample x samples/s over this CPU's measured matrix-multiply rate, in every
    # row; the warm-up step's seconds beyond a steady step, apart.
    from acc_trainer.tools.lm_bench import TITLES

    report = json.loads((out / "bench.json").read_text())
    assert "measured fp32 matrix-multiply rate" in report["peak"] and report["peak_flops"] > 1e8
    for row in report["rows"]:
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] / 63 * summary_flops(out) / report["peak_flops"])
        assert table[TITLES[row["loop"]]][3] == f"{row['mfu']:.1%}" and row["warmup_s"] > 0
    # acc_trainer's tokens/s: its run's logged step times after the warm-up (steps 2 and 3), 8 blocks of 63
    # labelled next tokens a step.
    (run,) = (out / "runs").glob("acc_trainer-1p-*")
    timed = [r["step_time_s"] for r in metrics(run) if "step_time_s" in r and r["step"] > 1]
    assert len(timed) == 2 and summary(run)["world_size"] == 1
    assert table["acc_trainer"][0] == round(2 * 8 * 63 / sum(timed))
    # Quiet: at the lower quartile of the logged intervals' seconds a step (of two intervals of one step: the faster).
    assert table["acc_trainer"][5] == round(8 * 63 / min(timed))
    # Each ratio printed is acc_trainer's printed figure over that loop's (to the rounding of the figures), and
    # so is the one repeat's ratio, with itself as the median; the quiet ratio is the quiet figures' quotient.
    for loop in ("Hugging Face Trainer", "plain Accelerate loop"):
        speed, ratio, each, _, _, quiet, quiet_ratio = table[loop]
        assert float(ratio) == pytest.approx(table["acc_trainer"][0] / speed, abs=2e-3 + 1e-3 * float(ratio))
        assert each == f"{ratio} ({ratio})"
        assert float(quiet_ratio) == pytest.approx(table["acc_trainer"][5] / quiet, abs=2e-3 + 1e-3 * float(quiet_ratio))
    # The other loops' intervals: every --log-every step after the warm-up (two, of one step each), their quiet
    # figure the faster's.
    for row in report["rows"]:
        (run,) = report["runs"][f"{row['loop']}@1"]
        assert len(run["interval_step_s"]) == 2
        assert row["quiet_tokens_per_s"] == pytest.approx(8 * 63 / min(run["interval_step_s"]))


def summary_flops(out) -> float:
    (run,) = (out / "runs").glob("acc_trainer-1p-*")
    return summary(run)["model_flops_per_sample"]


def test_bench_lm_refuses_what_the_three_loops_cannot_do_alike():
    for args, message in [(["--optimizer", "sgd"], "bench-lm compares the loops with --optimizer adamw"),
                          (["--weight-decay", "0.1"], "bench-lm compares the loops without weight decay"),
                          (["--steps", "12", "--warmup", "3"], "--warmup and --steps must be multiples of --log-every (5)"),
                          (["--loops", "trl"], "--loops takes acc_trainer, hf_trainer, accelerate"),
                          (["--lora", "4", "--gradient-checkpointing", "--layer-decay", "0.8"],
                           "bench-lm: --lora, --gradient-checkpointing, --layer-decay would apply to acc_trainer's "
                           "loop only")]:
        result = run_here("bench-lm", "--config", "stdlib_lm_bench.yaml", *args, cwd=EXAMPLES)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("acc-trainer: error: ") and message in result.stderr
