"""Log-probabilities and token losses over a language model's logits, taken in float32 a chunk of positions at a time
(losses.chunked): DPO's per-row log-probabilities and the token cross-entropy equal the whole-tensor computation
within 1e-6, their gradients too, over several chunks (the last one ragged) and padded rows, and no float32 tensor
of the whole [rows, tokens, vocabulary] exists on the way, forward or backward."""

from __future__ import annotations

import contextlib
import weakref
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode  # torch's documented home of it; no public alias

from acc_trainer.objectives import dpo as preference
from acc_trainer.workload import losses

VOCABULARY, ROWS, TOKENS = 1000, 6, 37
# 7 positions a chunk: the 6 x 37 = 222 positions are 32 chunks, the last one of 5.
CHUNK_ELEMENTS = 7 * VOCABULARY + 3


@pytest.fixture
def model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture
def batch():
    """Rows as chat.preference_collate pads them: right padded, the completion after a prompt."""
    g = torch.Generator().manual_seed(1)
    attention = torch.ones(ROWS, TOKENS, dtype=torch.long)
    attention[1, 30:] = attention[4, 19:] = 0
    completion = torch.zeros(ROWS, TOKENS, dtype=torch.long)
    completion[:, 9:] = 1
    return {"input_ids": torch.randint(0, VOCABULARY, (ROWS, TOKENS), generator=g) * attention,
            "attention_mask": attention, "completion_mask": completion * attention}


def whole_tensor_logps(model, batch, autocast):
    """sequence_logps as it was: the whole logits in float32."""
    with autocast():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    per_token = logits.gather(2, targets[..., None]).squeeze(2) - logits.logsumexp(-1)
    return (per_token * batch["completion_mask"][:, 1:]).sum(1)


def with_gradients(model, logps) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The log-probabilities, and the gradients of the weights through a sum that weighs each row differently."""
    model.zero_grad()
    (logps * torch.arange(1.0, len(logps) + 1)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return logps.detach(), grads


def assert_equal_within_1e6(actual: torch.Tensor, expected: torch.Tensor):
    """Within 1e-6 of the tensor's scale: float32's rounding a few times over, what a different order of the same
    sums gives (here the two compute the same sums, one chunk at a time)."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


class Float32OverVocabulary(TorchDispatchMode):
    """The float32 tensors over the vocabulary (their last dimension) that operations make, autograd's backward
    included: the most elements of one (`largest`) and of all those alive at once (`peak`). The model's own float32
    tensors (RMSNorm's) are over its hidden size."""

    def __init__(self):
        super().__init__()
        self.largest = self.peak = self.live = 0
        self.storages = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() and t.shape[-1] == VOCABULARY:
                self.largest = max(self.largest, t.numel())
                storage = t.untyped_storage()
                if id(storage) not in self.storages:  # a new tensor, not a view of one
                    self.storages.add(id(storage))
                    self.live += storage.nbytes() // 4
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, id(storage), storage.nbytes() // 4)
        return out

    def _freed(self, key: int, elements: int):
        self.storages.discard(key)
        self.live -= elements


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_chunked_log_probabilities_and_their_gradients_are_the_whole_tensors(model, batch, precision):
    autocast = (lambda: torch.autocast("cpu", torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    expected, expected_grads = with_gradients(model, whole_tensor_logps(model, batch, autocast))
    with mock.patch.object(losses, "CHUNK_ELEMENTS", CHUNK_ELEMENTS), \
            mock.patch.object(preference, "token_logps", wraps=preference.token_logps) as per_chunk:
        logps, grads = with_gradients(model, preference.sequence_logps(model, batch, autocast))
    assert per_chunk.call_count == 2 * 32  # each chunk in the forward, and again in the backward
    assert_equal_within_1e6(logps, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_equal_within_1e6(grad, expected_grad)
    assert expected_grads[-1].abs().sum() > 0  # the output layer's weights, which the logits' gradient reaches


def test_no_float32_tensor_holds_the_whole_logits(model, batch):
    """A bfloat16 model, whose logits are bfloat16: a float32 tensor over the vocabulary is one chunk's at most, and
    those alive at once a few chunks' (4: the chunk's copy and its intermediates), forward and backward. Before,
    logits[:, :-1].float() was [rows, tokens - 1, vocabulary]; chunks whose float32 copies autograd kept for the
    backward add up to more than that (34 chunks' here)."""
    model.to(torch.bfloat16)
    with mock.patch.object(losses, "CHUNK_ELEMENTS", CHUNK_ELEMENTS), Float32OverVocabulary() as float32:
        preference.sequence_logps(model, batch).sum().backward()
    assert next(model.parameters()).grad is not None
    whole = ROWS * (TOKENS - 1) * VOCABULARY
    assert float32.largest <= CHUNK_ELEMENTS, f"a float32 tensor of {float32.largest} elements, the chunk is " \
                                              f"{CHUNK_ELEMENTS}, the whole logits {whole}"
    assert float32.peak <= 8 * CHUNK_ELEMENTS, f"{float32.peak} float32 elements at once, the chunk is " \
                                               f"{CHUNK_ELEMENTS}, the whole logits {whole}"


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_token_cross_entropy_is_the_whole_tensors_in_chunks(batch, label_smoothing, dtype):
    """losses.cross_entropy on a sequence model's [B, T, V] logits against [B, T] labels (-100 ignored): the sum over
    the tokens, their count and the logits' gradient are F.cross_entropy's over the whole logits in float32, and no
    float32 tensor over the vocabulary exceeds a chunk. The whole logits as [B x T, V], the layout of the chunks (and
    of transformers' own loss): torch's [B, V, T] path, which the loss took before, rounds the label-smoothed gradient
    otherwise (here 9e-6 from float64's, where [B x T, V]'s is 6e-7)."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(ROWS, TOKENS, VOCABULARY, generator=g) * 3).to(dtype).requires_grad_()
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    expected = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), label_smoothing=label_smoothing,
                               reduction="sum")
    (expected_grad,) = torch.autograd.grad(expected, logits)
    with mock.patch.object(losses, "CHUNK_ELEMENTS", CHUNK_ELEMENTS), Float32OverVocabulary() as float32:
        total, count = losses.cross_entropy({"logits": logits}, labels, label_smoothing=label_smoothing)
        (grad,) = torch.autograd.grad(total, logits)
    if dtype == torch.bfloat16:
        assert float32.largest <= CHUNK_ELEMENTS, f"a float32 tensor of {float32.largest} elements, the chunk is " \
                                                  f"{CHUNK_ELEMENTS}, the whole logits {logits.numel()}"
        assert float32.peak <= 8 * CHUNK_ELEMENTS, f"{float32.peak} float32 elements at once"
    assert count == (labels != -100).sum() == 143
    assert_equal_within_1e6(total.detach(), expected.detach())
    assert_equal_within_1e6(grad.float(), expected_grad.float())
    assert grad.dtype == dtype and grad[labels == -100].abs().max() == 0
