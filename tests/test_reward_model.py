"""Reward models on the training loop (--objective reward): on a fixed batch the loss and its gradients are TRL's
RewardTrainer's (with and without a margin column and reward centring); a short run learns a learnable preference
(tests/reward_probe.py), 1 and 2 processes end on the same weights within 1e-5 (2 processes forked once) and evaluate every pair
once; the run folder loads with AutoModelForSequenceClassification.from_pretrained and gives the trained model's
rewards; such a folder is a reward function (GRPO's `--rewards model:PATH`) that gives the folder model's scores; the
wrong model, data or options are one line."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

import lm_probe  # noqa: E402 - after the skip
import reward_probe  # noqa: E402
from conftest import forked, metrics, one_thread, reset_accelerate, summary, weights  # noqa: E402

from acc_trainer.config import ConfigError  # noqa: E402
from acc_trainer.data import text as chat  # noqa: E402
from acc_trainer.objectives import reward  # noqa: E402
from acc_trainer.objectives.rewards import reward_functions  # noqa: E402
from acc_trainer.workload.losses import batch_loss  # noqa: E402


def moved(model, seed: int, scale: float = 0.05):
    """The model off its starting weights, its score head scaled up: rewards of some size, the loss not log 2."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
        model.score.weight.mul_(5)
    return model


def batch_of(rows, tokenizer, margins: bool) -> dict:
    """The batch a run makes of `rows` (tokenized by chat.Tokenized, which keeps a margin column, collated by
    reward_collate)."""
    pairs = chat.Tokenized(rows if margins else [{k: v for k, v in r.items() if k != "margin"} for r in rows], tokenizer,
                           "preference")
    return reward.reward_collate(chat.pad_id(tokenizer))([pairs[i] for i in range(len(pairs))])


def gradients(model, loss) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads


CASES = {"text": (False, False, None), "text-margin-centred": (False, True, 0.01), "chat-margin": (True, True, None),
         "chat-centred": (True, False, 0.05)}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_are_trls(tmp_path, case):
    """The same batch (6 pairs, text or chat, a margin column or not) through TRL 1.16's RewardTrainer.compute_loss and
    through the run's collate, forward and loss: the same rows, the same loss (the sum over pairs / pairs) and the same
    gradients within 1e-6, with and without --center-rewards-coefficient."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    chat_pairs, margins, center = CASES[case]
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_GEN)
    rows = reward_probe.pairs(6, 3, chat_pairs, margin=margins)
    model = moved(reward_probe.reward_model(), 1)
    # bf16=False, gradient_checkpointing=False: TRL's configs default to both, on a CPU too.
    args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to="none", max_steps=0, use_cpu=True, bf16=False,
                        gradient_checkpointing=False, per_device_train_batch_size=len(rows), logging_strategy="no",
                        save_strategy="no", center_rewards_coefficient=center)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    theirs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trl_loss = trainer.compute_loss(trainer.model, dict(theirs))

    objective = reward.RewardModel()
    batch = batch_of(rows, tokenizer, margins)
    assert torch.equal(batch["input_ids"], theirs["input_ids"])
    assert torch.equal(batch["attention_mask"], theirs["attention_mask"])
    assert ("margin" in batch) == margins and (not margins or torch.equal(batch["margin"], theirs["margin"]))
    outputs, _, loss = batch_loss(model, batch, reward.reward_loss(center), reward.reward_forward)
    mine = loss.value / loss.items
    assert int(loss.items) == 6 and abs(mine.item() - trl_loss.item()) < 1e-6 and abs(mine.item() - 0.6931) > 1e-2
    logged = trainer._metrics["train"]
    assert (loss.parts["accuracy"] / 6).item() == pytest.approx(logged["accuracy"][-1], abs=1e-6)
    assert (loss.parts["margin"] / 6).item() == pytest.approx(logged["margin"][-1], abs=1e-6)
    differences = [(a - b).abs().max().item() for a, b in zip(gradients(model, mine), gradients(model, trl_loss),
                                                                strict=True)]
    assert max(differences) < 1e-6 and len(differences) == len(list(model.parameters()))
    print(f"{case}: loss {mine.item():.6f} vs TRL {trl_loss.item():.6f} ({abs(mine.item() - trl_loss.item()):.1e}); "
          f"largest gradient difference {max(differences):.1e}")
    assert objective.name == "reward" and objective.reference is None and not objective.copies_weights


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the 2-process runs' folder, the 1-process runs' folder, the models the 1-process runs trained)."""
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    forked(reward_probe.run_jobs, two, ["text", "chat", "tokenized"], processes=2)
    reset_accelerate()
    with one_thread():
        trained = reward_probe.run_jobs(one)
    reset_accelerate()
    return two, one, trained


def direct(model, rows, tokenizer, center=None, tokenized: bool = False) -> dict:
    """The loss and figures over `rows` (pairs, or pairs tokenized already) at once, with `model` in evaluation mode."""
    samples = rows if tokenized else list(chat.Tokenized(rows, tokenizer, "preference"))
    batch = reward.reward_collate(chat.pad_id(tokenizer))(samples)
    with torch.no_grad():
        outputs, _, loss = batch_loss(model.eval(), batch, reward.reward_loss(center), reward.reward_forward)
    return {"loss": (loss.value / loss.items).item(), **{k: (v / loss.items).item() for k, v in loss.parts.items()}}, \
        outputs


def test_a_short_run_learns_the_preference(runs):
    """On pairs whose chosen completion holds "good" and whose rejected one never does, the reward model's accuracy on
    the held-out pairs goes from the starting weights' to every pair; the loss falls; the figures at every log step and
    evaluation (9 pairs, each once)."""
    _, one, _ = runs
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    for job in ("text", "chat"):
        start = reward_probe.reward_model()
        start.config.pad_token_id = chat.pad_id(tokenizer)
        before, _ = direct(start, reward_probe.data(job)[1], tokenizer)
        logged = [row for row in metrics(one / job) if "loss" in row]
        evaluations = [row for row in metrics(one / job) if "eval_loss" in row]
        assert len(logged) == 10 and {"accuracy", "margin"} <= set(logged[0])
        assert [row["step"] for row in evaluations] == [5, 10] and {row["eval_samples"] for row in evaluations} == {9}
        after = summary(one / job)["eval"]
        print(f"{job}: held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, margin "
              f"{before['margin']:.4f} -> {after['margin']:.3f}, loss {before['loss']:.4f} -> {after['loss']:.4f}; "
              f"training loss {logged[0]['loss']:.4f} -> {logged[-1]['loss']:.4f}")
        assert after["accuracy"] == 1.0 and before["accuracy"] < 0.8 and after["margin"] > 0.5
        assert after["loss"] < 0.5 < before["loss"] and logged[-1]["loss"] < logged[0]["loss"]
        assert all(8 * row["accuracy"] == round(8 * row["accuracy"]) for row in logged)  # a share of 8 pairs


def test_processes_and_accumulation_end_on_the_same_weights(runs):
    """2 processes and 1 (and, for pairs tokenized beforehand with their margins, 1 with 2 pairs a pass) end within 1e-5,
    with the same evaluations (9 pairs in batches of 4, split unevenly) and the same figures at each step."""
    two, one, _ = runs
    start = reward_probe.reward_model().state_dict()
    assert max((weights(one / "tokenized")[k] - start[k]).abs().max().item() for k in start) > 1e-2  # it moved
    for job, first, other in (("text", one, two), ("chat", one, two), ("tokenized", one, two),
                              ("accumulated", one / "tokenized", one / "accumulated")):
        first, other = (first / job, other / job) if job != "accumulated" else (first, other)
        a, b = weights(first), weights(other)
        assert a.keys() == b.keys()
        gap = max((a[k] - b[k]).abs().max().item() for k in a)
        print(f"{job}: {'1 vs 2 processes' if job != 'accumulated' else '1 process vs 2 pairs a pass'}, largest weight "
              f"difference {gap:.1e}")
        assert gap < 1e-5
        assert summary(other)["eval"] == pytest.approx(summary(first)["eval"], abs=1e-5)
        assert {row["eval_samples"] for row in metrics(other) if "eval_loss" in row} == {9}
        steps = lambda folder: [(r["accuracy"], round(r["loss"], 4)) for r in metrics(folder) if "loss" in r]  # noqa: E731
        assert steps(other) == steps(first)


def test_the_run_folder_loads_and_gives_the_trained_rewards(runs):
    """AutoModelForSequenceClassification.from_pretrained(run folder) (and the tokenizer beside it) gives the trained
    model's rewards, and its loss and figures over the evaluation pairs at once are the run's final evaluation (on 2
    processes too)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    two, one, trained = runs
    for job in ("text", "chat"):
        center = reward_probe.JOBS[job].get("center_rewards_coefficient")
        loaded = AutoModelForSequenceClassification.from_pretrained(one / job)
        tokenizer = AutoTokenizer.from_pretrained(one / job)
        assert type(loaded).__name__ == "LlamaForSequenceClassification" and loaded.config.pad_token_id == 1
        rows = reward_probe.data(job)[1]
        found, outputs = direct(loaded, rows, tokenizer, center)
        _, expected = direct(trained[job], rows, tokenizer, center)
        for key in ("rewards_chosen", "rewards_rejected"):
            assert torch.allclose(outputs[key], expected[key], atol=1e-6, rtol=0)
        assert found == pytest.approx(summary(one / job)["eval"], abs=1e-5)
        found, _ = direct(AutoModelForSequenceClassification.from_pretrained(two / job), rows, tokenizer, center)
        assert found == pytest.approx(summary(two / job)["eval"], abs=1e-5)
    # acc_trainer.evaluate on the folder gives its final evaluation again; predict one row per pair, its two rewards.
    import acc_trainer

    rows = reward_probe.data("text")[1]
    again = acc_trainer.evaluate(one / "text", model=reward_probe.reward_model(), data=rows, progress="none")
    reset_accelerate()
    assert {k: again[k] for k in summary(one / "text")["eval"]} == pytest.approx(summary(one / "text")["eval"], abs=1e-6)
    predicted = acc_trainer.predict(one / "text", model=reward_probe.reward_model(), data=rows, progress="none")
    reset_accelerate()
    _, outputs = direct(trained["text"], rows, tokenizer)
    assert [row["output"]["rewards_chosen"] for row in predicted] == pytest.approx(outputs["rewards_chosen"].tolist(),
                                                                                    abs=1e-6)
    # Pairs tokenized beforehand keep their margin column: the run's evaluation loss is the one with the margins.
    loaded = AutoModelForSequenceClassification.from_pretrained(two / "tokenized")
    rows = reward_probe.data("tokenized")[1]
    found, _ = direct(loaded, rows, tokenizer, tokenized=True)
    assert found == pytest.approx(summary(two / "tokenized")["eval"], abs=1e-5)
    without, _ = direct(loaded, [{k: v for k, v in row.items() if k != "margin"} for row in rows], tokenizer,
                        tokenized=True)
    assert without["loss"] < found["loss"] - 0.1 and without["accuracy"] == found["accuracy"]


def test_a_reward_model_folder_is_a_reward_function(runs, tmp_path):
    """`model:PATH` (or the folder's path, `=WEIGHT` too) among the reward functions loads the folder's model and
    tokenizer once: its rewards of prompt + completion, for text and for chat (the completion as the assistant's
    message), are the folder model's scores of the pair's chosen sequence; a missing folder is one line."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _, one, _ = runs
    for job in ("text", "chat"):
        folder = one / job
        functions = reward_functions([f"model:{folder}", f"{folder}=2.5"])
        assert [(f.name, f.weight) for f in functions] == [(f"{job}_0", 1.0), (f"{job}_1", 2.5)]
        rows = reward_probe.data(job)[1]
        prompts = [row["prompt"] for row in rows]
        completions = [row["chosen"] for row in rows]  # as GRPO hands them: text, or [the assistant's message]
        given = functions[0].fn(prompts=prompts, completions=completions, completion_ids=[[0]] * len(rows),
                                other=[None] * len(rows))
        model = AutoModelForSequenceClassification.from_pretrained(folder)
        _, outputs = direct(model, rows, AutoTokenizer.from_pretrained(folder))
        assert len(given) == len(rows) and all(isinstance(v, float) for v in given)
        assert torch.allclose(torch.tensor(given), outputs["rewards_chosen"], atol=1e-6, rtol=0)
        assert torch.allclose(torch.tensor(functions[1].fn(prompts, completions)), torch.tensor(given), atol=1e-6)
    with pytest.raises(ConfigError, match="--rewards model:.*nowhere: no such folder"):
        reward_functions([f"model:{tmp_path / 'nowhere'}"])


def test_a_grpo_run_is_scored_by_the_reward_model(runs, tmp_path):
    """A GRPO step with `rewards=["model:PATH"]`: each completion's reward in completions.jsonl is the folder model's
    score of its prompt + completion."""
    import json

    import grpo_probe

    import acc_trainer

    _, one, _ = runs
    folder = one / "text"
    with one_thread():
        acc_trainer.fit(lm_probe.base_model(), grpo_probe.prompts(8, 0), tokenizer=lm_probe.chat_tokenizer(),
                        objective="grpo", rewards=[f"model:{folder}"], batch_size=4, num_generations=2,
                        max_completion_length=4, max_steps=2, optimizer="sgd", lr=0.1, log_completions=1,
                        progress="none", plots=False, output_dir=str(tmp_path / "grpo"))
    reset_accelerate()
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {tuple(row["rewards"]) for row in rows} == {("text",)}
    (scorer,) = reward_functions([str(folder)])
    again = scorer.fn([row["prompt"] for row in rows], [row["completion"] for row in rows])
    assert [row["rewards"]["text"] for row in rows] == pytest.approx(again, abs=1e-5)
    assert len({round(v, 4) for v in again}) > 1  # completions scored apart


def test_the_wrong_model_data_or_options_are_one_line(tmp_path, main_in_process):
    """A causal LM or a classifier of 2 outputs with --objective reward, data that is not pairs, its options elsewhere,
    and --objective dpo on a reward model: each one line (ConfigError), before any step and any file."""
    import acc_trainer

    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    options = dict(batch_size=2, max_steps=1, progress="none", plots=False, tokenizer=tokenizer)
    pairs = reward_probe.pairs(4, 0)
    cases = [
        (dict(model=lm_probe.base_model, objective="reward"), "LlamaForCausalLM is not one"),
        (dict(model=lambda: reward_probe.reward_model(num_labels=2), objective="reward"),
         "LlamaForSequenceClassification has 2 outputs"),
        (dict(data=lm_probe.conversations(4, 0), objective="reward"), "--objective reward trains on preference pairs"),
        (dict(objective="reward", loss="mse"), "leave --loss out"),
        (dict(objective="reward", dpo_beta=0.5), "--dpo-beta applies with --objective dpo"),
        (dict(objective="dpo", center_rewards_coefficient=0.01), "--center-rewards-coefficient applies with --objective "
                                                                  "reward"),
        (dict(objective="dpo"), "LlamaForSequenceClassification has no language-model head"),
        (dict(), "they train with --objective dpo .*or a reward model with --objective reward"),
    ]
    for i, (case, message) in enumerate(cases):
        data, model = case.pop("data", pairs), case.pop("model", reward_probe.reward_model)
        with pytest.raises(ConfigError, match=message) as caught:
            acc_trainer.fit(model(), data, output_dir=str(tmp_path / str(i)), **options, **case)
        reset_accelerate()
        assert "\n" not in str(caught.value) and not (tmp_path / str(i)).exists()
    # From the command line: one line on stderr, exit code 2.
    code, _, err = main_in_process("--model", "lm_probe:base_model", "--dataset", "dpo_probe:data", "--dataset-args",
                                   "{job: full}", "--tokenizer", "lm_probe:chat_tokenizer", "--objective", "reward",
                                   "--max-steps", "1", "--batch-size", "2", "--output-dir", tmp_path / "cli")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "LlamaForCausalLM is not one" in err, err
