"""`acc-trainer bench-lm` on chat data, preference pairs and prompts: acc_trainer against TRL's SFTTrainer, DPOTrainer
and GRPOTrainer (acc_trainer/tools/trl_bench.py), made tiny: the example's workloads cut to a few files, a small model,
3 steps of 4 samples (GRPO: of 64 completions; the first step not timed), one process. Each row's tokens/s is what that
run's own step logs counted and timed."""

from __future__ import annotations

import json
import statistics

import pytest

pytest.importorskip("trl")

from conftest import REPO, run_here  # noqa: E402 - after the skip

EXAMPLES = REPO / "examples"
TINY = ["--dataset-args", "{max_files: 6, max_eval_files: 1}", "--model-args",
        "{hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}", "--max-length", "96",
        "--batch-size", "4", "--log-every", "1", "--processes", "1", "--steps", "3", "--warmup", "1", "--repeats", "1"]


def printed_rows(stdout: str) -> dict[str, tuple[float, str, str, float]]:
    """The printed table: loop -> (tokens/s, acc_trainer vs it, each repeat, tokens per CPU second)."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[1] == "1":
            rows[cells[0]] = (float(cells[2].replace(",", "")), cells[4], cells[5], float(cells[7].replace(",", "")))
    return rows


def step_log(out, loop: str) -> list[dict]:
    (run,) = (out / "runs").glob(f"*-{loop}-1p-*")
    return [json.loads(line) for line in (run / "bench-steps-rank0.jsonl").read_text().splitlines()][1:]  # 0: setup


@pytest.mark.parametrize("mode, config, trl", [("sft", "stdlib_sft_bench.yaml", "TRL SFTTrainer"),
                                               ("dpo", "stdlib_dpo_bench.yaml", "TRL DPOTrainer")])
def test_bench_lm_against_trl_reports_what_each_runs_log_counted(tmp_path, mode, config, trl):
    out = tmp_path / "bench"
    result = run_here("bench-lm", "--config", config, *TINY, "--bench-dir", out, cwd=EXAMPLES)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = printed_rows(result.stdout)
    assert set(table) == {"acc_trainer", trl}
    speeds = {}
    for loop, title in (("acc_trainer", "acc_trainer"), ("trl", trl)):
        log = step_log(out, loop)
        assert [r["step"] for r in log] == [1, 2, 3] and all(r["samples"] == 4 for r in log[1:])
        # tokens of steps 2 and 3 over the seconds (and the CPU seconds) from the end of step 1 to the end of step 3
        speeds[loop] = (log[1]["tokens"] + log[2]["tokens"]) / (log[2]["time"] - log[0]["time"])
        assert table[title][0] == round(speeds[loop])
        assert table[title][3] == round((log[1]["tokens"] + log[2]["tokens"]) / (log[2]["cpu"] - log[0]["cpu"]))
    # The same model, seed and samples: both loops draw the same batches, so they train the same tokens each step
    # (the first step apart: acc_trainer reads how the model's loss counts its tokens off one batch).
    assert [r["tokens"] for r in step_log(out, "acc_trainer")[1:]] == [r["tokens"] for r in step_log(out, "trl")[1:]]
    ratio = table[trl][1]
    assert float(ratio) == pytest.approx(speeds["acc_trainer"] / speeds["trl"], abs=1e-3)
    # Both trained alike, as read in their processes: float32 (TRL's configs default to bf16), no gradient
    # checkpointing (TRL's default), AdamW with the same implementation.
    report = json.loads((out / "bench.json").read_text())
    assert report["mode"] == mode and {r["loop"] for r in report["rows"]} == {"acc_trainer", "trl"}
    assert report["setup"]["autocast"] is False and report["setup"]["gradient_checkpointing"] is False
    assert report["setup"]["optimizer"] == "AdamW" and report["setup"]["implementation"] == "fused"
    assert "float32, no autocast, gradient checkpointing off, dropout off, threads a process: " in result.stdout


def test_the_bench_refuses_to_compare_loops_that_trained_differently():
    """Runs on as many processes must have trained alike (TRL's configs default to bf16 and gradient checkpointing);
    the threads a process may differ between process counts (the launcher sets one a process)."""
    from acc_trainer.tools.trl_bench import check_alike

    setup = {"autocast": False, "gradient_checkpointing": False, "dropout": False, "threads": 2,
             "optimizer": "AdamW", "implementation": "fused", "lr": 1e-3, "weight_decay": 0.0}
    runs = {"acc_trainer@1": [{"setup": setup}], "trl@1": [{"setup": setup}],
            "acc_trainer@2": [{"setup": {**setup, "threads": 1}}], "trl@2": [{"setup": {**setup, "threads": 1}}]}
    check_alike(runs)
    runs["trl@2"] = [{"setup": {**setup, "threads": 1, "autocast": "torch.bfloat16"}}]
    with pytest.raises(RuntimeError, match="did not train alike"):
        check_alike(runs)


def test_options_only_acc_trainer_would_apply_are_refused():
    """TRL's loop trains the full model, unpacked and eager: a bench with --lora (or --pack, --compile, ...) would
    compare different computations. One line, exit 2, before anything runs."""
    result = run_here("bench-lm", "--config", "stdlib_sft_bench.yaml", *TINY, "--lora", "4", "--pack", "64",
                      "--optimizer-args", "{betas: [0.8, 0.99]}", cwd=EXAMPLES)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("acc-trainer: error: bench-lm against TRL: --lora, --pack, --optimizer-args would "
                                    "apply to acc_trainer's loop only") and result.stderr.count("\n") == 1


def test_trl_gets_the_chat_template_acc_trainer_gets(tmp_path, monkeypatch):
    """--chat-template replaces the tokenizer's template in acc_trainer's run: TRL's trainer gets the same one."""
    from acc_trainer.config import load_yaml, make_config
    from acc_trainer.tools.trl_bench import workload

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}"
                        "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    monkeypatch.chdir(EXAMPLES)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    cfg = make_config({**load_yaml("stdlib_sft_bench.yaml"), "dataset_args": {"max_files": 2, "max_eval_files": 1},
                       "chat_template": str(template)})
    _, _, tokenizer = workload(cfg)
    assert tokenizer.chat_template == template.read_text()
    # Without generation blocks TRL's SFTTrainer cannot find the assistant's tokens (it raises after acc_trainer's
    # loop has run): refused in one line before anything runs.
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    result = run_here("bench-lm", "--config", "stdlib_sft_bench.yaml", *TINY, "--chat-template", template,
                      cwd=EXAMPLES)
    assert (result.returncode, result.stdout) == (2, "") and result.stderr.count("\n") == 1, result.stderr
    assert f"--chat-template {template} has no {{% generation %}} blocks" in result.stderr


GRPO_TINY = ["--processes", "1", "--steps", "3", "--warmup", "1", "--repeats", "1", "--log-every", "1"]


def grpo_rows(stdout: str) -> dict[str, list[str]]:
    """The printed GRPO table: loop -> its cells after the loop's name."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 11 and cells[1] == "1":
            rows[cells[0]] = cells[1:]
    return rows


def test_grpo_bench_runs_both_loops_on_the_same_prompts_and_reports_what_their_logs_counted(tmp_path, monkeypatch):
    """examples/arithmetic_grpo_bench.yaml (the arithmetic example's model, prompts and reward, 64 completions a step
    of at most 3 tokens) for 3 steps on one process: both loops generated 64 completions a step from the same prompts
    (the dataset's, tokenized alike), trained on exactly the tokens they generated (the generation's forwards are not
    counted as trained), and the table's figures are those of their step logs."""
    out = tmp_path / "bench"
    result = run_here("bench-lm", "--config", "arithmetic_grpo_bench.yaml", *GRPO_TINY, "--bench-dir", out,
                      cwd=EXAMPLES)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = grpo_rows(result.stdout)
    assert set(table) == {"acc_trainer", "TRL GRPOTrainer"}
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import arithmetic_grpo

    tokenizer = arithmetic_grpo.tokenizer()
    dataset = {" ".join(map(str, tokenizer(p["prompt"], add_special_tokens=False).input_ids))
               for p in arithmetic_grpo.prompt_sets()[0]}
    logs, speeds = {}, {}
    for loop, title in (("acc_trainer", "acc_trainer"), ("trl", "TRL GRPOTrainer")):
        log = logs[loop] = step_log(out, loop)
        assert [r["step"] for r in log] == [1, 2, 3]
        for r in log:
            assert r["completions"] == len(r["prompts"]) == 64 and set(r["prompts"]) <= dataset
            assert 64 <= r["generated"] <= 64 * 3  # each completion 1 to --max-completion-length tokens
        for before, r in zip(log, log[1:]):  # the timed steps: the loss counted every token generated and no more
            assert r["samples"] == 64 and r["tokens"] == r["generated"]  # (the generation's forwards are not counted)
            assert 0 < r["generation_s"] < r["rollout_s"] < r["time"] - before["time"]  # sampling in rollout in step
        seconds = log[2]["time"] - log[0]["time"]
        speeds[loop] = sum(r["tokens"] + r["generated"] for r in log[1:]) / seconds
        cells = table[title]
        assert float(cells[1].replace(",", "")) == round(speeds[loop])
        assert float(cells[2].replace(",", "")) == pytest.approx(128 / seconds, abs=0.051)  # completions a second
        for cell, name in ((cells[6], "generation_s"), (cells[7], "rollout_s")):  # each one's share of the seconds
            assert float(cell.rstrip("%")) == pytest.approx(100 * sum(r[name] for r in log[1:]) / seconds, abs=0.051)
    # The same prompts at each step (the first epoch deals them in the same order in both), each prompt's G rows
    assert [r["prompts"] for r in logs["acc_trainer"]] == [r["prompts"] for r in logs["trl"]]
    assert all(r["prompts"].count(p) == 8 for r in logs["trl"] for p in r["prompts"])
    assert float(table["TRL GRPOTrainer"][3]) == pytest.approx(speeds["acc_trainer"] / speeds["trl"], abs=1e-3)
    report = json.loads((out / "bench.json").read_text())
    assert report["mode"] == "grpo" and report["setup"]["dropout"] is False and report["setup"]["autocast"] is False
    # The wrapper times acc_trainer's rollout as acc_trainer's own generation_time_s does (metrics.jsonl)
    (ours,) = report["runs"]["acc_trainer@1"]
    assert ours["logged_generation_time_s"] == pytest.approx(
        statistics.mean(r["rollout_s"] for r in logs["acc_trainer"][1:]), rel=0.05, abs=2e-3)


@pytest.mark.parametrize("option, says", [
    (["--grpo-beta", "0.1"], "--grpo-beta needs a reference model"),
    (["--log-completions", "5"], "--log-completions would apply to acc_trainer's loop only"),
    (["--loss-type", "bnpo", "--processes", "1,2"], "--loss-type bnpo normalises by each process's micro-batch")])
def test_grpo_options_trl_would_run_differently_are_refused(option, says):
    result = run_here("bench-lm", "--config", "arithmetic_grpo_bench.yaml", *GRPO_TINY, *option, cwd=EXAMPLES)
    assert (result.returncode, result.stdout) == (2, "") and result.stderr.count("\n") == 1, result.stderr
    assert says in result.stderr
