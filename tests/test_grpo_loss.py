"""GRPO's loss (--objective grpo) is TRL 1.16 GRPOTrainer's: fed the same completions (prompts of two lengths left-
padded, completions right-padded, some ended early by EOS), the same advantages, old log-probabilities (as under
--num-iterations 2, off the current ones so that the clipped surrogate clips tokens on both sides, with epsilon_high
!= epsilon) and reference log-probabilities, acc_trainer's token_logps + grpo_loss (sum / count, one process, one
micro-batch) give TRL's `_compute_loss` and its gradients within 1e-6, for dapo, grpo, bnpo and dr_grpo, beta 0 and
beta > 0, at a temperature other than 1 (TRL scores at logits / temperature through its fused LM head); the figures
(clip ratio, KL, entropy) are TRL's metrics. And the advantages are TRL's sum_then_normalize on a rewards table with
None (NaN) rewards, an unscorable completion and a group of equal rewards, for --scale-rewards group, batch and none.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import lm_probe  # noqa: E402 - after the skips
from conftest import one_thread, reset_accelerate  # noqa: E402

from acc_trainer.objectives.grpo import LossOptions, grpo_loss, token_logps  # noqa: E402
from acc_trainer.objectives.rewards import _nanstd, advantages  # noqa: E402

TEMPERATURE = 0.7
EPSILON, EPSILON_HIGH = 0.2, 0.28
GROUP = 3
MAX_COMPLETION = 8  # more than the completions' width (6): dr_grpo divides by the option, not by the width
BETA = 0.3
PROMPTS = ("what is the capital of france", "say hello")  # 6 and 2 tokens: the second left-padded
LENGTHS = (6, 3, 6, 1, 4, 6)  # each completion's tokens up to and with its EOS (6: cut at the width, no EOS)
ADVANTAGES = (1.1, -0.3, -0.8, 0.7, -1.2, 0.5)  # both signs in each group
# log(new / old) per token: ratios 0.61, 0.74 (clipped below 1 - epsilon = 0.8 when the advantage is < 0; inside
# 1 - epsilon_high = 0.72, so a loss clipping at 1 - epsilon_high would not clip them), 0.82, 0.90, 1, 1.05, 1.16,
# 1.25 (between 1 + epsilon and 1 + epsilon_high: clipped only by a loss clipping at 1 + epsilon), 1.49, 1.82
# (clipped above 1 + epsilon_high when the advantage is > 0). None within 1e-2 of a bound: the two sides' log-
# probabilities (float32 softmaxes, differently ordered) differ by ~1e-7 and never take different sides of a bound.
OFFSETS = (-0.5, -0.3, -0.2, -0.1, 0.0, 0.05, 0.15, 0.22, 0.4, 0.6)
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny Llama (float64: the models' own rounding far below the tolerance; both sides score tokens in float32)
    saved, so that TRL, given beta > 0, builds its reference from the policy's config path, offline."""
    folder = tmp_path_factory.mktemp("grpo") / "base"
    lm_probe.base_model(seed=3).double().save_pretrained(folder)
    return folder


def batch(tokenizer) -> dict:
    """Two groups of GROUP completions: prompts left-padded, completions right-padded after their EOS."""
    width = max(LENGTHS)
    g = torch.Generator().manual_seed(0)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    longest = max(len(p) for p in prompts)
    prompt_ids = torch.full((len(LENGTHS), longest), tokenizer.pad_token_id)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((len(LENGTHS), width), tokenizer.pad_token_id)
    completion_mask = torch.zeros_like(completion_ids)
    for row, length in enumerate(LENGTHS):
        p = prompts[row // GROUP]
        prompt_ids[row, longest - len(p):], prompt_mask[row, longest - len(p):] = torch.tensor(p), 1
        completion_ids[row, :length] = torch.randint(5, lm_probe.VOCAB, (length,), generator=g)
        if length < width:
            completion_ids[row, length - 1] = tokenizer.eos_token_id
        completion_mask[row, :length] = 1
    assert len(set(map(len, prompts))) > 1 and (completion_mask == 0).any()
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.tensor(ADVANTAGES)}


def trl_trainer(model, tokenizer, folder, loss_type: str, beta: float):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    # bf16=False: TRL's configs default to bf16 autocast, on a CPU too.
    args = GRPOConfig(output_dir=str(folder), per_device_train_batch_size=len(LENGTHS), num_generations=GROUP,
                      loss_type=loss_type, beta=beta, epsilon=EPSILON, epsilon_high=EPSILON_HIGH,
                      max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE, num_iterations=2,
                      scale_rewards="group", report_to=[], use_cpu=True, bf16=False, activation_checkpointing=False,
                      logging_strategy="no", save_strategy="no")
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": list(PROMPTS) * GROUP}), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one micro-batch a step here
    assert trainer.args.steps_per_generation == 1 and trainer.accelerator.num_processes == 1
    return trainer


def gradients(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def off_policy(current: torch.Tensor, mask: torch.Tensor, advantage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, reference) log-probabilities: the current ones moved by OFFSETS (old) and by noise (the reference)."""
    g = torch.Generator().manual_seed(1)
    offsets = torch.tensor(OFFSETS)[torch.randint(0, len(OFFSETS), current.shape, generator=g)]
    ratio, a, kept = offsets.exp(), advantage[:, None], mask.bool()
    for region in (ratio < 1 - EPSILON_HIGH, (ratio > 1 - EPSILON_HIGH) & (ratio < 1 - EPSILON)):
        assert (region & (a < 0) & kept).any()  # clipped below (and where only epsilon, not epsilon_high, clips)
    for region in (ratio > 1 + EPSILON_HIGH, (ratio > 1 + EPSILON) & (ratio < 1 + EPSILON_HIGH)):
        assert (region & (a > 0) & kept).any()  # clipped above (and where only epsilon_high keeps it unclipped)
    assert ((ratio > 1 + EPSILON_HIGH) & (a < 0) & kept).any()  # outside the bounds, the unclipped term is the min
    reference = current + 0.3 * torch.randn(current.shape, generator=g)
    return current - offsets, reference


def ours_loss(model, inputs: dict, options: LossOptions) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """acc_trainer's loss as its loop takes it with one process and one micro-batch: sum / count."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    width = inputs["completion_ids"].shape[1]
    logps, entropies = token_logps(model, ids, attention, width, TEMPERATURE)
    value, count, figures = grpo_loss(logps, inputs["old_per_token_logps"], inputs.get("ref_per_token_logps"),
                                      inputs["advantages"], inputs["completion_mask"], options)
    return value / count, figures, entropies


CASES = [(loss_type, beta) for loss_type in ("dapo", "grpo", "bnpo", "dr_grpo") for beta in (0.0, BETA)]


@pytest.mark.parametrize(("loss_type", "beta"), CASES, ids=[f"{t}-beta{b}" for t, b in CASES])
def test_loss_and_gradients_are_trls(saved, tmp_path, loss_type, beta):
    """Loss, gradients (parameter by parameter) and figures: TRL's within 1e-6, with tokens clipped both ways."""
    from transformers import LlamaForCausalLM

    reset_accelerate()
    try:
        with one_thread():
            tokenizer = lm_probe.chat_tokenizer()
            policy = LlamaForCausalLM.from_pretrained(saved, dtype=torch.float64)
            mine = copy.deepcopy(policy)  # before TRL patches the policy's forward with its fused LM head
            trainer = trl_trainer(policy, tokenizer, tmp_path / "trl", loss_type, beta)
            assert (trainer.ref_model is not None) == (beta != 0)
            trainer.model.train()
            mine.train()
            inputs = batch(tokenizer)
            mask = inputs["completion_mask"]
            with torch.no_grad():
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
                attention = torch.cat([inputs["prompt_mask"], mask], 1)
                current, _ = token_logps(mine, ids, attention, mask.shape[1], TEMPERATURE)
            old, reference = off_policy(current, mask, inputs["advantages"])
            inputs.update(old_per_token_logps=old, num_items_in_batch=mask.sum())
            if beta:
                inputs["ref_per_token_logps"] = reference

            theirs = trainer._compute_loss(trainer.model, dict(inputs))
            their_grads = gradients(trainer.model, theirs)
            options = LossOptions(loss_type, beta, EPSILON, EPSILON_HIGH, MAX_COMPLETION)
            loss, figures, entropies = ours_loss(mine, inputs, options)
            my_grads = gradients(mine, loss)

            # the batch tells the options apart: clipping, each epsilon, and the KL term all move the loss
            with torch.no_grad():
                others = [LossOptions(loss_type, beta, 10.0, 10.0, MAX_COMPLETION),
                          LossOptions(loss_type, beta, EPSILON_HIGH, EPSILON, MAX_COMPLETION),
                          LossOptions(loss_type, beta, EPSILON, EPSILON, MAX_COMPLETION)]
                others += [LossOptions(loss_type, beta / 2, EPSILON, EPSILON_HIGH, MAX_COMPLETION)] if beta else []
                for other in others:
                    assert abs(ours_loss(mine, inputs, other)[0].item() - theirs.item()) > 1e-4, other
    finally:
        reset_accelerate()

    loss_diff = abs(loss.item() - theirs.item())
    assert abs(theirs.item()) > 1e-3 and loss_diff < TOLERANCE, (loss.item(), theirs.item())
    assert set(my_grads) == set(their_grads) and len(my_grads) > 5
    grad_diffs = {}
    for name, their in their_grads.items():
        scale = their.abs().max().item()
        assert scale > 0, name
        grad_diffs[name] = (my_grads[name] - their).abs().max().item()
        assert grad_diffs[name] <= TOLERANCE * max(1.0, scale), (name, grad_diffs[name], scale)
    worst = max(grad_diffs, key=grad_diffs.get)
    print(f"{loss_type} beta={beta}: loss {loss.item():.9f} (TRL {theirs.item():.9f}, diff {loss_diff:.2e}); "
          f"max gradient diff {grad_diffs[worst]:.2e} ({worst}, scale {their_grads[worst].abs().max().item():.2e})")

    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    tokens = figures["tokens"].item()
    assert tokens == mask.sum().item()
    assert figures["clip_ratio"].item() / tokens == pytest.approx(metrics["clip_ratio/region_mean"], abs=TOLERANCE)
    assert figures["clip_ratio"].item() > 0
    assert ((entropies * mask).sum() / tokens).item() == pytest.approx(metrics["entropy"], abs=TOLERANCE)
    if beta:
        assert figures["kl"].item() / tokens == pytest.approx(metrics["kl"], abs=TOLERANCE) and metrics["kl"] > 1e-3
    else:
        assert figures["kl"] is None and "kl" not in metrics


# ------------------------------------------------------------------------------------------------ advantages

NAN = math.nan
# Groups of 3 completions, two reward functions (weights 1 and 0.5); NaN: the function returned None.
TABLE = [[1.0, 0.2], [0.0, 0.4], [0.5, NAN],  # a None: the completion scored by the other function
         [NAN, NAN], [1.0, 1.0], [0.2, 0.0],  # no function scored the first: out of its group's mean and std
         [0.5, 0.0], [0.5, 0.0], [0.0, 1.0],  # the same total reward thrice: the group's std 0
         [NAN, NAN], [NAN, NAN], [2.0, 1.0],  # one scored completion: its group's std NaN
         [0.3, 0.9], [0.8, 0.1], [-0.4, 0.6]]
WEIGHTS = (1.0, 0.5)


def trl_advantages(table: torch.Tensor, weights: torch.Tensor, group: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL 1.16's GRPOTrainer._generate_and_score_completions, multi_objective_aggregation="sum_then_normalize",
    its lines on one process (rewards_per_func -> advantages)."""
    from trl.trainer.utils import nanstd

    unscorable_mask = torch.isnan(table).all(dim=1)
    rewards = (table * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    if scale in ("group", "none"):
        std_rewards = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), rewards


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale):
    from trl.trainer.utils import nanstd

    table, weights = torch.tensor(TABLE, dtype=torch.float64), torch.tensor(WEIGHTS, dtype=torch.float64)
    expected, rewards = trl_advantages(table, weights, GROUP, scale)
    batch_std = nanstd(rewards) if scale == "batch" else None  # the global batch's, over the scored completions
    got, total = advantages(table, weights, GROUP, scale, batch_std)
    assert torch.equal(total.isnan(), rewards.isnan()) and torch.allclose(total.nan_to_num(), rewards.nan_to_num())
    assert torch.allclose(got, expected, rtol=0, atol=TOLERANCE), (got, expected)
    assert got[[3, 6, 7, 8, 9, 10, 11]].abs().max() < 1e-9  # unscorable, equal rewards, a group of one
    assert abs(got[4] + got[5]) < 1e-9 and got[4] > 0.1  # the unscorable completion out of its group's mean
    # the batch's deviation as the rollout takes it (rewards.py's _nanstd) is TRL's nanstd
    assert torch.allclose(_nanstd(total), nanstd(rewards), rtol=0, atol=TOLERANCE)
