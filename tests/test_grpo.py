"""GRPO on the training loop (--objective grpo): the same completions and weights within 1e-5 on 1, 2 and 3 processes,
under FSDP2 and with accumulation (tests/grpo_probe.py: on 2, 3 and FSDP2's 2 processes, forked, and the 1-process
runs here); a
resume generates the same completions and ends bit for bit; evaluation counts each prompt once; the figures of every
log step are those of the step's completions (completions.jsonl); the wrong input is one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import grpo_probe  # noqa: E402 - after the skips
import lm_probe  # noqa: E402
from conftest import REPO, distance, forked, launch, metrics, one_thread, reset_accelerate, summary, weights  # noqa: E402

from acc_trainer.config import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{processes: the folder of that launch's runs}: base, others, lora and packed on 2 processes, base on 3 and on 2 under
    FSDP2 (each process holds a shard: every one takes part in every generation's forwards), every job on 1."""
    folders = {n: tmp_path_factory.mktemp(f"p{n}") for n in (1, 2, 3, "fsdp")}
    forked(grpo_probe.run_jobs, folders[2], ["base", "others", "lora", "packed"], processes=2)
    forked(grpo_probe.run_jobs, folders[3], ["base"], processes=3)
    forked(grpo_probe.run_jobs, folders["fsdp"], ["base"], config=REPO / "accelerate_configs" / "fsdp.yaml")
    reset_accelerate()
    with one_thread():
        grpo_probe.run_jobs(folders[1])
    reset_accelerate()
    return folders




def completions(folder) -> list[dict]:
    """completions.jsonl's rows, without the advantage (a float computed from the rewards)."""
    rows = [json.loads(line) for line in (folder / "completions.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "advantage"} for row in rows]


def test_processes_and_accumulation_generate_the_same_completions_and_end_on_the_same_weights(runs):
    """Every step's completions (the 4 steps' 48 each) are the same on 1, 2 and 3 processes and with 2 micro-batches a
    step; the weights end within 1e-5 after moving far more; evaluation takes each of the 5 prompts once (2 per
    process a batch: uneven over 2 and 3 processes) and gives the same figures."""
    one = runs[1]
    start = lm_probe.base_model().state_dict()
    for job, other in (("base", runs[2] / "base"), ("base", runs[3] / "base"), ("base", runs["fsdp"] / "base"),
                       ("base", one / "accumulated"),
                       ("others", runs[2] / "others"), ("lora", runs[2] / "lora"), ("packed", runs[2] / "packed")):
        mine, theirs = completions(one / job), completions(other)
        assert len(mine) == (2 if job == "others" else 4) * 12  # others: a generation every other step
        assert mine == theirs, (job, other)
        assert distance(weights(one / job), weights(other)) < 1e-5, (job, other)
        assert summary(other)["eval"] == pytest.approx(summary(one / job)["eval"], abs=1e-5), (job, other)
    assert distance(weights(one / "base"), {k: v for k, v in start.items() if k in weights(one / "base")}) > 0.05
    assert max(v.abs().max().item() for k, v in weights(one / "lora").items() if "lora_B" in k) > 1e-3
    assert (summary(one / "base")["global_batch_size"], summary(one / "base")["completions_per_step"]) == (6, 12)
    for folder in (one / "base", runs[2] / "base", runs[3] / "base", runs["fsdp"] / "base", runs[2] / "others"):
        evaluations = [row for row in metrics(folder) if "eval_samples" in row]
        assert [row["step"] for row in evaluations] == [2, 4] and {row["eval_samples"] for row in evaluations} == {5}
    # num_iterations 2: a generation every other step, its completions trained on twice
    assert sorted({row["step"] for row in completions(one / "others")}) == [1, 3]


def test_each_log_step_reports_the_figures_of_its_completions(runs):
    """metrics.jsonl's figures at each step (log_every 1) are the mean and standard deviation of each reward function
    and of the total over the step's completions (a function's None left out), their lengths and the share cut at the
    maximum, as read back from completions.jsonl; KL, clipping and entropy are there, and every figure reaches the
    progress of the run in the same way on 2 processes."""
    for folder in (runs[1] / "base", runs[2] / "others"):
        steps = {row["step"]: row for row in metrics(folder) if "loss" in row}
        made = completions(folder)
        for step in sorted({row["step"] for row in made}):
            rows = [row for row in made if row["step"] == step]
            logged = steps[step]
            for name in ("says_cat", "brief", "topic_said"):
                values = torch.tensor([r["rewards"][name] for r in rows if r["rewards"][name] is not None],
                                      dtype=torch.float64)
                assert logged[f"rewards/{name}/mean"] == pytest.approx(values.mean().item(), abs=1e-9), (name, step)
                assert logged[f"rewards/{name}/std"] == pytest.approx(values.std().item(), abs=1e-9), (name, step)
            total = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
            assert logged["reward"] == pytest.approx(total.mean().item(), abs=1e-9)
            assert logged["reward_std"] == pytest.approx(total.std().item(), abs=1e-9)
            lengths = [r["length"] for r in rows]
            assert (logged["completions/mean_length"], logged["completions/min_length"],
                    logged["completions/max_length"]) == pytest.approx((sum(lengths) / len(lengths), min(lengths),
                                                                         max(lengths)))
            assert logged["completions/clipped_ratio"] == pytest.approx(sum(r["cut"] for r in rows) / len(rows))
            assert all(r["cut"] == (r["length"] == 6) or r["length"] == 6 for r in rows)
            assert 0 < logged["entropy"] and 0 <= logged["clip_ratio"] <= 1
        assert ("kl" in steps[1]) == (folder.name == "others")
    others = [row for row in metrics(runs[2] / "others") if "loss" in row]
    assert others[0]["kl"] == pytest.approx(0, abs=1e-7) and others[-1]["kl"] > 0  # at the start the policy is its reference


def test_a_resume_generates_the_same_completions_and_ends_bit_for_bit(runs, tmp_path):
    """Resumed from step 2 (a generation's first step, for num_iterations 2), the run writes the same completions at
    steps 3 and 4 and ends on the same weights and evaluation as the run without a stop, bit for bit."""
    one = runs[1]
    for job in ("base", "others"):
        with one_thread():
            grpo_probe.run_job(tmp_path / job, job, resume=str(one / job / "checkpoints" / "step-00000002"))
        reset_accelerate()
        resumed, whole = weights(tmp_path / job), weights(one / job)
        assert all(torch.equal(resumed[k], whole[k]) for k in whole), job
        assert completions(tmp_path / job) == [row for row in completions(one / job) if row["step"] > 2], job
        assert json.dumps(summary(tmp_path / job)["eval"]) == json.dumps(summary(one / job)["eval"])


def raising(prompts, completions, **columns):
    raise ValueError("no score for this")


def too_few(prompts, completions, **columns):
    return [1.0]


def not_a_number(prompts, completions, **columns):
    return [math.nan] * len(completions)


def test_the_wrong_input_is_one_line(tmp_path):
    from transformers import LlamaForSequenceClassification

    import acc_trainer

    tokenizer = lm_probe.chat_tokenizer()
    prompts = grpo_probe.prompts(8, 0)
    options = dict(batch_size=4, num_generations=2, max_completion_length=3, max_steps=1, progress="none",
                   plots=False, tokenizer=tokenizer, objective="grpo", rewards=[grpo_probe.says_cat])
    classifier = lambda: LlamaForSequenceClassification(lm_probe.base_model().config)  # noqa: E731
    cases = [
        (dict(num_generations=1), "--num-generations must be at least 2"),
        (dict(batch_size=6, num_generations=4), "--batch-size 6 counts completions and must be a multiple of "
                                                "--num-generations 4"),
        (dict(objective="lm", rewards=None, num_generations=4), "--num-generations applies with --objective grpo"),
        (dict(objective="lm", num_generations=8, max_completion_length=256), "--rewards applies with --objective grpo"),
        (dict(loss="mse"), "leave --loss out"),
        (dict(rewards=[raising]), r"the reward function raising raised ValueError: no score for this \(on the prompt "),
        (dict(rewards=[too_few]), r"the reward function too_few returned 1 rewards for \d completions"),
        (dict(rewards=[not_a_number]), "the reward function not_a_number returned nan for the prompt "),
        (dict(rewards=[]), "--objective grpo needs reward functions"),
        (dict(generation_groups=3), "--generation-groups 3: each process holds 2 prompts a micro-batch, not a multiple of 3"),
        (dict(max_length=2), "is a prompt of [34] tokens: a prompt holds from 1 to --max-length 2 tokens"),
        (dict(data=lm_probe.conversations(8, 0)), "generates from prompts"),
        (dict(tokenizer=None), "give --tokenizer"),
        (dict(model=classifier), "LlamaForSequenceClassification has no language-model head"),
        (dict(data=grpo_probe.prompts(8, 0)[:4] + [{"prompt": 3}]), "sample 4 has a prompt of type int"),
        (dict(data=[{"prompt": "hello"}, {"prompt": "cat", "completion": "sat"}]), "sample 1 is prompt/completion data"),
    ]
    for i, (case, message) in enumerate(cases):
        data, model = case.pop("data", prompts), case.pop("model", lm_probe.base_model)
        with pytest.raises(ConfigError, match=message):
            acc_trainer.fit(model(), data, output_dir=str(tmp_path / str(i)), **{**options, **case})
        reset_accelerate()
        assert not (tmp_path / str(i)).exists(), case


def test_grpo_from_the_command_line(main_in_process, tmp_path):
    """`acc-trainer --objective grpo --rewards pkg.module:fn=WEIGHT,...` on a JSONL file of prompts: the weights count
    in the total reward, the figures reach the tracker (TensorBoard) as metrics.jsonl has them, the run folder loads
    with from_pretrained; a reward function's failure is one line, exit 2."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    lm_probe.chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
    with open(tmp_path / "prompts.jsonl", "w") as out:
        for row in grpo_probe.prompts(8, 0):
            out.write(json.dumps(row) + "\n")
    args = ["--model", "lm_probe:base_model", "--dataset", tmp_path / "prompts.jsonl", "--tokenizer",
            tmp_path / "tokenizer", "--objective", "grpo", "--batch-size", "4", "--num-generations", "2",
            "--max-completion-length", "4", "--max-steps", "2", "--log-every", "1", "--progress", "none", "--no-plots"]
    code, out, err = main_in_process(*args, "--rewards", "grpo_probe:says_cat,grpo_probe:brief=0.5",
                                     "--output-dir", tmp_path / "run", "--log-with", "tensorboard")
    assert code == 0, err
    events = EventAccumulator(str(tmp_path / "run" / "logs" / "acc_trainer"))
    events.Reload()
    logged = [row for row in metrics(tmp_path / "run") if "loss" in row]
    for name in ("reward", "rewards/brief/mean", "rewards/says_cat/std", "completions/mean_length", "entropy",
                 "clip_ratio", "generation_time_s"):
        assert [e.value for e in events.Scalars(f"train/{name}")] == pytest.approx([row[name] for row in logged]), name
    for row in logged:
        assert row["reward"] == pytest.approx(row["rewards/says_cat/mean"] + 0.5 * row["rewards/brief/mean"])
    AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    code, out, err = main_in_process(*args, "--rewards", "test_grpo:raising", "--output-dir", tmp_path / "bad")
    assert code == 2 and err.strip().count("\n") == 0 and "the reward function raising raised ValueError" in err, err


def test_evaluate_and_predict_on_a_run_folder_made_from_objects(runs):
    """evaluate(RUN_DIR, model=..., data=..., rewards=[...]) gives the run's final evaluation again (its reward
    functions given back: config.yaml names only import paths); predict one row per prompt with its rewards."""
    import acc_trainer

    run, held_out = runs[1] / "base", grpo_probe.data("base")[1]
    reset_accelerate()
    with one_thread():
        found = acc_trainer.evaluate(run, model=lm_probe.base_model(0), data=held_out, rewards=grpo_probe.REWARDS)
        rows = acc_trainer.predict(run, model=lm_probe.base_model(0), data=held_out, rewards=grpo_probe.REWARDS)
    reset_accelerate()
    assert found.pop("samples") == 5 and found == pytest.approx(summary(run)["eval"], abs=1e-9)
    assert [row["index"] for row in rows] == list(range(5))
    assert sum(row["output"]["reward"] for row in rows) / 5 == pytest.approx(found["reward"])


def test_a_reward_function_that_fails_on_one_process_stops_both_in_one_line(tmp_path):
    """A reward function that raises on process 1 alone (at the second step's rollout): every process ends with the
    line naming the function, exit 2; process 0 does not wait at the step's next collective for a process gone."""
    lm_probe.chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
    with open(tmp_path / "prompts.jsonl", "w") as out:
        for row in grpo_probe.prompts(16, 0):
            out.write(json.dumps(row) + "\n")
    result = launch("--model", "lm_probe:base_model", "--dataset", tmp_path / "prompts.jsonl", "--tokenizer",
                    tmp_path / "tokenizer", "--objective", "grpo", "--rewards", "grpo_probe:flaky", "--batch-size", "8",
                    "--num-generations", "2", "--max-completion-length", "3", "--max-steps", "4", "--progress", "none",
                    "--no-plots", "--output-dir", tmp_path / "run", launcher_args=("--multi_gpu", "--num_processes", "2"),
                    cwd=REPO / "tests", timeout=120)
    # Process 0 says why (not "lost contact with another process", as it did while it waited alone).
    assert result.returncode == 2 and "Traceback" not in result.stderr and "lost contact" not in result.stderr
    assert "acc-trainer: error (rank 0): the reward function flaky raised ValueError: no reward on this process (on the " \
           "prompt " in result.stderr, result.stderr[-3000:]

