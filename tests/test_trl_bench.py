"""`acc-trainer bench-lm` on chat data and preference pairs: acc_trainer against TRL's SFTTrainer and DPOTrainer
(acc_trainer/tools/trl_bench.py), made tiny: the example's workloads cut to a few files, a small model, 3 steps of 4
samples (the first not timed), one process. Each row's tokens/s is what that run's own step logs counted and timed."""

from __future__ import annotations

import json

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
