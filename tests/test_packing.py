"""Packing (--pack, acc_trainer.data.packing): documents of tokens as blocks of one length, every document whole and
once, its first token never a target; attention within each document (the packed loss is the loss of the same
documents one by one), proved on the model at start and refused where it does not hold; the token loss exact
with accumulation. The 2-process run is tests/lm_probe.py's (`documents`, `tiny_llama` and `pack` below build the
same data in a launched script)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 64


def documents(n: int, seed: int, longest: int = 30) -> list[torch.Tensor]:
    """`n` documents of random tokens, 2 to `longest` long (1-D tensors, as a tokenizer's ids)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(2, longest + 1, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def tiny_llama(seed: int = 0, attention: str = "sdpa"):
    """A small Llama from its config, as transformers makes it: `use_cache` on, as every causal LM's config has."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, attn_implementation=attention))


def token_sets():
    """`--dataset test_packing:token_sets`: (training documents, evaluation documents)."""
    return documents(40, 0), documents(8, 1)


def segments(block: dict) -> list[tuple[list[int], list[int]]]:
    """A block cut where its position ids restart: (tokens, labels) of each document in it."""
    starts = [i for i, p in enumerate(block["position_ids"].tolist()) if p == 0] + [len(block["input_ids"])]
    assert block["position_ids"].tolist() == [p for a, b in zip(starts, starts[1:]) for p in range(b - a)]
    return [(block["input_ids"][a:b].tolist(), block["labels"][a:b].tolist()) for a, b in zip(starts, starts[1:])]


def test_blocks_hold_every_document_whole_once_and_train_no_first_token():
    from acc_trainer.config import ConfigError, TrainConfig
    from acc_trainer.data.packing import pack
    from acc_trainer.workload.components import build_data

    lengths = [3, 7, 5, 12, 1, 4, 0, 8]  # 40 tokens; the 12 is longer than a block
    docs = [torch.arange(n) + 100 * (i + 1) for i, n in enumerate(lengths)]  # every token says its document
    packed = pack(docs, 8)
    blocks = [packed[i] for i in range(len(packed))]
    assert len(blocks) == 5 and packed.tokens == 40  # best-fit decreasing fills 5 blocks: no padding at all
    assert all(set(b) == {"input_ids", "labels", "position_ids"} and len(b["input_ids"]) == 8 for b in blocks)
    pieces = sorted(tokens for b in blocks for tokens, _ in segments(b))
    wanted = sorted([d.tolist() for d in docs if 0 < len(d) <= 8] + [docs[3][:8].tolist(), docs[3][8:].tolist()])
    assert pieces == wanted  # whole (the long one in two pieces), once each, none lost
    for block in blocks:
        for tokens, labels in segments(block):
            assert labels == [-100] + tokens[1:]  # a document's first token is never a target

    # Dicts: their own labels kept (a prompt left untrained), padding by their attention_mask left out; a last
    # block with room gets padding, never trained, positions from 0 (a document of its own).
    doc = {"input_ids": torch.tensor([5, 6, 7, 8, 0, 0]), "labels": torch.tensor([-100, -100, 7, 8, -100, -100]),
           "attention_mask": torch.tensor([1, 1, 1, 1, 0, 0])}
    block = pack([doc, [9, 10, 11]], 10, pad_id=3)[0]
    assert block["input_ids"].tolist() == [5, 6, 7, 8, 9, 10, 11, 3, 3, 3]
    assert block["labels"].tolist() == [-100, -100, 7, 8, -100, 10, 11, -100, -100, -100]
    assert block["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert pack(docs, 8) is not packed and pack(packed, 8) is packed  # planned the same; not packed twice

    # What is not a document of tokens is one line that says what the samples are.
    images = [(torch.zeros(3, 8, 8), 1)] * 4
    for given, said in ((images, "sample 0 of list is a tuple (tensor [3, 8, 8] float32, int), not a document of "
                                 "tokens (packing without token inputs)"),
                        ([{"input_ids": [1, 2], "text": "ab"}], "hold 'text' beside input_ids"),
                        ([torch.tensor([0.5, 1.5])], "sample 0 of list is a tensor [2] float32")):
        with pytest.raises(ConfigError, match=None) as e:
            pack(given, 8)
        assert said in str(e.value) and "\n" not in str(e.value)
    data = build_data(TrainConfig(dataset="test_packing:token_sets", batch_size=4, pack=16))  # --pack's way in
    assert [type(s).__name__ for s in (data.train, data.eval)] == ["Packed", "Packed"] and data.train.length == 16
    with pytest.raises(ConfigError, match=r"--pack: sample 0 of synthetic is a tuple \(tensor \[3, 32, 32\] float32, "
                                          r"tensor \[\] int64\), not a document of tokens"):
        build_data(TrainConfig(dataset="synthetic", train_size=64, eval_size=16, batch_size=8, pack=16))
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(docs)

    # A stream is packed as it is read, a window of documents at a time: here one, so the blocks of the set
    # (tests/test_text_streams.py for smaller windows).
    assert [{k: v.tolist() for k, v in b.items()} for b in pack(Stream(), 8)] == \
        [{k: v.tolist() for k, v in b.items()} for b in blocks]
    with pytest.raises(ConfigError, match="--pack takes a block length of at least 2 tokens, got 1"):
        TrainConfig(pack=1).validate()


def test_the_packed_loss_is_the_loss_of_each_document_alone(tmp_path, torch_on_one_thread):
    """Through `evaluate` (the run's evaluation path): the packed token mean equals the mean over the documents
    run one at a time, within 1e-5, on sdpa and eager; without position_ids the documents attend to each other
    and it does not. A model that attends across documents anyway is refused at start, in one line."""
    import acc_trainer
    from acc_trainer.config import ConfigError
    from acc_trainer.data.packing import pack

    docs = documents(40, 0)
    for attention in ("sdpa", "eager"):
        model = tiny_llama(attention=attention).eval()
        with torch.no_grad():  # the reference, by hand: each document alone, its tokens after the first predicted
            losses = [(model(input_ids=d[None], labels=d[None]).loss * (len(d) - 1), len(d) - 1) for d in docs]
        alone = float(sum(s for s, _ in losses) / sum(n for _, n in losses))
        packed = acc_trainer.evaluate(model, docs, pack=32, eval_batch_size=4, progress="none")
        assert packed["loss"] == pytest.approx(alone, abs=1e-5), attention

    blocks = pack(docs, 32)
    assert len(blocks) < len(docs) / 2  # documents do share blocks
    no_positions = [{k: v for k, v in blocks[i].items() if k != "position_ids"} for i in range(len(blocks))]
    across = acc_trainer.evaluate(model, no_positions, eval_batch_size=4, progress="none")
    assert abs(across["loss"] - alone) > 1e-3

    from transformers import OPTConfig, OPTForCausalLM  # takes position_ids, yet attends across documents

    opt = OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                   num_attention_heads=4, word_embed_proj_dim=32))
    with pytest.raises(ConfigError) as e:
        acc_trainer.fit(opt, docs, pack=32, batch_size=4, max_steps=1, output_dir=str(tmp_path / "opt"),
                        progress="none")
    assert "--pack: model transformers.models.opt.modeling_opt:OPTForCausalLM lets packed documents attend to each " \
           "other" in str(e.value) and "\n" not in str(e.value)


def test_packed_training_is_the_same_with_accumulation(tmp_path, torch_on_one_thread):
    """Blocks hold different numbers of trained tokens (each document's first is not one): the loss is their
    token mean over the global batch, so 1 micro-batch of 4 and 2 of 2 end with the same weights."""
    import acc_trainer

    train, held_out = documents(64, 1, longest=40), documents(16, 2)
    weights, summaries = [], []
    for accumulation in (1, 2):
        model = tiny_llama(seed=3)
        summaries.append(acc_trainer.fit(model, train, held_out, pack=32, batch_size=4, grad_accum=accumulation,
                                         max_steps=4, optimizer="adamw", lr=1e-2, progress="none", plots=False,
                                         output_dir=str(tmp_path / f"accumulation{accumulation}")))
        weights.append(model.state_dict())
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < 1e-5
    assert summaries[0]["eval"]["loss"] == pytest.approx(summaries[1]["eval"]["loss"], abs=1e-5)
    assert weights[0]["model.embed_tokens.weight"].ne(tiny_llama(seed=3).model.embed_tokens.weight).any()  # trained
