"""Fine-tuning that outgrows one device, on CPU processes with gloo (the same code on GPUs): LoRA and frozen layers
under FSDP2, checkpoints that move between engines and numbers of processes, and `acc-trainer consolidate`.

A small Llama with tied embeddings (tests/engine_probe.py) trains in full, with LoRA (merged too, with samples
from a prompt) and with its first layer and the embedding frozen: on 1 plain process, on 2 FSDP2 processes
(the same jobs, each resumed from its own checkpoint, each continuing the 1-process run's checkpoint), then on 3
FSDP2 processes and on 1 plain process from the 2-process checkpoints; tests/dpo_probe.py's DPO runs (a frozen copy,
the adapters off) in the same FSDP2 processes. Every run must end where the uninterrupted 1-process run ends. The
processes are forked from the test's (conftest.forked), with the variables `accelerate launch --config_file
accelerate_configs/fsdp.yaml` gives them under FSDP2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

import engine_probe  # noqa: E402 - after the skips
from conftest import CONFIGS, forked, one_thread, reset_accelerate  # noqa: E402
from lm_probe import base_model, documents, pad  # noqa: E402
from safetensors.torch import load_file, save_file, save_model  # noqa: E402

JOBS = ("full", "lora", "freeze")
# In the 1-process and the 2-process FSDP2 runs only: tests/dpo_probe.py's DPO jobs (a frozen copy, the adapters off)
# and layers frozen until the second epoch; on 2 processes also DPO with LoRA on the model not cut by layers.
MORE = ["dpo_full=dpo:full", "dpo_lora=dpo:lora", "unfreeze=unfreeze"]
STEP3 = "checkpoints/step-00000003"
FSDP = ("--config_file", str(CONFIGS / "fsdp.yaml"))
DDP = ("--multi_gpu",)
LACKING = "model.layers.1.mlp.down_proj.weight"  # the weight left out of a checkpoint that is to be refused


def run_probe(out, specs, processes: int = 0, engine=FSDP):
    """engine_probe's runs: in this process (0), or on PROCESSES processes of ENGINE (launcher flags; DDP's forked
    from this process)."""
    if not processes:
        reset_accelerate()
        with one_thread():
            engine_probe.run(out, specs)
        reset_accelerate()
        return
    forked(engine_probe.run, out, specs, processes=processes, config=None if engine == DDP else engine[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"one", "fsdp", "three", "back", "ddp", "lacking"}: the folders of the 1-process runs, the 2-process FSDP2 runs
    (NAME, NAME_resumed from its step-3 checkpoint, NAME_from1 from the 1-process run's), the 3-process FSDP2 runs and
    the 1-process runs continuing the 2-process FSDP2 checkpoints, and 2 DDP processes (NAME_resumed from their own
    checkpoint, NAME continuing the 2-process FSDP2 one); "lacking": a copy of the 1-process full run's step-3
    checkpoint without LACKING, which fsdp/full_lacking is to refuse."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("one", "fsdp", "three", "back", "ddp")}
    one, fsdp = folders["one"], folders["fsdp"]
    run_probe(one, [f"{job}={job}" for job in JOBS] + MORE)
    lacking = folders["lacking"] = tmp_path_factory.mktemp("lacking") / "step-00000003"
    shutil.copytree(one / "full" / STEP3, lacking)
    weights_left = load_file(lacking / "model.safetensors")
    del weights_left[LACKING]
    save_file(weights_left, lacking / "model.safetensors", metadata={"format": "pt"})
    (lacking / "SHA256SUMS").unlink()  # its digests no longer match: continued with --accept-unverified
    wraps = [f"wrap_{wrap}=wrap:{wrap}" for wrap in engine_probe.WRAPS]  # first: the jobs after them hold what they leave
    run_probe(fsdp, wraps + [f"{job}={job}" for job in JOBS] + [f"{job}_resumed={job}@{fsdp / job / STEP3}" for job in JOBS]
              + [f"{job}_from1={job}@{one / job / STEP3}" for job in JOBS] + MORE + ["dpo_whole=dpo:lora_whole"]
              + [f"full_lacking=refused:full@{lacking}"], processes=2)
    run_probe(folders["three"], [f"{job}={job}@{fsdp / job / STEP3}" for job in JOBS], processes=3)
    run_probe(folders["back"], [f"{job}={job}@{fsdp / job / STEP3}" for job in JOBS])
    ddp = folders["ddp"]
    run_probe(ddp, ["lora_own=lora", f"lora_resumed=lora@{ddp / 'lora_own' / STEP3}"]
              + [f"{job}={job}@{fsdp / job / STEP3}" for job in JOBS], processes=2, engine=DDP)
    return folders


def summary(folder) -> dict:
    return json.loads((folder / "summary.json").read_text())


def weights(folder) -> dict:
    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(folder / name)


def distance(a: dict, b: dict) -> float:
    """The largest difference between two sets of weights (the same tensors: a tied one once, in every run folder)."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sharded_keys(checkpoint, part: str) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(checkpoint / part)).read_metadata().state_dict_metadata)


def test_lora_and_frozen_layers_under_fsdp_train_what_one_process_trains(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    one, fsdp = runs["one"], runs["fsdp"]
    for job in JOBS:
        s = json.loads((fsdp / job / "summary.json").read_text())
        assert s["distributed_type"] == "FSDP" and s["world_size"] == 2
        assert distance(weights(fsdp / job), weights(one / job)) <= 1e-5, job
        assert s["parameters"] == json.loads((one / job / "summary.json").read_text())["parameters"]
        # Resumed from its own sharded checkpoint, the run ends bit for bit where it ended.
        assert identical(weights(fsdp / f"{job}_resumed"), weights(fsdp / job)), job

    # The frozen layers never moved: every tensor of them is the factory's, on every process's shard.
    start, frozen = base_model().state_dict(), weights(fsdp / "freeze")
    names = [k for k in start if k.startswith(("model.embed_tokens", "model.layers.0."))]
    assert names and all(torch.equal(frozen[k], start[k]) for k in names)
    assert any(not torch.equal(frozen[k], start[k]) for k in start if k.startswith("model.layers.1."))

    # The adapter in peft's format loads where users load it; --lora-merge's folder with from_pretrained.
    adapted = PeftModel.from_pretrained(base_model().eval(), fsdp / "lora")
    reference = PeftModel.from_pretrained(base_model().eval(), one / "lora")
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        assert torch.allclose(adapted(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(fsdp / "lora" / "merged")
    reference = weights(one / "lora" / "merged")  # save_pretrained writes a tied tensor once
    assert distance({k: merged.state_dict()[k] for k in reference}, reference) <= 1e-5
    # Samples from the prompt, generated with sharded weights (every process runs each forward pass together).
    samples = (fsdp / "lora" / "samples.jsonl").read_text()
    assert samples == (one / "lora" / "samples.jsonl").read_text() and samples.count("\n") == 2


def test_dpo_under_fsdp_trains_what_one_process_trains(runs):
    """DPO on 2 FSDP2 processes, the reference a frozen copy of the whole model or the model with its LoRA adapters
    off, the model cut by its layers (fsdp.yaml: a decoder layer a unit) or not: the final weights within 1e-5 of one
    process's, every evaluation the same. Not cut by layers, the LoRA run ends with an evaluation's forward passes
    without gradients, after which FSDP2 leaves every parameter gathered (plain tensors, not DTensors): its adapter
    is still gathered from every process and saved in peft's format (it failed there before)."""
    one, fsdp = runs["one"], runs["fsdp"]
    for job, alone in (("dpo_full", "dpo_full"), ("dpo_lora", "dpo_lora"), ("dpo_whole", "dpo_lora")):
        s, reference = summary(fsdp / job), summary(one / alone)
        assert s["distributed_type"] == "FSDP" and s["world_size"] == 2
        assert distance(weights(fsdp / job), weights(one / alone)) <= 1e-5, job
        assert s["evals"] == [pytest.approx(e, abs=1e-5) for e in reference["evals"]], job
        assert s["eval"]["reward_margin"] != pytest.approx(0, abs=1e-3)  # the policy moved off its reference
    for job in ("dpo_lora", "dpo_whole"):
        assert (fsdp / job / "adapter_model.safetensors").is_file()  # peft's format


def test_layers_frozen_until_an_epoch_stay_so_under_fsdp(runs):
    """--freeze with --unfreeze-at 2 on 2 FSDP2 processes: the first epoch leaves the frozen layers as they were and
    the second trains them, as on one process (FSDP2 replaces every parameter when it shards the model: the gradients
    dropped until then must be the sharded parameters')."""
    one, fsdp = runs["one"], runs["fsdp"]
    assert distance(weights(fsdp / "unfreeze"), weights(one / "unfreeze")) <= 1e-5
    # The evaluation at step 3, the first epoch's end, and the one at the end are one process's.
    assert summary(fsdp / "unfreeze")["evals"] == [pytest.approx(e, abs=1e-5) for e in summary(one / "unfreeze")["evals"]]
    # On one process the layers are the factory's at the first epoch's end (its step-3 checkpoint holds them: they
    # train later) and trained in the second.
    start, trained = base_model().state_dict(), weights(one / "unfreeze")
    at_3 = load_file(one / "unfreeze" / STEP3 / "model.safetensors")
    names = [k for k in start if k.startswith(("model.embed_tokens", "model.layers.0."))]
    assert names and all(torch.equal(at_3[k], start[k]) for k in names)
    assert max((trained[k] - start[k]).abs().max().item() for k in names if k in trained) > 1e-3


def test_fsdp_checkpoints_of_partly_frozen_models_hold_what_trains(runs):
    """The adapter (or the layers that train) and their optimizer state, not the frozen base again; the adapter in
    peft's format too; no config.json at the top (from_pretrained cannot read sharded weights)."""
    fsdp = runs["fsdp"]
    full, lora, freeze = (fsdp / job / STEP3 for job in JOBS)
    assert all("lora_" in key for key in sharded_keys(lora, "pytorch_model_fsdp_0"))
    assert all("lora_" in key for key in sharded_keys(lora, "optimizer_0") if key.startswith("optimizer.state."))
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        keys = sharded_keys(freeze, part)
        assert keys and not any(("embed_tokens" in k or "layers.0." in k) for k in keys), part
    assert any("embed_tokens" in key for key in sharded_keys(full, "pytorch_model_fsdp_0"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in lora.iterdir()}
    for checkpoint in (lora, freeze, full):
        assert not (checkpoint / "config.json").exists()
    assert (full / "model-config" / "config.json").is_file()  # for consolidate


def test_checkpoints_move_between_engines_and_numbers_of_processes(runs):
    """1 process -> FSDP2 on 2, FSDP2 on 2 -> 3, FSDP2 on 2 -> 1 plain process, FSDP2 -> DDP: each continued run ends
    within 1e-5 of the uninterrupted 1-process run (the same global batches)."""
    one = runs["one"]
    # A LoRA run of 2 DDP processes resumes from its own checkpoint (the adapter's names are checked unwrapped).
    assert identical(weights(runs["ddp"] / "lora_resumed"), weights(runs["ddp"] / "lora_own"))
    for job in JOBS:
        for moved in (runs["fsdp"] / f"{job}_from1", runs["three"] / job, runs["back"] / job, runs["ddp"] / job):
            evals = json.loads((moved / "summary.json").read_text())["evals"]
            assert [e["step"] for e in evals] == [3, 6]  # it resumed at step 3 (evaluated again there) and went on
            assert evals[-1]["loss"] == pytest.approx(json.loads((one / job / "summary.json").read_text())["evals"][-1]["loss"],
                                                      abs=1e-5)
            assert distance(weights(moved), weights(one / job)) <= 1e-5, moved
        three = json.loads((runs["three"] / job / "summary.json").read_text())
        assert (three["world_size"], three["distributed_type"]) == (3, "FSDP")
        assert json.loads((runs["back"] / job / "summary.json").read_text())["distributed_type"] == "NO"


def test_a_checkpoint_lacking_a_weight_is_refused_under_another_engine(runs):
    """A 1-process checkpoint without one of the model's weights (its digests removed, continued with
    --accept-unverified), continued on 2 FSDP2 processes: refused in one line naming the weight. torch 2.14's
    set_model_state_dict reports nothing missing there, and the run trained on with the weight's initial values."""
    refused = (runs["fsdp"] / "full_lacking" / "refused.txt").read_text()
    assert f"checkpoint {runs['lacking']} lacks 1 of the model's weights: {LACKING}" in refused
    assert "\n" not in refused and not (runs["fsdp"] / "full_lacking" / "model.safetensors").exists()


def test_a_compiled_model_continues_whole_weights_named_either_way(tmp_path):
    """Under FSDP2 with --compile the model moving.py loads into is torch.compile's wrapper (its names
    `_orig_mod.model...`), and a compiled DDP run's model.safetensors names the weights so too: whichever of the two
    is compiled, the weights and the optimizer's momentum arrive (a compiled checkpoint's weights were left out
    without a word), and a weight the checkpoint lacks is named as the model is built."""
    from acc_trainer.config import ConfigError
    from acc_trainer.outputs.moving import _load_model, _load_optimizer

    trained = base_model(seed=1)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1, momentum=0.9)
    trained(**pad(documents(4, 0))).loss.backward()
    optimizer.step()
    for naming, saved in (("plain", trained), ("compiled", torch.compile(trained))):
        checkpoint = tmp_path / naming
        checkpoint.mkdir()
        save_model(saved, str(checkpoint / "model.safetensors"))  # the tied weight once, as Accelerate writes it
        torch.save(optimizer.state_dict(), checkpoint / "optimizer.bin")  # numbered in the parameters' order, as DDP's
        for model in (torch.compile(base_model()), base_model()):
            moved = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            _load_model(model, checkpoint, partial=False)
            _load_optimizer(model, moved, checkpoint)
            for mine, theirs in zip(model.parameters(), trained.parameters(), strict=True):
                assert torch.equal(mine, theirs), (naming, type(model))
                assert torch.equal(moved.state[mine]["momentum_buffer"], optimizer.state[theirs]["momentum_buffer"])

        left = {name: tensor for name, tensor in load_file(checkpoint / "model.safetensors").items()
                if not name.endswith(LACKING)}
        save_file(left, checkpoint / "model.safetensors")
        for model in (torch.compile(base_model()), base_model()):
            with pytest.raises(ConfigError) as refused:
                _load_model(model, checkpoint, partial=False)
            assert str(refused.value) == f"checkpoint {checkpoint} lacks 1 of the model's weights: {LACKING}"


def test_a_compiled_model_continues_a_sharded_checkpoint_of_what_trains(runs):
    """The 2-process FSDP2 checkpoint of --freeze's run (the frozen embedding, tied to the head, and first layer not in
    it) continued by a compiled model on one process: what trains is the checkpoint's, the frozen weights the model's
    own (the frozen names were compared with their `_orig_mod.`, and torch asked the checkpoint for the head)."""
    from acc_trainer.outputs.moving import _load_model, whole_weights

    checkpoint = runs["fsdp"] / "freeze" / STEP3
    model, built = torch.compile(base_model()), base_model().state_dict()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(not ("embed_tokens" in name or "layers.0." in name))
    _load_model(model, checkpoint, partial=True)
    state, saved = model._orig_mod.state_dict(), whole_weights(checkpoint)  # the names as built
    assert saved and all(torch.equal(state[k], saved[k]) for k in saved)
    assert all(torch.equal(state[k], built[k]) for k in state if k not in saved)


def test_consolidate_writes_any_checkpoint_as_a_folder_from_pretrained_loads(runs, tmp_path, main_in_process):
    from transformers import AutoModelForCausalLM

    import acc_trainer

    fsdp, one = runs["fsdp"], runs["one"]
    for engine, final in (("fsdp", fsdp / "full"), ("one", one / "full")):
        checkpoint, out = final / "checkpoints" / "step-00000006", tmp_path / engine
        code, stdout, stderr = main_in_process("consolidate", str(checkpoint), str(out))
        assert code == 0 and stderr == ""
        # The tied embedding and head counted once, as the run counted them (FSDP's shards hold the tensor twice).
        assert stdout.startswith(f"consolidated {summary(final)['parameters']['total']:,} parameters ")
        assert stdout.split(": ")[-1].split() == ["config.json,", "generation_config.json,", "model.safetensors"]
        model = AutoModelForCausalLM.from_pretrained(out)
        state, trained = model.state_dict(), weights(final)
        assert all(torch.equal(state[k], trained[k]) for k in trained)  # bit for bit the weights in training
        assert model.lm_head.weight is model.model.embed_tokens.weight
        # The run folder and the consolidated folder (whose distributed checkpoint named the tied tensor twice) load in
        # acc_trainer.evaluate too, with the run's own figures.
        reset_accelerate()
        final_loss = json.loads((final / "summary.json").read_text())["evals"][-1]["loss"]
        for folder, weights_file in ((final, None), (final, out / "model.safetensors")):
            results = acc_trainer.evaluate(folder, model=base_model(), data=documents(16, 1), collate_fn=pad,
                                           weights=weights_file, progress="none")
            assert results["loss"] == pytest.approx(final_loss, abs=1e-6)
            reset_accelerate()
        assert identical(AutoModelForCausalLM.from_pretrained(final).state_dict(), state)
    # One line each: a checkpoint holding only what trains, a folder that is no checkpoint, a folder not empty.
    lora = fsdp / "lora" / STEP3
    assert main_in_process("consolidate", str(lora), str(tmp_path / "x"))[2].startswith(
        f"acc-trainer: error: checkpoint {lora} holds only the parameters that train")
    assert main_in_process("consolidate", str(tmp_path), str(tmp_path / "x"))[2] == (
        f"acc-trainer: error: {tmp_path} is not an acc_trainer checkpoint (no trainer_state.json); checkpoints are the "
        "folders in RUN_DIR/checkpoints/\n")
    assert main_in_process("consolidate", str(fsdp / "full" / STEP3), str(tmp_path / "fsdp"))[2] == (
        f"acc-trainer: error: {tmp_path / 'fsdp'} exists and is not an empty folder: nothing is written over it\n")
    assert not (tmp_path / "x").exists()


def test_auto_wrap_policies_accelerate_cannot_shard_with_are_one_line(runs):
    """A user's accelerate config whose auto-wrap policy Accelerate 1.15's FSDP2 would fail on with torch's traceback:
    one line naming the unit, before anything is written; the launch goes on to the next jobs (whose FSDP2 weights
    the tests above compare: the refused jobs leave no setting behind). A policy that cuts no block out trains."""
    fsdp, one = runs["fsdp"], runs["one"]
    use = ("use fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, as accelerate_configs/fsdp.yaml does, with the model's "
           "repeated block in fsdp_transformer_layer_cls_to_wrap unless it is a transformers model")
    said = {wrap: (fsdp / f"wrap_{wrap}" / "refused.txt").read_text() for wrap in engine_probe.WRAPS if wrap != "whole"}
    assert said == {
        "list": "the accelerate config's fsdp_auto_wrap_policy SIZE_BASED_WRAP (fsdp_min_num_params 1,000) makes "
                "model.layers (a ModuleList of 18,560 parameters) an FSDP2 unit, and torch's fully_shard takes only "
                f"modules with a forward: {use}",
        "embedding": "the accelerate config's fsdp_auto_wrap_policy SIZE_BASED_WRAP (fsdp_min_num_params 19,000) makes "
                     "model (LlamaModel) an FSDP2 unit, and it holds model.embed_tokens, which Accelerate makes a unit "
                     f"of its own (the embedding, the final norm and the head are): {use}",
        "tied": "the accelerate config's fsdp_transformer_layer_cls_to_wrap (Embedding) makes model.embed_tokens "
                "(Embedding) an FSDP2 unit, and its weight is tied to the embedding or the head: Accelerate keeps the "
                "two in one unit of its own, and torch refuses a weight in two units: name the model's repeated block "
                "there (LlamaDecoderLayer), or leave it out",
        "class": "the accelerate config's fsdp_transformer_layer_cls_to_wrap names GPT2Block, and the model has no "
                 "module of that class (its repeated block: LlamaDecoderLayer)"}
    assert all([p.name for p in (fsdp / f"wrap_{wrap}").iterdir()] == ["refused.txt"] for wrap in said)
    assert distance(weights(fsdp / "wrap_whole"), weights(one / "full")) <= 1e-5
    # The start line says how the model was cut: by its decoder layers under fsdp.yaml (and Accelerate's unit for the
    # tied embedding and head with the final norm), under "whole" by Accelerate alone.
    assert ("FSDP2 cuts the model into 3 units besides its root (2 LlamaDecoderLayer; the final norm, the embedding and "
            "the head in one), each gathered in its turn") in summary(fsdp / "full")["notes"]
    assert ("FSDP2 cuts none of the model's blocks out (the accelerate config's auto-wrap policy picks none; "
            "Accelerate's 1 unit besides the root: the final norm, the embedding and the head in one), so each forward "
            "pass gathers all of their weights at once: use fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP with its "
            "repeated block in fsdp_transformer_layer_cls_to_wrap (a transformers model's _no_split_modules names it)"
            ) in summary(fsdp / "wrap_whole")["notes"]
    assert not any(note.startswith("FSDP2 cuts") for note in summary(one / "full")["notes"])


def test_fsdp_setups_that_cannot_run_here_are_one_line(main_in_process, monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    assert main_in_process("--model", "mlp", "--output-dir", str(tmp_path / "run")) == (
        2, "", "acc-trainer: error: fsdp_offload_params: true moves the weights between a GPU and the CPU's memory, and "
               "these processes run on the CPU (their weights are in its memory already): set it to false in the "
               "accelerate config\n")
    assert not (tmp_path / "run").exists()


def test_a_sigterm_that_comes_again_is_the_same_request_to_stop():
    """A scheduler signals every process and the launcher passes its own SIGTERM on: the second must not kill the
    process before its checkpoint. A Ctrl-C after a signal still interrupts at once."""
    import signal

    accelerator = type("One", (), {"num_processes": 1})()
    # Python's own Ctrl-C handler before: an earlier test in this process may have left another (torch's launcher's).
    before = {sig: signal.signal(sig, handler) for sig, handler in
              ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))}
    try:
        _signal_twice(accelerator)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _signal_twice(accelerator):
    import os
    import signal

    from acc_trainer.stopping import StopSignals

    with StopSignals(accelerator) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # with the default handler back, this would end the test's process
        assert signals.agreed(True) == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
