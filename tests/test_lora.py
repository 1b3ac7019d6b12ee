"""LoRA (--lora, through peft): only the adapters train, on the base weights --init-from gave; the run folder
holds the adapter in peft's own format and, with --lora-merge, the merged model; checkpoints hold what trains
and resume bit for bit, the frozen base built again and checked; evaluate rebuilds the same model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from lm_probe import base_model, documents, pad  # noqa: E402 - after the skips


@pytest.fixture
def fresh_state():
    from conftest import reset_accelerate

    reset_accelerate()
    yield reset_accelerate
    reset_accelerate()


def test_lora_trains_the_adapter_alone_saves_it_in_peft_format_and_resumes_bit_for_bit(tmp_path, fresh_state,
                                                                                       torch_on_one_thread):
    from peft import PeftModel
    from safetensors import safe_open
    from safetensors.torch import load_file, save_model

    import acc_trainer
    from acc_trainer.config import ConfigError

    init = tmp_path / "pretrained.safetensors"  # the "pretrained" base: other weights than the factory's
    save_model(base_model(seed=1), str(init))
    train, held_out = documents(48, 0), documents(16, 1)
    options = dict(eval_data=held_out, collate_fn=pad, lora=4, lora_targets=["q_proj", "v_proj", "down_proj"],
                   lora_merge=True, init_from=str(init), batch_size=8, max_steps=6, checkpoint_every="3",
                   eval_every=3, save_best="loss", optimizer="adamw", lr=2e-2, metrics=["perplexity"], progress="none",
                   plots=False)
    out = tmp_path / "run"
    model = base_model()
    summary = acc_trainer.fit(model, train, output_dir=str(out), **options)
    model.eval()

    # Only the adapters trained, on --init-from's base: every base tensor is the file's.
    pretrained = base_model(seed=1).state_dict()
    trained = dict(model.named_parameters())
    base = {n: p for n, p in trained.items() if "lora_" not in n}
    assert base and all(torch.equal(p, pretrained[n.replace(".base_layer", "")]) for n, p in base.items())
    adapters = {n: p for n, p in trained.items() if "lora_" in n}
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)  # lora_B starts at zero
    assert summary["init"]["missing"] == []  # the tied output layer, held once in the file, was loaded with it
    assert summary["parameters"] == {"trainable": sum(p.numel() for p in adapters.values()),
                                     "total": sum(p.numel() for p in trained.values())}

    # The run folder: peft's own format, not the whole model; the adapter gives the trained model's logits.
    assert not (out / "model.safetensors").exists()
    ids = torch.stack([d["input_ids"][:6] for d in held_out[:4]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for folder in (out, out / "checkpoints" / "step-00000006"):
            reloaded = base_model(seed=1).eval()  # as the user has the base: here, the pretrained weights
            reloaded.load_state_dict(pretrained, strict=False)
            assert torch.equal(PeftModel.from_pretrained(reloaded, folder)(input_ids=ids).logits, expected), folder
        assert json.loads((out / "checkpoints" / "best" / "adapter_config.json").read_text())["r"] == 4
        merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged").eval()
        assert type(merged) is transformers.LlamaForCausalLM and not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    assert "adapter_model.safetensors" in (out / "SHA256SUMS").read_text()

    # A checkpoint holds what trains: the adapters, not the frozen base (a fifth of the model here; 0.3% at 7B).
    checkpoint = out / "checkpoints" / "step-00000003"
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(f"base_model.model.{name}" for name in adapters)
    assert (checkpoint / "model.safetensors").stat().st_size < 0.3 * init.stat().st_size
    assert not (checkpoint / "config.json").exists()  # it would load a half-random model
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["frozen"]["parameters"] == len(base)

    # Resumed from step 3, with the base built and read again: the same adapter, bit for bit.
    again = tmp_path / "again"
    shutil.copytree(out, again)
    for name in ("adapter_model.safetensors", "adapter_config.json", "summary.json", "merged"):
        shutil.rmtree(again / name) if (again / name).is_dir() else (again / name).unlink()
    shutil.rmtree(again / "checkpoints" / "step-00000006")
    fresh_state()
    resumed = acc_trainer.fit(base_model(), train, output_dir=str(again), resume="auto", **options)
    assert resumed["resumed_from"].endswith("step-00000003")
    first, second = load_file(out / "adapter_model.safetensors"), load_file(again / "adapter_model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)

    # The pretrained file changed since: the frozen base is no longer the one the adapters were trained on.
    save_model(base_model(seed=2), str(init))
    fresh_state()
    with pytest.raises(ConfigError, match="the frozen ones built again differ from the ones it was trained with"):
        acc_trainer.fit(base_model(), train, output_dir=str(again), resume=str(checkpoint), **options)
    save_model(base_model(seed=1), str(init))

    # evaluate(RUN, model=..., data=...) builds the same model: the base, --init-from, the adapter.
    fresh_state()
    results = acc_trainer.evaluate(out, model=base_model(), data=held_out)
    assert results["loss"] == pytest.approx(summary["eval"]["loss"], abs=1e-6)


def test_a_partly_frozen_model_with_tied_weights_checkpoints_what_trains_and_resumes(tmp_path, fresh_state,
                                                                                     torch_on_one_thread):
    """--freeze on a causal LM whose embedding and output layer are one tensor (trained, under two names): a step
    checkpoint holds it once and leaves the frozen layer out; the best checkpoint is whole (from_pretrained loads the
    model of the best evaluation); resumed, the same run."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    import acc_trainer

    options = dict(collate_fn=pad, freeze=r"^model\.layers\.0\.", batch_size=8, max_steps=6, checkpoint_every="3",
                   save_best="loss", eval_every=3, optimizer="sgd", lr=0.2, progress="none", plots=False)
    out = tmp_path / "run"
    summary = acc_trainer.fit(base_model(), documents(48, 0), documents(16, 1), output_dir=str(out), **options)
    with safe_open(str(out / "checkpoints" / "step-00000003" / "model.safetensors"), "pt") as f:
        held = set(f.keys())
    assert not any(".layers.0." in k for k in held) and any(".layers.1." in k for k in held)
    assert len(held & {"model.embed_tokens.weight", "lm_head.weight"}) == 1  # the tied tensor, once
    with safe_open(str(out / "checkpoints" / "best" / "model.safetensors"), "pt") as f:
        assert any(".layers.0." in k for k in f.keys())
    best, loading = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "best",
                                                                     output_loading_info=True)
    assert not any(loading.values()) and best.lm_head.weight is best.model.embed_tokens.weight, loading
    # Its loss over the evaluation documents (all at once: the mean over their tokens) is the best evaluation's, which
    # is not the last one's.
    with torch.no_grad():
        loss = best.eval()(**pad(documents(16, 1))).loss.item()
    assert loss == pytest.approx(summary["best"]["value"], abs=1e-5)
    assert abs(summary["best"]["value"] - summary["eval"]["loss"]) > 1e-3
    again = tmp_path / "again"
    shutil.copytree(out / "checkpoints" / "step-00000003", again / "checkpoints" / "step-00000003")
    fresh_state()
    acc_trainer.fit(base_model(), documents(48, 0), documents(16, 1), output_dir=str(again), resume="auto", **options)
    first, second = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_lora_mistakes_are_one_line(main_in_process, tmp_path, fresh_state):
    import acc_trainer
    from acc_trainer.config import ConfigError

    train = documents(8, 0)
    with pytest.raises(ConfigError, match=r"--lora-targets qkv: no such layer in LlamaForCausalLM \(its layers: "
                                          r"embed_tokens, q_proj, k_proj, v_proj, o_proj, gate_proj"):
        acc_trainer.fit(base_model(), train, collate_fn=pad, lora=4, lora_targets=["qkv"], max_steps=1, batch_size=4,
                        progress="none", output_dir=str(tmp_path / "a"))
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    fresh_state()
    with pytest.raises(ConfigError, match=r"--lora on Sequential: name the layers to adapt with --lora-targets \(its "
                                          r"layers: 0, 2\)"):
        acc_trainer.fit(net, data, lora=2, max_steps=1, batch_size=4, progress="none", output_dir=str(tmp_path / "b"))
    code, out, err = main_in_process("--model", "mlp", "--lora-alpha", "16", "--max-steps", "1")
    assert (code, out, err) == (2, "", "acc-trainer: error: --lora-alpha applies with --lora RANK\n")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written by a refused start
