"""A language model's runs on two processes against one (tests/lm_probe.py, one launch for all of them): full
training and LoRA end within rounding of each other, gradient checkpointing changes nothing, evaluation every N
steps gives perplexity = exp(loss) on the same evaluations, and a two-process run's folder (and its best
checkpoint) loads with from_pretrained and PeftModel.from_pretrained, giving the trained model's logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import lm_probe  # noqa: E402 - after the skips
from conftest import forked, one_thread, reset_accelerate  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the 2-process runs' folder, the 1-process runs' folder): every job of lm_probe on each."""
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    forked(lm_probe.run_jobs, two, output=two / "launch.stderr")
    reset_accelerate()
    with one_thread():
        lm_probe.run_jobs(one, ["full", "lora", "packed", "compiled", "chat", "chat_accumulated"])
    reset_accelerate()
    return two, one


def weights(folder):
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(folder / name)


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_processes_train_what_one_trains_full_lora_and_packed(runs):
    two, one = runs
    for job in ("full", "lora", "packed"):
        first, second = json.loads((two / job / "summary.json").read_text()), json.loads((one / job / "summary.json").read_text())
        assert (first["world_size"], second["world_size"]) == (2, 1)
        assert largest_difference(weights(two / job), weights(one / job)) < 1e-5, job
        # Evaluated at steps 3 and 6 (--eval-every 3) on every sample once, on either topology.
        for run in (first, second):
            samples = 16 if job != "packed" else json.loads((one / "packed" / "summary.json").read_text())["eval_samples"]
            assert [(e["step"], e["samples"]) for e in run["evals"]] == [(3, samples), (6, samples)]
            assert all(e["perplexity"] == math.exp(e["loss"]) for e in run["evals"])
        assert first["evals"][-1]["loss"] == pytest.approx(second["evals"][-1]["loss"], abs=1e-5)
    lora = json.loads((two / "lora" / "summary.json").read_text())["parameters"]
    assert 0 < lora["trainable"] < lora["total"] / 4


def test_chat_data_trains_the_same_on_every_topology_and_keeps_its_template(runs):
    """Chat messages given to fit() as they are (a template without generation blocks, the built-in padding collate):
    1 vs 2 processes vs accumulation end within 1e-5, on the assistant's tokens only; evaluation every 3 steps counts
    each conversation once; the run folder's tokenizer keeps its chat template; a chat prompt goes through it."""
    from transformers import AutoTokenizer

    two, one = runs
    reference = weights(one / "chat")
    for folder in (two / "chat", one / "chat_accumulated", two / "chat_accumulated"):
        assert largest_difference(weights(folder), reference) < 1e-5, folder
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    labelled = sum(sum(m for m in chat_masks(tokenizer, c["messages"])[1:]) for c in lm_probe.conversations(48, 0))
    for folder in (two, one):
        run = json.loads((folder / "chat" / "summary.json").read_text())
        assert [(e["step"], e["samples"]) for e in run["evals"]] == [(3, 16), (6, 16)]
        assert f"list: 48 chat samples tokenized, the loss on the assistant's tokens ({labelled:,} labelled tokens)" \
            in run["notes"]
        assert AutoTokenizer.from_pretrained(folder / "chat").chat_template == lm_probe.TEMPLATE_PLAIN
    assert run["evals"][-1]["loss"] == pytest.approx(json.loads((two / "chat" / "summary.json").read_text())
                                                     ["evals"][-1]["loss"], abs=1e-5)
    samples = [json.loads(line) for line in (two / "chat" / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [(3, [{"role": "user", "content": "say hello"}]),
                                                           (6, [{"role": "user", "content": "say hello"}])]


def chat_masks(tokenizer, messages) -> list[int]:
    """The assistant's tokens of a conversation as the template with generation blocks marks them."""
    return tokenizer.apply_chat_template(messages, chat_template=lm_probe.TEMPLATE_GEN, return_dict=True,
                                         return_assistant_tokens_mask=True)["assistant_masks"]


def test_a_compiled_language_model_keeps_every_guarantee(runs):
    """--compile on the Llama compiles its 2 layers in place: 1 vs 2 processes end within 1e-5 (and within 1e-5 of
    the eager run), the checkpoints and the final folder hold the model's own names (from_pretrained loads it), and a
    resume from the step-3 checkpoint ends bit-identical to the uninterrupted run."""
    two, one = runs
    for folder in (two, one):
        summary = json.loads((folder / "compiled" / "summary.json").read_text())
        assert "--compile: 2 repeated blocks compiled in place" in summary["notes"]
    assert largest_difference(weights(two / "compiled"), weights(one / "compiled")) < 1e-5
    assert largest_difference(weights(one / "compiled"), weights(one / "packed")) < 1e-5
    names = set(weights(one / "packed"))
    assert set(weights(one / "compiled")) == names == set(weights(two / "compiled" / "checkpoints" / "step-00000003"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(two / "compiled")
    assert torch.equal(loaded.model.layers[1].mlp.up_proj.weight, weights(two / "compiled")["model.layers.1.mlp.up_proj.weight"])
    import acc_trainer

    options = {**lm_probe.COMMON, **lm_probe.JOBS["compiled"]}
    with one_thread():
        acc_trainer.fit(lm_probe.base_model(), lm_probe.documents(48, 0), lm_probe.documents(16, 1),
                        **{**options, "output_dir": str(one / "compiled_resumed"),
                           "resume": str(one / "compiled" / "checkpoints" / "step-00000003")})
    reset_accelerate()
    resumed, whole = weights(one / "compiled_resumed"), weights(one / "compiled")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_saving_a_model_with_tied_weights_says_nothing(runs):
    """Accelerate's "[RANK 0] Removed shared tensor {'lm_head.weight'} while saving" at every save of the tied Llama
    (its checkpoints, the best one and the final weights): the file holds the tensor once, as safetensors needs, and
    the loaders tie it again (the from_pretrained test below)."""
    said = (runs[0] / "launch.stderr").read_text()
    assert (runs[0] / "full" / "checkpoints" / "best").is_dir() and "Removed shared tensor" not in said, said[-2000:]


def test_gradient_checkpointing_on_two_processes_changes_nothing(runs):
    """With attention dropout on: the recomputed forward draws the same masks."""
    two, _ = runs
    assert [(two / f"{job}.checkpointing").read_text() for job in ("dropout_checkpointed", "dropout")] == ["True", "False"]
    assert largest_difference(weights(two / "dropout_checkpointed"), weights(two / "dropout")) < 1e-6
    assert not torch.equal(weights(two / "dropout")["model.layers.0.self_attn.q_proj.weight"],
                           weights(two / "full")["model.layers.0.self_attn.q_proj.weight"])  # the dropout was on


def token_mean_loss(model, documents: list[dict]) -> float:
    """The next-token cross-entropy over every predicted token of the documents, each run alone."""
    total, count = 0.0, 0
    for document in documents:
        ids = document["input_ids"][None]
        total += torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return total / count


def test_a_two_process_run_loads_where_users_load_models(runs):
    from peft import PeftModel

    two, _ = runs
    ids = lm_probe.held_out_ids()
    run = json.loads((two / "full" / "summary.json").read_text())
    with torch.no_grad():
        final = transformers.AutoModelForCausalLM.from_pretrained(two / "full").eval()
        assert torch.equal(final(input_ids=ids).logits, torch.load(two / "full.logits.pt"))
        # The best checkpoint holds the weights of the best evaluation: their loss, recomputed here token by token.
        best = transformers.AutoModelForCausalLM.from_pretrained(two / "full" / "checkpoints" / "best").eval()
        assert token_mean_loss(best, lm_probe.documents(16, 1)) == pytest.approx(run["best"]["value"], abs=1e-5)
        assert token_mean_loss(final, lm_probe.documents(16, 1)) == pytest.approx(run["evals"][-1]["loss"], abs=1e-5)
        adapted = PeftModel.from_pretrained(lm_probe.base_model().eval(), two / "lora")
        assert torch.equal(adapted(input_ids=ids).logits, torch.load(two / "lora.logits.pt"))


def test_bf16_on_a_cpu_without_bf16_instructions_says_it_will_be_slow(tmp_path, monkeypatch):
    import acc_trainer
    from acc_trainer.workload import measure

    (tmp_path / "avx2").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    (tmp_path / "zen4").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16\n")
    (tmp_path / "graviton3").write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    found = {name: measure.cpu_bf16_instructions(str(tmp_path / name)) for name in ("avx2", "zen4", "graviton3")}
    assert found == {"avx2": False, "zen4": True, "graviton3": True}
    notes = {}
    for name in ("avx2", "zen4"):
        monkeypatch.setattr(measure, "cpu_bf16_instructions", lambda name=name: found[name])
        reset_accelerate()
        model = lm_probe.base_model()
        with one_thread():
            run = acc_trainer.fit(model, lm_probe.documents(8, 0), collate_fn=lm_probe.pad, batch_size=4,
                                  max_steps=1, mixed_precision="bf16", progress="none", plots=False,
                                  output_dir=str(tmp_path / f"{name}-run"))
        notes[name] = [n for n in run["notes"] if "bf16" in n]
    reset_accelerate()
    assert len(notes["avx2"]) == 1 and "no bf16 instructions" in notes["avx2"][0] and notes["zen4"] == []
    # The model object given to fit comes back without the run's autocast: its own forward, in float32, the same
    # logits as a fresh model holding its weights.
    assert "forward" not in vars(model) and "_original_forward" not in vars(model)
    assert_runs_as_built(model)


def assert_runs_as_built(model):
    """`model` gives the logits of a fresh model holding its weights, in float32, through its class's forward."""
    fresh = lm_probe.base_model()
    fresh.load_state_dict(getattr(model, "_orig_mod", model).state_dict())
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, fresh.eval()(input_ids=ids).logits)
        assert isinstance(model(input_ids=ids, return_dict=False), tuple)  # transformers' own decorator kept


def test_a_model_object_comes_back_without_the_runs_autocast_whatever_ends_the_run(tmp_path):
    """bf16: a model compiled by its user, a run stopped by an error of the caller's own (on_evaluation), and
    evaluate(): each model object runs as built afterwards (Accelerate's prepare wraps its forward in autocast)."""
    import acc_trainer

    job = dict(collate_fn=lm_probe.pad, batch_size=4, max_steps=2, mixed_precision="bf16", progress="none",
               plots=False)
    compiled = torch.compile(lm_probe.base_model(), backend="eager")
    failing = lm_probe.base_model()
    evaluated = lm_probe.base_model()

    def stop(evaluation):
        raise RuntimeError("the caller's own error")

    with one_thread():
        reset_accelerate()
        acc_trainer.fit(compiled, lm_probe.documents(8, 0), output_dir=str(tmp_path / "compiled"), **job)
        reset_accelerate()
        with pytest.raises(RuntimeError, match="the caller's own error"):
            acc_trainer.fit(failing, lm_probe.documents(8, 0), lm_probe.documents(4, 1), on_evaluation=stop,
                            output_dir=str(tmp_path / "failing"), eval_every=1, **job)
        reset_accelerate()
        acc_trainer.evaluate(evaluated, lm_probe.documents(4, 1), collate_fn=lm_probe.pad, batch_size=4,
                             mixed_precision="bf16")
    reset_accelerate()
    for model in (compiled, failing, evaluated):
        assert_runs_as_built(model)
        assert "_is_accelerate_prepared" not in vars(getattr(model, "_orig_mod", model))
    # A later run prepares the object again, in its own precision: evaluated under bf16 as a fresh model holding its
    # weights is, and not as under float32.
    fresh = lm_probe.base_model()
    fresh.load_state_dict(failing.state_dict())
    losses = {}
    with one_thread():
        for name, model, precision in (("again", failing, "bf16"), ("fresh", fresh, "bf16"), ("fp32", failing, "no")):
            reset_accelerate()
            losses[name] = acc_trainer.evaluate(model, lm_probe.documents(4, 1), collate_fn=lm_probe.pad,
                                                batch_size=4, mixed_precision=precision)["loss"]
    reset_accelerate()
    assert losses["again"] == losses["fresh"] != losses["fp32"]


def test_compiled_blocks_compile_once_for_every_layer():
    """The forward of training and evaluation asks a causal LM for no cache: its blocks, compiled in place, are
    traced once for all of them (with a cache, once per layer: 4 here; past 8 layers torch gives up and runs the
    rest eager)."""
    from torch._dynamo.testing import CompileCounter

    from acc_trainer.workload.losses import forward
    from acc_trainer.workload.models import compile_blocks

    torch._dynamo.reset()
    model = lm_probe.base_model()
    model.model.layers.extend(lm_probe.base_model(seed=1).model.layers)  # 4 layers
    model.config.num_hidden_layers = 4
    counter = CompileCounter()
    assert compile_blocks(model, backend=counter) == 4
    ids = lm_probe.held_out_ids()
    forward(model.train(), {"input_ids": ids, "labels": ids})[0].loss.backward()
    assert counter.frame_count == 1
    torch._dynamo.reset()
