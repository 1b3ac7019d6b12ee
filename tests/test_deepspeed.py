"""DeepSpeed as one CPU process (accelerate_configs/deepspeed.yaml, --num_processes 1), the one DeepSpeed setup
Accelerate allows without a GPU: ZeRO-3 (`--zero_stage 3` on the launch line, as a user gives it) ends with whole
weights that load into a plain model, counts its parameters right and resumes bit for bit; LoRA and --freeze train
under ZeRO-2 and ZeRO-3 what one plain process trains; checkpoints of both consolidate into whole weights; the setups
that cannot run are one line each.

DeepSpeed's start costs most of a launch (20 s here), so one launch runs every job of this file (this module run as
a script: `python tests/test_deepspeed.py OUT NAME=JOB[:STAGE][@CHECKPOINT] ...`), and the plain runs they are
compared with run in the test's own process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from conftest import CONFIGS, REPO, check, launch, one_thread, reset_accelerate, summary  # noqa: E402
from lm_probe import base_model, documents, held_out_ids, pad  # noqa: E402

# SHARDED_JOB of test_scale_out.py: accumulation, clipping and a schedule, checkpointed at step 10.
MLP_UNCLIPPED = ["--model", "mlp", "--train-size", "1024", "--eval-size", "256", "--batch-size", "64", "--epochs", "2",
                 "--max-steps", "24", "--optimizer", "adamw", "--lr", "0.003", "--warmup-steps", "4", "--scheduler",
                 "cosine", "--grad-accum", "2", "--checkpoint-every", "10", "--no-plots", "--progress", "plain"]
MLP = [*MLP_UNCLIPPED, "--max-grad-norm", "0.5"]
# The Llama of lm_probe.py with SGD and momentum: Adam's first steps turn a gradient's last-bit rounding into a whole
# step where the gradient is below its eps (docs/scaling.md), which would hide what is compared here.
LM = dict(collate_fn=pad, batch_size=12, max_steps=6, optimizer="sgd", lr=0.1, momentum=0.9, eval_every=3,
          checkpoint_every="3", progress="none", plots=False)
LM_JOBS = {
    "full": dict(),
    "lora": dict(lora=4, lora_merge=True),  # on the base --init-from gives (OUT/pretrained.safetensors)
    "freeze": dict(freeze=r"embed_tokens|layers\.0\."),
}
PRETRAINED = "pretrained.safetensors"


def run_jobs(out: Path, specs: list[str]) -> None:
    """Each spec NAME=JOB[:STAGE][@CHECKPOINT]: JOB (mlp, mlp_unclipped, mlp_merged or a key of LM_JOBS) into OUT/NAME,
    under ZeRO stage STAGE when launched with DeepSpeed, resuming from OUT/CHECKPOINT when given."""
    from accelerate.state import AcceleratorState, GradientState

    import acc_trainer
    from acc_trainer.config import ConfigError
    from acc_trainer.flags import parse_config
    from acc_trainer.training.api import train

    for spec in specs:
        name, job = spec.split("=", 1)
        job, _, resume = job.partition("@")
        job, _, stage = job.partition(":")
        if stage:  # read by Accelerate's DeepSpeedPlugin as each run builds its Accelerator
            os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = stage
        if job == "mlp_merged":  # refused at start under ZeRO-3: the error's line goes into OUT/NAME.error
            try:
                train(parse_config([*MLP, "--lora", "4", "--lora-targets", "fc1", "--lora-merge", "--output-dir",
                                    str(out / name)]))
            except ConfigError as e:
                (out / f"{name}.error").write_text(str(e))
        elif job in ("mlp", "mlp_unclipped"):
            args = [*(MLP if job == "mlp" else MLP_UNCLIPPED), "--output-dir", str(out / name)]
            train(parse_config([*args, *(["--resume", str(out / resume)] if resume else [])]))
        else:
            options = {**LM, **LM_JOBS[job], **({"init_from": str(out / PRETRAINED)} if job == "lora" else {})}
            acc_trainer.fit(base_model(), documents(72, 0), documents(16, 1), output_dir=str(out / name), **options,
                            **({"resume": str(out / resume)} if resume else {}))
        GradientState._reset_state()  # the next run's Accelerator starts from a fresh state, on the same process
        AcceleratorState._reset_state()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the DeepSpeed runs' folder, the plain runs' folder, the launch's stdout): one launch with --zero_stage 3."""
    from safetensors.torch import save_model

    ds, plain = tmp_path_factory.mktemp("deepspeed"), tmp_path_factory.mktemp("plain")
    for folder in (ds, plain):
        save_model(base_model(seed=1), str(folder / PRETRAINED))  # the "pretrained" base the adapters train on
    specs = ["mlp3=mlp:3", "mlp3_resumed=mlp:3@mlp3/checkpoints/step-00000010", "full3=full:3", "full2=full:2",
             "mlp2=mlp:2", "mlp2_resumed=mlp:2@mlp2/checkpoints/step-00000010",
             "lora3=lora:3", "lora3_resumed=lora:3@lora3/checkpoints/step-00000003", "freeze3=freeze:3",
             "freeze3_resumed=freeze:3@freeze3/checkpoints/step-00000003",
             "lora2=lora:2", "lora2_resumed=lora:2@lora2/checkpoints/step-00000003", "freeze2=freeze:2",
             "freeze2_resumed=freeze:2@freeze2/checkpoints/step-00000003", "unclipped2=mlp_unclipped:2",
             "merged3=mlp_merged:3"]
    launched = check(launch(ds, *specs, launcher_args=["--config_file", CONFIGS / "deepspeed.yaml", "--num_processes", "1",
                                                       "--mixed_precision", "no", "--zero_stage", "3"],
                            target=(str(REPO / "tests" / "test_deepspeed.py"),)))
    reset_accelerate()
    with one_thread():
        run_jobs(plain, ["mlp=mlp", "full=full", "lora=lora", "freeze=freeze", "unclipped=mlp_unclipped"])
    reset_accelerate()
    return ds, plain, launched.stdout


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(folder / name)


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def optimizer_elements(checkpoint: Path) -> int:
    """How many weights DeepSpeed's optimizer keeps (its fp32 partition) in a checkpoint of one process."""
    (file,) = (checkpoint / "pytorch_model").glob("zero_pp_rank_0_*optim_states.pt")
    state = torch.load(file, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    groups = state.get("fp32_flat_groups") or state["single_partition_of_fp32_groups"]  # ZeRO-3, ZeRO-1/2
    return sum(t.numel() for t in groups)


def test_zero3_saves_whole_weights_counts_them_and_resumes_bit_for_bit(runs):
    """The reported failure: ZeRO-3 trained, then crashed writing the final weights (its config did not ask DeepSpeed
    to gather them), and the start line counted 0 parameters (each is a partition of size 0 on the module)."""
    from acc_trainer.data.datasets import Data
    from acc_trainer.workload.models import mlp

    ds, plain, stdout = runs
    s = summary(ds / "mlp3")
    assert s["distributed_type"] == "DEEPSPEED" and s["parameters"] == summary(plain / "mlp")["parameters"]
    assert f"{s['parameters']['total']:,} parameters, all trained" in stdout
    final, reference = weights(ds / "mlp3"), weights(plain / "mlp")
    mlp(Data(None, None, "classification", 10, (3, 32, 32))).load_state_dict(final)  # whole and strict
    assert largest_difference(final, reference) <= 1e-5
    for a, b in zip(s["evals"], summary(plain / "mlp")["evals"], strict=True):
        assert a["accuracy"] == b["accuracy"] and abs(a["loss"] - b["loss"]) < 1e-5
    resumed = weights(ds / "mlp3_resumed")
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    assert summary(ds / "mlp3_resumed")["evals"] == s["evals"]

    # A transformers model with tied embeddings: whole, the tied tensor once (as a plain run writes it), and the
    # folder loads with from_pretrained, giving the plain run's logits.
    assert largest_difference(weights(ds / "full3"), weights(plain / "full")) <= 1e-5
    with torch.no_grad():
        logits = [transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=held_out_ids()).logits
                  for folder in (ds / "full3", plain / "full")]
    torch.testing.assert_close(*logits, atol=1e-5, rtol=0)


def test_zero2_trains_what_one_plain_process_trains_and_resumes_bit_for_bit(runs):
    """The shipped deepspeed.yaml (ZeRO-2) with accumulation, clipping, AdamW with warmup and cosine: every evaluation
    a plain run's (accuracy exactly, loss within 1e-5), the weights within 1e-5, the checkpoint DeepSpeed's own files,
    and a run resumed from it bit for bit the same."""
    ds, plain, _ = runs
    s, reference = summary(ds / "mlp2"), summary(plain / "mlp")
    for a, b in zip(s["evals"], reference["evals"], strict=True):
        assert a["accuracy"] == b["accuracy"] and abs(a["loss"] - b["loss"]) < 1e-5
    assert largest_difference(weights(ds / "mlp2"), weights(plain / "mlp")) <= 1e-5
    assert (ds / "mlp2" / "checkpoints" / "step-00000010" / "pytorch_model").is_dir()
    resumed, final = weights(ds / "mlp2_resumed"), weights(ds / "mlp2")
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    assert summary(ds / "mlp2_resumed")["evals"] == s["evals"]


def test_without_max_grad_norm_deepspeed_trains_exactly_what_one_plain_process_trains(runs):
    """Accelerate leaves gradient_clipping out of DeepSpeed's config for no --max-grad-norm, and DeepSpeed 0.19 then
    clips at 1.0 (its default): a run without clipping was clipped, 2e-2 away from the plain run at its end. Told 0,
    DeepSpeed computes what the plain process computes, to the last bit (docs/scaling.md: what remains with clipping)."""
    ds, plain, _ = runs
    unclipped, reference = weights(ds / "unclipped2"), weights(plain / "unclipped")
    assert all(torch.equal(unclipped[k], reference[k]) for k in reference)


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_and_freeze_train_what_one_plain_process_trains(runs, stage):
    """The adapter alone trains (its optimizer state is all the checkpoint's optimizer holds), is saved in peft's
    format, merged with --lora-merge, within 1e-5 of a plain run's, and resumes bit for bit; --freeze likewise."""
    from peft import PeftModel
    from safetensors.torch import load_file

    ds, plain, _ = runs
    lora = ds / f"lora{stage}"
    counts = summary(lora)["parameters"]
    assert counts == summary(plain / "lora")["parameters"] and 0 < counts["trainable"] < counts["total"] / 4
    assert optimizer_elements(lora / "checkpoints" / "step-00000003") == counts["trainable"]
    for run in (lora, ds / f"freeze{stage}"):  # the frozen base is not in the checkpoint (DeepSpeed's own files)
        (file,) = (run / "checkpoints" / "step-00000003" / "pytorch_model").glob("*model_states.pt")
        held = torch.load(file, map_location="cpu", weights_only=False)
        assert held["frozen_param_fragments"] is None
        assert not any(".layers.0." in name and "lora_" not in name for name in held["module"])
    assert largest_difference(weights(lora), weights(plain / "lora")) <= 1e-5
    resumed = weights(ds / f"lora{stage}_resumed")
    assert all(torch.equal(resumed[k], weights(lora)[k]) for k in resumed)

    pretrained = load_file(ds / "pretrained.safetensors")
    with torch.no_grad():
        expected = PeftModel.from_pretrained(_loaded(pretrained), plain / "lora")(input_ids=held_out_ids()).logits
        for folder in (lora, lora / "checkpoints" / "step-00000006"):
            adapted = PeftModel.from_pretrained(_loaded(pretrained), folder)(input_ids=held_out_ids()).logits
            torch.testing.assert_close(adapted, expected, atol=1e-5, rtol=0)
        merged = transformers.AutoModelForCausalLM.from_pretrained(lora / "merged").eval()
        torch.testing.assert_close(merged(input_ids=held_out_ids()).logits, expected, atol=1e-5, rtol=0)

    frozen = ds / f"freeze{stage}"
    assert summary(frozen)["parameters"] == summary(plain / "freeze")["parameters"]
    assert largest_difference(weights(frozen), weights(plain / "freeze")) <= 1e-5
    assert optimizer_elements(frozen / "checkpoints" / "step-00000003") == summary(frozen)["parameters"]["trainable"]
    resumed = weights(ds / f"freeze{stage}_resumed")
    assert all(torch.equal(resumed[k], weights(frozen)[k]) for k in resumed)


def _loaded(state: dict):
    model = base_model().eval()
    model.load_state_dict(state, strict=False)  # the tied output layer is the embedding, held once in the file
    return model


def test_deepspeed_setups_that_cannot_run_are_one_line(tmp_path, main_in_process, monkeypatch):
    """Before anything is written: a CPU optimizer offload Accelerate would turn into Adam whatever --optimizer
    says, and a DeepSpeed config file whose optimizer, scheduler, accumulation or clipping fights the trainer's."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    job, out = ["--model", "mlp", "--train-size", "64", "--max-steps", "1", "--optimizer", "sgd"], tmp_path / "run"
    file = tmp_path / "ds_config.json"

    def error(*extra, env=None, config=None):
        with monkeypatch.context() as m:
            for variable, value in (env or {}).items():
                m.setenv(variable, value)
            if config is not None:
                file.write_text(json.dumps(config) if isinstance(config, dict) else config)
                m.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(file))
            code, stdout, stderr = main_in_process(*job, *extra, "--output-dir", out)
        assert (code, stdout) == (2, "") and stderr.count("\n") == 1, stderr
        return stderr.removeprefix("acc-trainer: error: ").rstrip("\n")

    assert error(env={"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}) == (
        "offload_optimizer_device cpu: Accelerate replaces the optimizer with DeepSpeed's CPU Adam, so --optimizer sgd "
        "would train as Adam: use --optimizer adam or adamw, or offload_optimizer_device: none")
    offloaded = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert error(config=offloaded).startswith("offload_optimizer_device cpu: Accelerate replaces the optimizer")
    assert error(config={"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}) == (
        f"the DeepSpeed config file {file} has a section 'optimizer'; acc_trainer builds the optimizer from --optimizer "
        "and hands it to DeepSpeed: remove the section")
    assert error(config={"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}) == (
        f"the DeepSpeed config file {file} sets gradient_accumulation_steps 4; acc_trainer passes --grad-accum (1) to "
        'DeepSpeed: remove it from the file, or set it to "auto"')
    assert error(config={"gradient_clipping": 1.0}).startswith(f"the DeepSpeed config file {file} sets gradient_clipping")
    assert error(config="{not json").startswith(f"the DeepSpeed config file {file} cannot be read: ")
    assert not out.exists()


def test_lora_merge_of_a_model_without_a_transformers_config_is_refused_under_zero3(runs):
    """The merged copy of a ZeRO-3 model is built again from a transformers model's config; for any other model the
    run used to end in a traceback after training, now it does not start."""
    ds, _, _ = runs
    assert (ds / "merged3.error").read_text() == (
        "--lora-merge under DeepSpeed ZeRO-3 needs a transformers model (the merged copy is built again from its "
        "config, as sharded weights cannot be copied); MLP is not one: merge the finished run's adapter into your model "
        "with peft's merge_and_unload")
    assert not (ds / "merged3").exists()


if __name__ == "__main__":
    run_jobs(Path(sys.argv[1]), sys.argv[2:])


def test_a_deepspeed_checkpoint_consolidates_into_a_folder_from_pretrained_loads(runs, tmp_path, main_in_process):
    """DeepSpeed's checkpoint holds its ZeRO partitions (and the config apart, in model-config/, promising nothing);
    `acc-trainer consolidate` writes them as whole weights, bit for bit the final weights of the run; another engine
    or number of processes is refused in one line naming that command."""
    from acc_trainer.config import ConfigError
    from acc_trainer.flags import parse_config
    from acc_trainer.outputs.checkpoints import read_state

    ds, _, _ = runs
    checkpoint = ds / "full3" / "checkpoints" / "step-00000006"
    assert not (checkpoint / "config.json").exists() and (checkpoint / "model-config" / "config.json").is_file()
    code, stdout, stderr = main_in_process("consolidate", str(checkpoint), str(tmp_path / "out"))
    assert code == 0 and "of the DEEPSPEED checkpoint at step 6" in stdout, stderr
    state = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    final = weights(ds / "full3")
    assert all(torch.equal(state[k], final[k]) for k in final)
    mlp3 = ds / "mlp3" / "checkpoints" / "step-00000010"
    cfg = parse_config([*MLP, "--output-dir", str(tmp_path / "elsewhere")])
    with pytest.raises(ConfigError, match=r"under DEEPSPEED, and this run is 2 under DDP: .* `acc-trainer consolidate "):
        read_state(mlp3, cfg, 2, "DDP")


def test_a_zero2_checkpoint_consolidates_into_the_runs_final_weights(runs, tmp_path, main_in_process):
    """ZeRO-2 keeps the weights whole on the module and the optimizer's fp32 copy in partitions, ZeRO-3 both in
    partitions: a ZeRO-2 checkpoint consolidates too, bit for bit the run's final weights, the tied embedding and head
    counted once (DeepSpeed's reader gives the tied tensor under both names) as the run counted them."""
    ds, plain, _ = runs
    total = summary(ds / "full2")["parameters"]["total"]
    assert total == summary(plain / "full")["parameters"]["total"]
    assert largest_difference(weights(ds / "full2"), weights(plain / "full")) <= 1e-5
    code, stdout, stderr = main_in_process("consolidate", str(ds / "full2" / "checkpoints" / "step-00000006"),
                                           str(tmp_path / "out"))
    said = stdout.splitlines()[-1]  # after DeepSpeed's own lines
    assert code == 0 and said.startswith(f"consolidated {total:,} parameters "), stdout + stderr
    assert "of the DEEPSPEED checkpoint at step 6" in said
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    state, final = model.state_dict(), weights(ds / "full2")
    assert all(torch.equal(state[k], final[k]) for k in final)
    assert model.lm_head.weight is model.model.embed_tokens.weight
