"""The model FLOPs a run publishes (`model_flops_per_sample`, and from it `flops_per_s` and `mfu`): every
matrix multiply counted, transformers' and attention's included, against formulas written by hand, and
the model left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from acc_trainer.workload.measure import flops_per_sample

pytestmark = pytest.mark.usefixtures("torch_on_one_thread")

TOKENS, WIDTH, LAYERS, VOCAB = 64, 64, 2, 96


def training_flops(matrix_weights: int, attention_layers: int, tokens: int = TOKENS, width: int = WIDTH) -> int:
    """2 FLOPs a multiply-add. Forward: every weight matrix once per token, and per attention layer Q K^T and
    the weights times V (tokens x tokens x width multiply-adds each, summed over heads). Training: 3x that
    (the backward computes the gradients of both inputs of every product)."""
    forward = 2 * matrix_weights * tokens + attention_layers * 2 * 2 * tokens * tokens * width
    return 3 * forward


def gpt2():
    """A 2-layer GPT-2 built from its config (nothing downloaded), with transformers' default attention."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=4, n_positions=TOKENS, vocab_size=VOCAB,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


# Per block: the Q, K, V projection (d x 3d), the attention's output (d x d), the MLP (d x 4d, 4d x d);
# then the LM head (d x vocabulary). GPT-2 holds the blocks' matrices in transformers' Conv1D.
GPT2_FLOPS = training_flops(LAYERS * 12 * WIDTH * WIDTH + WIDTH * VOCAB, LAYERS)


def close(counted: int, expected: int) -> bool:
    return abs(counted - expected) <= 0.05 * expected


def test_a_gpt2_run_publishes_the_flops_of_every_matrix_multiply(tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    import acc_trainer

    ids = torch.randint(0, VOCAB, (16, TOKENS), generator=torch.Generator().manual_seed(0))
    samples = [{"input_ids": row, "labels": row} for row in ids]
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    s = acc_trainer.fit(gpt2(), samples, batch_size=8, max_steps=2, optimizer="sgd", progress="none", plots=False,
                        output_dir=str(tmp_path / "run"))
    assert s["steps"] == 2
    assert close(s["model_flops_per_sample"], GPT2_FLOPS), (s["model_flops_per_sample"], GPT2_FLOPS)


def test_a_padding_mask_is_counted_on_the_model_itself():
    """transformers reads the mask's values, which the copy on the meta device has none of: the sample then
    runs through the model (with the CPU's fused attention kernel, which torch's counter leaves out)."""
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, TOKENS, dtype=torch.long)
    counted = flops_per_sample(gpt2(), {"input_ids": ids, "attention_mask": mask, "labels": ids})
    assert close(counted, GPT2_FLOPS), (counted, GPT2_FLOPS)


class Attention(nn.Module):
    """Tokens -> embedding -> one nn.MultiheadAttention (self-attention) -> classes."""

    def __init__(self, need_weights: bool, classes: int = 10):
        super().__init__()
        self.need_weights = need_weights
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(self.attention(x, x, x, need_weights=self.need_weights)[0].mean(1))


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights (matmuls)", "no weights (fused kernel)"])
def test_multihead_attention(need_weights):
    tokens = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    counted = flops_per_sample(Attention(need_weights), [tokens, None])
    # in_proj (d x 3d) and out_proj (d x d) on every token; the head on the mean of them, once
    expected = training_flops(4 * WIDTH * WIDTH, 1) + 3 * 2 * WIDTH * 10
    assert close(counted, expected), (counted, expected)


class Stateful(nn.Module):
    """BatchNorm statistics, dropout's random numbers, and a tensor its forward caches in an attribute (as
    torchvision's anchor generator does); `reads_values`: its forward also branches on a value."""

    def __init__(self, reads_values: bool):
        super().__init__()
        self.reads_values = reads_values
        self.fc1, self.norm, self.drop, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 2)
        self.scale = None

    def forward(self, x):
        if self.scale is None:
            self.scale = torch.ones(16, device=x.device)
        h = self.drop(self.norm(self.fc1(x))) * self.scale
        if self.reads_values and h.sum() > 1e9:
            h = h / 2
        return self.fc2(h)


@pytest.mark.parametrize("reads_values", [False, True], ids=["on a copy", "on the model"])
def test_counting_leaves_the_model_and_the_random_numbers_as_they_were(reads_values):
    torch.manual_seed(0)
    model = Stateful(reads_values).train()
    sample, before = torch.randn(1, 8), {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    counted = flops_per_sample(model, [sample, None])
    assert counted == 3 * 2 * (8 * 16 + 16 * 2) - 2 * 8 * 16  # the first layer's input needs no gradient
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # whatever the forward caches is a real tensor or nothing: the model still trains
    assert model.scale is None or model.scale.device.type == "cpu"
    model(torch.randn(4, 8)).sum().backward()


def test_a_model_the_counter_cannot_run_still_trains(tmp_path):
    """The count runs one sample; this model refuses batches of one (as any model the counter cannot run
    fails it): the run goes on, warns, and publishes no FLOP/s."""
    from accelerate.state import AcceleratorState, GradientState

    import acc_trainer

    class PairsOnly(nn.Linear):
        def forward(self, x):
            if len(x) < 2:
                raise ValueError("batches of two or more")
            return super().forward(x)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    with pytest.warns(UserWarning, match=r"model FLOPs not counted \(ValueError: batches of two or more\)"):
        s = acc_trainer.fit(PairsOnly(4, 2), data, batch_size=16, max_steps=2, progress="none", plots=False,
                            output_dir=str(tmp_path / "run"))
    assert s["steps"] == 2
    assert (s["model_flops_per_sample"], s["flops_per_s"], s["mfu"]) == (0, None, None)


def test_the_built_in_models_count_what_running_them_counts():
    """The copy on the meta device against the model itself run forward and backward under torch's counter."""
    from torch.utils.flop_counter import FlopCounterMode

    from acc_trainer.data.datasets import Data
    from acc_trainer.workload.models import MODELS

    cases = [(name, (3, 32, 32)) for name in MODELS if name != "linreg"] + [("resnet18", (3, 64, 64)),
                                                                            ("linreg", (1,))]
    for name, shape in cases:
        task = "regression" if name == "linreg" else "classification"
        model = MODELS[name](Data(None, None, task, None if name == "linreg" else 10, shape))
        sample = torch.randn(*shape)
        counted = flops_per_sample(model, [sample[None], None])
        model.eval()
        with FlopCounterMode(display=False) as reference:
            model(sample[None]).sum().backward()
        assert counted == reference.get_total_flops(), name
