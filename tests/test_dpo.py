"""DPO on the training loop (--objective dpo): on a fixed batch the loss and the figures are TRL's DPOTrainer's (a frozen
copy as the reference, and LoRA with its adapters off); 1 vs 2 processes vs accumulation end on the same weights
within 1e-5 (tests/dpo_probe.py, 2 processes forked once); a resume ends bit for bit where the run without a stop ends; evaluation
counts every pair once, and the run folders load with from_pretrained / PeftModel.from_pretrained and their tokenizer;
the wrong data or options are one line."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("peft")
trl = pytest.importorskip("trl")

import dpo_probe  # noqa: E402 - after the skips
import lm_probe  # noqa: E402
from conftest import distance, forked, metrics, one_thread, reset_accelerate, summary, weights  # noqa: E402

from acc_trainer.config import ConfigError  # noqa: E402
from acc_trainer.data import text as chat  # noqa: E402
from acc_trainer.objectives import dpo as preference  # noqa: E402
from acc_trainer.workload.losses import batch_loss  # noqa: E402

BETA = 0.1


def moved(model, seed: int, scale: float, only: str = ""):
    """The model off its starting weights, as after some training (the loss is then not log 2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def trl_trainer(rows, tokenizer, model, tmp_path, ref_model=None, peft_config=None):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    # bf16=False: TRL's configs default to bf16 autocast, on a CPU too.
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", max_steps=0, use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(rows), beta=BETA, logging_strategy="no", save_strategy="no")
    return DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=tokenizer, peft_config=peft_config)


def ours(trainer_model, forward, rows, tokenizer):
    """acc_trainer's loss, figures and gradients on the batch of `rows` (tokenized and collated as a run does)."""
    pairs = chat.Tokenized(rows, tokenizer, "preference")
    batch = chat.preference_collate(chat.pad_id(tokenizer))([pairs[i] for i in range(len(pairs))])
    _, _, loss = batch_loss(trainer_model, batch, preference.dpo_loss(BETA), forward)
    figures = {name: (value / loss.items).item() for name, value in loss.parts.items()}
    return loss.value / loss.items, figures


def trls(trainer):
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    loss = trainer.compute_loss(trainer.model, dict(batch))
    logged = trainer._metrics["train"]
    figures = {"rewards_chosen": logged["rewards/chosen"][-1], "rewards_rejected": logged["rewards/rejected"][-1],
               "reward_margin": logged["rewards/margins"][-1], "reward_accuracy": logged["rewards/accuracies"][-1]}
    return loss, figures


def gradients(model, loss) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("chat_pairs", [False, True], ids=["text", "chat"])
def test_loss_is_trls_with_a_frozen_copy(tmp_path, chat_pairs):
    """The policy moved off its start, the reference a frozen copy of the start: loss, figures and gradients are
    TRL's."""
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_GEN)
    rows = dpo_probe.pairs(6, 3, chat_pairs)
    model = lm_probe.base_model()
    forward = preference.DPOForward(preference.Reference("copy"))
    preference.start(forward, model)  # the copy: the starting weights
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # TRL's, taken before its trainer patches the model
    trainer = trl_trainer(rows, tokenizer, moved(model, 1, 0.05), tmp_path, ref_model=reference)
    trl_loss, trl_figures = trls(trainer)
    mine, figures = ours(model, forward, rows, tokenizer)
    assert abs(mine.item() - trl_loss.item()) < 1e-6 and abs(mine.item() - 0.6931) > 1e-3
    assert figures == pytest.approx(trl_figures, abs=1e-6)
    max_diff = max((a - b).abs().max().item() for a, b in zip(gradients(model, mine), gradients(model, trl_loss)))
    assert max_diff < 1e-6


def test_a_model_with_dropout_trains_without_it_as_trls(tmp_path):
    """TRL's DPOTrainer turns the model's dropout off (disable_dropout, its default), so do we: on a GPT-2 with
    dropout 0.1 in training mode, the loss and gradients are TRL's; the start line says so."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_GEN)
    rows = dpo_probe.pairs(6, 5)

    def gpt2():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=lm_probe.VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64))

    model = gpt2().train()
    forward = preference.DPOForward(preference.Reference("copy"))
    (note,) = preference.start(forward, model)
    assert note == "--objective dpo: the reference is a frozen copy of the starting weights; dropout off in 7 layers " \
                   "(as TRL's DPOTrainer)"
    trained = moved(gpt2(), 1, 0.05)
    trainer = trl_trainer(rows, tokenizer, trained, tmp_path, ref_model=copy.deepcopy(gpt2()).eval())
    model.load_state_dict(trained.state_dict())
    trl_loss, _ = trls(trainer)
    mine, _ = ours(model, forward, rows, tokenizer)
    assert abs(mine.item() - trl_loss.item()) < 1e-6 and abs(mine.item() - 0.6931) > 1e-3


def test_the_reference_runs_under_the_runs_mixed_precision(tmp_path):
    """Under bf16 autocast the policy's forward is autocast; so is the copy's: at a learning rate of 1e-30 the policy is
    its reference (1e-30 moves no weight), every reward 0 and the loss log 2 exactly, as with TRL's reference prepared alike."""
    import acc_trainer

    options = {**dpo_probe.COMMON, "lr": 1e-30, "max_steps": 2, "eval_every": None, "mixed_precision": "bf16"}
    with one_thread():
        acc_trainer.fit(lm_probe.base_model(), dpo_probe.data("full")[0], output_dir=str(tmp_path / "run"),
                        tokenizer=lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN), **options)
    reset_accelerate()
    logged = [row for row in metrics(tmp_path / "run") if "loss" in row]
    assert len(logged) == 2
    assert all(row["rewards_chosen"] == row["rewards_rejected"] == row["reward_margin"] == 0 for row in logged)
    assert all(row["loss"] == pytest.approx(0.693147, abs=1e-6) for row in logged)


def test_the_adapters_off_reference_leaves_every_layers_mode(tmp_path):
    """The adapters-off reference runs in evaluation mode, and every layer goes back to its own mode (a layer kept in
    evaluation mode, as frozen BatchNorm layers are, stays so); the adapters are on again afterwards."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(lm_probe.base_model(), LoraConfig(r=4, target_modules="all-linear")).train()
    moved(model, 3, 0.1, only="lora_B")
    kept = model.base_model.model.model.norm.eval()
    forward = preference.DPOForward(preference.Reference("adapter"))
    preference.start(forward, model)
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_GEN)
    pairs = chat.Tokenized(dpo_probe.pairs(4, 6), tokenizer, "preference")
    batch = chat.preference_collate(chat.pad_id(tokenizer))([pairs[i] for i in range(len(pairs))])
    outputs, _ = forward(model, batch)
    assert not kept.training and all(m.training for m in model.modules() if m is not kept)
    with torch.no_grad():
        again = preference.sequence_logps(model, batch)  # adapters on: the policy's, not the reference's
    assert torch.allclose(again.chunk(2)[0], outputs["chosen_logps"], atol=1e-6)
    assert not torch.allclose(outputs["chosen_logps"], outputs["ref_chosen_logps"], atol=1e-3)


def test_loss_is_trls_with_lora_adapters_off(tmp_path):
    """LoRA (TRL's peft_config): the reference is the same model with its adapters switched off."""
    from peft import LoraConfig

    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_GEN)
    rows = dpo_probe.pairs(6, 4)
    trainer = trl_trainer(rows, tokenizer, lm_probe.base_model(), tmp_path,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert trainer.ref_model is None
    model = moved(trainer.model, 2, 0.1, only="lora_")  # the adapters off zero
    forward = preference.DPOForward(preference.Reference("adapter"))
    preference.start(forward, model)
    trl_loss, trl_figures = trls(trainer)
    mine, figures = ours(model, forward, rows, tokenizer)
    assert abs(mine.item() - trl_loss.item()) < 1e-6 and abs(mine.item() - 0.6931) > 1e-3
    assert figures == pytest.approx(trl_figures, abs=1e-6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the 2-process runs' folder, the 1-process runs' folder): full and LoRA on 2 processes, every job on 1."""
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    forked(dpo_probe.run_jobs, two, ["full", "lora", "unequal"], processes=2)
    reset_accelerate()
    with one_thread():
        dpo_probe.run_jobs(one, ["full", "accumulated", "lora"])
    reset_accelerate()
    return two, one




def test_processes_and_accumulation_end_on_the_same_weights(runs):
    """2 processes, 1 process, and 1 process with 2 pairs a pass end within 1e-5 of each other, after moving far
    more (full and LoRA); the same evaluations (at steps 3 and 6, every pair once); the figures logged at each step."""
    two, one = runs
    start = {k: v for k, v in lm_probe.base_model().state_dict().items() if k in weights(one / "full")}
    for job, other in (("full", two / "full"), ("full", one / "accumulated"), ("lora", two / "lora"),
                       ("full", two / "unequal")):
        assert distance(weights(one / job), weights(other)) < 1e-5, (job, other)
        assert summary(other)["eval"] == pytest.approx(summary(one / job)["eval"], abs=1e-5)
    assert distance(weights(one / "full"), start) > 0.05
    assert max(v.abs().max().item() for k, v in weights(one / "lora").items() if "lora_B" in k) > 1e-3
    for folder in (one / "full", two / "full", two / "lora"):
        evaluations = [row for row in metrics(folder) if "eval_loss" in row]
        assert [row["step"] for row in evaluations] == [3, 6] and {row["eval_samples"] for row in evaluations} == {5}
        assert len([row for row in metrics(folder) if "loss" in row]) == 6

    # reward_accuracy: the share of the step's 8 pairs whose chosen reward is the higher. None at step 1, where the
    # policy is its reference (every reward 0); most of them once trained; the same share however the pairs were
    # split over processes and passes.
    def accuracies(folder):
        return [row["reward_accuracy"] for row in metrics(folder) if "loss" in row]

    for job, others in (("full", (two / "full", one / "accumulated")), ("lora", (two / "lora",))):
        first = next(row for row in metrics(one / job) if "loss" in row)
        assert (first["rewards_chosen"], first["rewards_rejected"], first["reward_accuracy"]) == (0, 0, 0)
        shares = accuracies(one / job)
        assert all(8 * share == round(8 * share) for share in shares) and shares[-1] > 0.5, shares
        assert all(accuracies(other) == shares for other in others), job
    assert any("initial weights differed between processes" in note for note in summary(two / "unequal")["notes"])


def direct_evaluation(model, rows, tokenizer, forward) -> dict:
    """The loss and figures over every evaluation pair at once, with `model` and `forward`'s reference."""
    with torch.no_grad():
        loss, figures = ours(model.eval(), forward, rows, tokenizer)
    return {"loss": loss.item(), **figures}


def test_run_folders_load_and_evaluation_counts_every_pair_once(runs):
    """The 2-process run folders load with from_pretrained (PeftModel.from_pretrained for LoRA) and the tokenizer
    saved beside them; the loss and figures over the 5 evaluation pairs at once, from those weights, are the run's
    final evaluation (batches of 4 over 2 processes: each pair once)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    two, _ = runs
    tokenizer = AutoTokenizer.from_pretrained(two / "full")
    assert tokenizer.chat_template == lm_probe.TEMPLATE_PLAIN
    model = AutoModelForCausalLM.from_pretrained(two / "full")
    forward = preference.DPOForward(preference.Reference("copy"))
    preference.start(forward, lm_probe.base_model())
    _, eval_rows = dpo_probe.data("full")
    assert direct_evaluation(model, eval_rows, tokenizer, forward) == pytest.approx(summary(two / "full")["eval"], abs=1e-5)

    adapted = PeftModel.from_pretrained(lm_probe.base_model(), two / "lora")
    forward = preference.DPOForward(preference.Reference("adapter"))
    preference.start(forward, adapted)
    _, eval_rows = dpo_probe.data("lora")
    found = direct_evaluation(adapted, eval_rows, AutoTokenizer.from_pretrained(two / "lora"), forward)
    assert found == pytest.approx(summary(two / "lora")["eval"], abs=1e-5)


def test_a_resume_ends_bit_for_bit_where_the_run_ends(runs, tmp_path):
    """Resumed from step 3 (the reference copied again from the model as given), the run ends on the same weights
    and evaluations as the run without a stop, bit for bit."""
    import acc_trainer

    _, one = runs
    options = {**dpo_probe.COMMON, **{k: v for k, v in dpo_probe.JOBS["full"].items() if k != "chat"}}
    with one_thread():
        acc_trainer.fit(lm_probe.base_model(), *dpo_probe.data("full"), output_dir=str(tmp_path / "resumed"),
                        tokenizer=lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN),
                        resume=str(one / "full" / "checkpoints" / "step-00000003"), **options)
    reset_accelerate()
    resumed, whole = weights(tmp_path / "resumed"), weights(one / "full")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert json.dumps(summary(tmp_path / "resumed")["eval"]) == json.dumps(summary(one / "full")["eval"])


def test_the_wrong_data_or_options_are_one_line(tmp_path):
    from transformers import LlamaForSequenceClassification

    import acc_trainer

    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    classifier = lambda: LlamaForSequenceClassification(lm_probe.base_model().config)  # noqa: E731 - a reward model's shape
    options = dict(batch_size=2, max_steps=1, progress="none", plots=False, tokenizer=tokenizer)
    cases = [
        (dict(data=dpo_probe.pairs(4, 0)), "preference pairs .* --objective dpo"),
        (dict(data=lm_probe.conversations(4, 0), objective="dpo"), "trains on preference pairs"),
        (dict(data=dpo_probe.pairs(4, 0), objective="dpo", loss="mse"), "leave --loss out"),
        (dict(data=dpo_probe.pairs(4, 0), objective="dpo", dpo_beta=0.0), "--dpo-beta must be positive"),
        (dict(data=dpo_probe.pairs(4, 0), objective="dpo", dpo_reference="adapter"), "give --lora"),
        (dict(data=lm_probe.conversations(4, 0), dpo_beta=0.5), "--dpo-beta applies with --objective dpo"),
        (dict(data=dpo_probe.pairs(4, 0), objective="dpo", train_on_prompt=True), "--train-on-prompt applies to "),
        (dict(data=dpo_probe.pairs(4, 0), objective="dpo", model=classifier), "LlamaForSequenceClassification has no "
                                                                               "language-model head"),
    ]
    for i, (case, message) in enumerate(cases):
        data, model = case.pop("data"), case.pop("model", lm_probe.base_model)
        with pytest.raises(ConfigError, match=message):
            acc_trainer.fit(model(), data, output_dir=str(tmp_path / str(i)), **options, **case)
        reset_accelerate()
        assert not (tmp_path / str(i)).exists()


def test_a_resume_from_init_from_weights_keeps_their_reference(tmp_path):
    """--init-from's weights are the reference; a resume (whose checkpoint holds every weight, so --init-from is not
    loaded into the model again) still copies them as the reference: it ends bit for bit where the whole run ends."""
    import acc_trainer

    moved(lm_probe.base_model(), 5, 0.05).save_pretrained(tmp_path / "start")
    options = {**dpo_probe.COMMON, "max_steps": 4, "eval_every": None, "checkpoint_every": 2,
               "init_from": str(tmp_path / "start"), "tokenizer": lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)}
    train, _ = dpo_probe.data("full")
    with one_thread():
        acc_trainer.fit(lm_probe.base_model(), train, output_dir=str(tmp_path / "whole"), **options)
        reset_accelerate()
        acc_trainer.fit(lm_probe.base_model(), train, output_dir=str(tmp_path / "resumed"), **options,
                        resume=str(tmp_path / "whole" / "checkpoints" / "step-00000002"))
    reset_accelerate()
    resumed, whole = weights(tmp_path / "resumed"), weights(tmp_path / "whole")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_a_dpo_run_folder_evaluates_and_predicts_from_the_command_line(main_in_process, tmp_path):
    """`acc-trainer evaluate RUN_DIR` (and `acc_trainer.evaluate(RUN_DIR, ...)`) gives the run's final evaluation (the
    reference rebuilt from the starting weights, the pairs through the run's tokenizer); `predict` one row per pair,
    with the reference's log-probs those of the model as built before training."""
    import acc_trainer

    run = tmp_path / "run"
    code, _, err = main_in_process(
        "--model", "lm_probe:base_model", "--dataset", "dpo_probe:data", "--dataset-args", "{job: full}",
        "--tokenizer", "lm_probe:chat_tokenizer", "--objective", "dpo", "--batch-size", "4", "--max-steps", "4",
        "--optimizer", "sgd", "--lr", "2.0", "--output-dir", run, "--progress", "none", "--no-plots")
    assert code == 0, err
    code, _, err = main_in_process("evaluate", run, "--output", tmp_path / "evaluated.json")
    assert code == 0, err
    evaluated = json.loads((tmp_path / "evaluated.json").read_text())
    assert {k: evaluated[k] for k in summary(run)["eval"]} == pytest.approx(summary(run)["eval"], abs=1e-6)
    # From Python too: the pairs through the run folder's tokenizer, the reference the model as built, as above.
    reset_accelerate()
    from_python = acc_trainer.evaluate(run, model=lm_probe.base_model(), data=dpo_probe.data("full")[1], progress="none")
    assert {k: from_python[k] for k in summary(run)["eval"]} == pytest.approx(summary(run)["eval"], abs=1e-6)
    code, _, err = main_in_process("predict", run, "--output", tmp_path / "pairs.jsonl")
    assert code == 0, err
    rows = [json.loads(line)["output"] for line in open(tmp_path / "pairs.jsonl")]
    assert len(rows) == 5
    tokenizer = lm_probe.chat_tokenizer()
    batch = chat.preference_collate(chat.pad_id(tokenizer))([chat.tokenize_pair(tokenizer, dpo_probe.data("full")[1][0])])
    with torch.no_grad():
        start_chosen, start_rejected = preference.sequence_logps(lm_probe.base_model().eval(), batch).tolist()
    assert rows[0]["ref_chosen_logps"] == pytest.approx(start_chosen, abs=1e-4)
    assert rows[0]["ref_rejected_logps"] == pytest.approx(start_rejected, abs=1e-4)
    assert rows[0]["chosen_logps"] != pytest.approx(start_chosen, abs=1e-3)  # the trained model's, not the start's


def test_a_lora_run_with_a_copied_reference_evaluates_as_it_ran(main_in_process, tmp_path):
    """--lora with --dpo-reference copy: evaluate's reference is the starting weights (the base, its new adapters
    adding nothing), not the trained adapters: the run's own final evaluation."""
    run = tmp_path / "run"
    code, _, err = main_in_process(
        "--model", "lm_probe:base_model", "--dataset", "dpo_probe:data", "--dataset-args", "{job: lora}",
        "--tokenizer", "lm_probe:chat_tokenizer", "--objective", "dpo", "--lora", "4", "--dpo-reference", "copy",
        "--batch-size", "4", "--max-steps", "4", "--optimizer", "sgd", "--lr", "2.0", "--output-dir", run,
        "--progress", "none", "--no-plots")
    assert code == 0, err
    assert abs(summary(run)["eval"]["reward_margin"]) > 1e-3  # the trained adapters moved off the reference
    code, _, err = main_in_process("evaluate", run, "--output", tmp_path / "evaluated.json")
    assert code == 0, err
    evaluated = json.loads((tmp_path / "evaluated.json").read_text())
    assert {k: evaluated[k] for k in summary(run)["eval"]} == pytest.approx(summary(run)["eval"], abs=1e-6)
