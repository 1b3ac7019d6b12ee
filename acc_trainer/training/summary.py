"""The end of a run: the processes' weights compared, the final weights saved (`save_model`), summary.json
written, the plots drawn and the summary table printed."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from ..config import TrainConfig
from ..distributed import engines, processes
from ..language.adapters import gathered_state, is_peft, save_merged
from ..language.pretrained import class_name, config_files, model_card_file, tokenizer_files
from ..outputs import trackers
from ..outputs.checkpoints import WRITE_ERRORS, write_failure, write_sums
from ..outputs.progress import summary_table
from ..outputs.runfiles import command_line
from ..stopping import TrainingStopped
from ..workload.measure import device_peak_flops, library_versions, peak_memory_mb, run_precision
from ..workload.metrics import best_evaluation, ranked_by
from .evaluation import format_results
from .setup import Run


def finish(r: Run) -> dict:
    """Checks every process ends with the same weights, saves them (`save_model`) and the summary, draws
    the plots."""
    accelerator, trained, output = r.accelerator, r.trained, r.output
    agreement = processes.ranks_agree(accelerator, trained.model)
    if agreement["agree"] is False and accelerator.is_main_process:
        print(f"acc-trainer: warning: {agreement['detail']} at the end of training (the weights saved are "
              "process 0's); this is a bug: please report it", file=sys.stderr)
    accelerator.wait_for_everyone()
    # Accelerate saves a compiled model under its wrapper's names (`_orig_mod.fc1.weight`); saved from
    # the module itself, the weights load into the model as the user built it. FSDP and DeepSpeed need
    # their wrapper to gather the full weights.
    to_save = r.engine.module_to_save(accelerator, trained.model)
    to_save = trained.ema.module if trained.ema else to_save
    card = model_card(r, accelerator.unwrap_model(to_save, keep_torch_compile=False)) \
        if accelerator.is_main_process else None
    try:
        save_weights(accelerator, to_save, output.folder, r.cfg.lora_merge, r.job.tokenizer, card, r.engine)
    except WRITE_ERRORS as e:
        if not accelerator.is_main_process:
            raise
        shutil.rmtree(output.folder / ".tmp-weights", ignore_errors=True)  # the part written
        last = output.checkpoints.last
        kept = f"the last complete checkpoint is {last}" if last else "no checkpoint was saved"
        raise TrainingStopped(f"writing the final weights {output.folder / 'model.safetensors'} failed: "
                              f"{write_failure(e, output.folder)}; {kept}", code=1, alone=True) from None
    summary = run_summary(r, agreement)
    output.files.write_summary(summary)
    plots = []
    if accelerator.is_main_process and r.cfg.plots:
        from ..outputs.plots import plot_run  # matplotlib: 0.4 s to import, needed only here

        with output.files.writing(output.folder / "plots"):
            plots = plot_run(output.folder)
    final = r.state.evals[-1] if r.state.evals else None
    output.progress.result(f"[bold]final[/] {format_results(final) if final else 'no evaluation set'}; "
                           f"{summary['samples_per_s'] or 0:,.0f} samples/s; run files in {output.folder}")
    output.progress.print(summary_table(summary, plots))
    trackers.end(accelerator, output.folder, summary)  # the final summary, the run's files, each tracker finished
    # Not `end_training`, which also destroys the process group: a script of the user's goes on with it (a
    # second fit(), evaluate() on the same processes). The command line destroys it as it leaves (cli.main).
    return summary


def save_weights(accelerator: Accelerator, model, folder: Path, merge: bool = False, tokenizer=None,
                 card: str | None = None, engine: engines.Engine | None = None) -> None:
    """The final weights (`save_model`: model.safetensors, or its shards and their index), written as
    checkpoints are: into a temporary folder, moved into place once whole, then listed with their digests in
    `folder/SHA256SUMS` (`evaluate`/`predict` verify them). A run stopped while writing leaves no half file. `card`:
    README.md, written where the folder is a model folder (a transformers model's config.json, or peft's adapter)."""
    tmp = folder / ".tmp-weights"  # only the main process writes files (the others may help gather the weights)
    written = []  # the model folder's own files: config.json, or the adapter's
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing
    accelerator.wait_for_everyone()  # before any process makes the folder again (save_model does, on each)
    error = None
    try:
        module = accelerator.unwrap_model(model, keep_torch_compile=False)
        if is_peft(module):  # the adapter alone, in peft's format (and the merged model, --lora-merge)
            gathered = gathered_state(module, whole=merge)  # a sharded model's weights, gathered by every process
            if accelerator.is_main_process:
                written = config_files(module, tmp, adapter=gathered)
                if merge:  # a model folder of its own: its tokenizer too
                    save_merged(module, tmp / "merged", gathered)
                    tokenizer_files(tokenizer, tmp / "merged")
        else:
            (engine or engines.DDP()).save_weights(accelerator, model, module, tmp)  # tied weights saved once, tied again on load
            if accelerator.is_main_process:  # a transformers model's config.json: the folder loads with from_pretrained
                written = config_files(module, tmp)
        if accelerator.is_main_process:  # the run's tokenizer: AutoTokenizer.from_pretrained(folder) too
            tokenizer_files(tokenizer, tmp)
            if card and written:
                model_card_file(module, tmp, card)
    except WRITE_ERRORS as e:
        error = e
    if accelerator.num_processes > 1:  # reached by every process, whether its part failed or not: no one waits alone
        accelerator.gather(torch.tensor([error is not None], device=accelerator.device))
    if error is not None:
        raise error
    if accelerator.is_main_process:
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        for entry in tmp.iterdir():
            if entry.is_dir():
                shutil.rmtree(folder / entry.name, ignore_errors=True)
            os.replace(entry, folder / entry.name)
        tmp.rmdir()
        options = ["config.yaml"] if (folder / "config.yaml").is_file() else []  # read back by evaluate and rerun
        write_sums(folder, files + options)


def model_card(r: Run, module) -> str:
    """README.md of a language model's run folder: what it was trained from, on what, to do what, by which command,
    and how far it got (save_weights writes it where the folder is a model folder)."""
    cfg, state, data = r.cfg, r.state, r.job.data
    base = module.get_base_model() if is_peft(module) else module
    what, objective = r.job.objective.card(cfg, r.scoring.checked.loss_name)
    lines = [f"# {r.output.folder.name}", "", f"{class_name(base)} trained with acc_trainer ({what}).", "", "## Base model",
             "", f"- the model: {class_name(base)}, "
                 + ("given to fit()" if r.job.objects else f"built by `{r.job.model_name}`")]
    if getattr(getattr(base, "config", None), "name_or_path", ""):
        lines.append(f"- built from `{base.config.name_or_path}`")
    init = r.trained.tuning.init  # None for a resumed run: its checkpoint held the weights
    loaded = f" ({init['loaded']} tensors loaded)" if init else ""
    lines.append(f"- starting weights: `--init-from {cfg.init_from}`{loaded}" if cfg.init_from else
                 "- starting weights: the model's own (as its factory built it)")
    if cfg.lora:
        lines.append(f"- LoRA adapters of rank {cfg.lora} (alpha {cfg.lora_alpha or 2 * cfg.lora}) on "
                     f"{', '.join(cfg.lora_targets or ['all-linear'])}: the adapter is this folder's")
    counts = r.trained.counts
    lines += [f"- parameters: {counts['trainable']:,} trained of {counts['total']:,}", "", "## Data", "",
              f"- the dataset: `{r.job.dataset_name}`" + (f" (`{json.dumps(cfg.dataset_args)}`)" if cfg.dataset_args
                                                          else "")]
    for split, kind in (("training", data.kind.train), ("evaluation", data.kind.eval)):
        if kind is not None:
            count = f"{kind.length:,} samples" if kind.length is not None else "a stream"
            lines.append(f"- {split} set: {count}" + (f" (blocks of {cfg.pack} tokens)" if data.kind.packed else ""))
    lines += [f"- {note}" for note in data.notes]
    lines += ["", "## Objective", "", f"- `{cfg.objective}`: {objective}", "", "## Command", "", "```bash",
              command_line(r.given or cfg), "```"]
    if r.job.unnamed:
        lines += ["", f"fit() was given objects this command cannot build ({', '.join(r.job.unnamed)}): to train it "
                      "again from the command line, name functions that build them."]
    final = state.evals[-1] if state.evals else None
    lines += ["", "## Results", "", f"- steps: {state.step:,}, of {cfg.batch_size} samples each "
                                    f"({state.step * cfg.batch_size:,} samples)"]
    if data.kind.packed:
        lines.append(f"- tokens: {state.step * cfg.batch_size * cfg.pack:,} (blocks of {cfg.pack})")
    if final:
        shown = {k: v for k, v in final.items() if k not in ("step", "epoch", "samples")}
        lines.append(f"- final evaluation, at step {final['step']:,}, on {final['samples']:,} samples: "
                     + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()))
    return "\n".join(lines) + "\n\n"  # a blank line before what peft adds after it


def run_summary(r: Run, agreement: dict) -> dict:
    """What summary.json holds: the results, how the run was made, and how fast."""
    return {
        **_how_made(r),
        **_progress(r),
        **_trained_weights(r),
        **_tables(r),
        **_speed(r),
        "ranks_agree": agreement["agree"],  # None: not checked (ranks_check says why)
        "ranks_check": agreement["detail"],
        "notes": r.notes,
        "output_dir": str(r.output.folder),
        "versions": library_versions(),
    }


def _how_made(r: Run) -> dict:
    """The workload, the loss and metrics, and the processes and batches it was trained with."""
    cfg, accelerator, checked = r.cfg, r.accelerator, r.scoring.checked
    return {
        "model": r.job.model_name,
        "dataset": r.job.dataset_name,
        "built_from": "objects (fit)" if r.job.objects else "names",  # how evaluate/predict can rebuild it
        "loss_function": checked.loss_name,
        "loss_per": checked.loss_per,  # item: summed over items, divided by the global batch's count
        "unused_parameters": checked.unused,
        "metrics": list(r.scoring.metrics),
        "augment": _describe_augment(r.loaders.augment, cfg),
        "weights": f"ema (decay {cfg.ema})" if r.trained.ema else "trained",
        "world_size": r.world,
        "distributed_type": accelerator.distributed_type.value,
        "device": accelerator.device.type,
        "mixed_precision": accelerator.mixed_precision,
        "global_batch_size": cfg.batch_size,  # samples the loader deals a step (GRPO: prompts)
        "grad_accum": cfg.grad_accum,
        "per_process_batch_size": r.per_process_batch,
        **({"completions_per_step": r.given.batch_size} if r.given and r.given.batch_size != cfg.batch_size else {}),
    }


def _progress(r: Run) -> dict:
    """How far the run went (steps, epochs, samples, those skipped) and its evaluations."""
    cfg, state = r.cfg, r.state
    final = state.evals[-1] if state.evals else None
    return {
        "steps": state.step,
        "skipped_steps": state.skipped_steps,
        "bad_sample_steps": state.bad_sample_steps,
        "loss_scale_skipped_steps": state.loss_scale_skipped_steps,
        "unreadable_samples": state.unreadable_samples,
        "epochs": r.epoch + 1 if state.stopped_early or not r.shape.epochs else r.shape.epochs,  # trained, not planned
        "stream_resume": r.stream_resume,  # a resumed stream: how it reached its position, and in how long
        "train_samples": state.step * cfg.batch_size,
        "eval": {k: v for k, v in final.items() if k not in ("samples", "step", "epoch")} if final else None,
        "eval_samples": final["samples"] if final else 0,
        "evals": state.evals,
        "best": _best(cfg, state.evals),
        "stopped_early": state.stopped_early,
    }


def _trained_weights(r: Run) -> dict:
    """The trained weights: how they started, their counts, the adapters, the frozen ones, the optimizer's groups."""
    cfg, trained = r.cfg, r.trained
    return {
        "init": trained.tuning.init,
        "parameters": trained.counts,  # trainable (now) and total
        "lora": {"rank": cfg.lora, "alpha": cfg.lora_alpha or 2 * cfg.lora, "targets": cfg.lora_targets or "all-linear"}
        if cfg.lora else None,
        "frozen_weights": trained.frozen,  # what a checkpoint does not hold: their digest, checked on resume
        "param_groups": [{"lr_mult": g.get("lr_mult", 1.0), "weight_decay": g.get("weight_decay"),
                          "parameters": len(g["params"])} for g in trained.optimizer.param_groups],
    }


def _speed(r: Run) -> dict:
    """Where the run resumed from, how long it took, and how fast it trained (samples, FLOPs, memory)."""
    cfg, clock, trained = r.cfg, r.clock, r.trained
    samples_per_s = (r.state.step - r.shape.start_step) * cfg.batch_size / clock.train_time if clock.train_time else None
    peak = device_peak_flops(r.accelerator.device, run_precision(r.accelerator.mixed_precision, cfg.tf32,
                                                                   r.accelerator.device.type))
    flops_per_s = trained.flops * samples_per_s if samples_per_s and trained.flops else None
    return {
        "resumed_from": str(r.output.resume) if r.output.resume else None,
        "wall_time_s": time.perf_counter() - r.started,
        "train_time_s": clock.train_time,
        "data_time_share": clock.data_time / clock.train_time if clock.train_time else None,
        "samples_per_s": samples_per_s,
        "model_flops_per_sample": trained.flops,
        "flops_per_s": flops_per_s,
        # against the dense peak of the devices for the precision the run's matrix multiplies take
        "mfu": flops_per_s / (peak * r.world) if flops_per_s and peak else None,
        "peak_memory_mb": peak_memory_mb(r.accelerator.device),
    }


def _best(cfg: TrainConfig, evals: list[dict]) -> dict | None:
    """The best evaluation by the run's own measure (--save-best, else --early-stop, else accuracy or loss):
    the one `--save-best` keeps, the summary table and `acc-trainer report` show."""
    metric = ranked_by(evals, cfg.save_best or cfg.early_stop)
    best = best_evaluation(evals, metric) if metric else None
    return {"step": best["step"], "metric": metric, "value": best[metric]} if best else None


def _tables(r: Run) -> dict:
    """The last evaluation's confusion matrix (rows: targets, columns: predictions) and per-class table, by
    class name (the dataset's `classes`, else the class index)."""
    tables = r.tables
    if "confusion_matrix" not in tables:
        return {}
    classes = list(getattr(r.job.data.train, "classes", None) or [])
    names = [str(c) for c in classes] if len(classes) == len(tables["per_class"]) else \
        [str(i) for i in range(len(tables["per_class"]))]
    return {"classes": names, "confusion_matrix": tables["confusion_matrix"],
            "per_class": dict(zip(names, tables["per_class"], strict=True))}


def _describe_augment(augment, cfg: TrainConfig) -> str:
    if augment is None:
        return "none"
    parts = [augment.kind] if augment.kind != "none" else []
    parts += [f"mixup {cfg.mixup}"] * bool(cfg.mixup) + [f"cutmix {cfg.cutmix}"] * bool(cfg.cutmix)
    return ", ".join(parts)
