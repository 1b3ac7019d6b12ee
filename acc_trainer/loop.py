"""The training loop: one function, the same on a CPU, one GPU, many GPUs and many machines.

`train(config)` trains what the options name (built-in names or import paths, resolved in
components.py); `fit(model, train_data, ...)` trains a user's own objects. Both end in `run()`, the
loop: read it top to bottom. Accelerate does every distributed step, each one visible here:
`Accelerator(...)` picks devices, processes and precision; `prepare` wraps the model (DDP when
there are several processes, or FSDP / DeepSpeed when the accelerate config selects them: see
engines.py), the optimizer, the scheduler and the data loaders (each process gets
its slice of every global batch); `accumulate` + `backward` handle gradient accumulation and
loss scaling; `gather_for_metrics` tells evaluation which samples are real on every process;
`save_model` writes the final weights from the main process.

How batches are counted: `--batch-size` is the GLOBAL batch of one optimizer step. The training
loader yields global micro-batches of batch_size / grad_accum samples, and Accelerate
(`split_batches=True`) hands each of the N processes 1/N of every one. So 1 process, or 2, or 2 with
accumulation, all see the same samples at every optimizer step, and the LR schedule counts
optimizer steps whatever the topology.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import time
from contextlib import contextmanager
from functools import partial
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs, PartialState
from accelerate.utils import (DistributedType, ProjectConfiguration, TorchDynamoPlugin, broadcast,
                              broadcast_object_list, find_batch_size, gather_object, recursively_apply, set_seed)
from safetensors.torch import load_file
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from . import augment as augmentation
from . import components, engines, speedups, tasks
from .checkpoints import BEST, Checkpoints, check_model, find_resume, parameter_shapes, read_state, write_failure, WRITE_ERRORS
from .checkpoints import load as load_checkpoint
from .components import Workload, first_samples
from .config import ConfigError, TrainConfig, make_config
from .data import DATASETS, Data, Guarded, IndexBatches, InMemory, PerSample, augmented, reads_files, sample_name, steps_per_epoch
from .metrics import RunFiles, check_not_in_use, device_peak_flops, lock_run_folder, fingerprint, flops_per_sample, library_versions, peak_memory_mb
from .models import sync_batchnorm
from .optim import build_optimizer, build_scheduler
from .progress import Progress, format_metric, summary_table
from .stopping import IntervalLosses, StopSignals, TrainingStopped
from .tasks import forward


def train(cfg: TrainConfig) -> dict:
    """Train what `cfg` names; every process calls this. Returns the run summary (also in summary.json).

    Raises ConfigError for bad input and TrainingStopped when a signal or a NaN/inf loss stops the run.
    """
    cfg.validate()
    _start_processes(cfg)
    set_seed(cfg.seed)  # the same initial weights and generated data on every process
    return run(cfg, components.build_workload(cfg))


def fit(model, train_data, eval_data=None, *, loss=None, metrics=None, config: TrainConfig | None = None,
        **options) -> dict:
    """Train `model` (a plain nn.Module) on `train_data`, evaluating on `eval_data` after every epoch.

    Datasets are map-style and yield `(inputs, targets)` or dicts of tensors (the model is then
    called as `model(**batch)`, targets are `batch["labels"]`). `loss`: a function
    `loss(outputs, targets) -> scalar` or a built-in name; None uses the model's own loss when its
    outputs carry one, else cross-entropy for integer targets and MSE for real ones. `metrics`: a dict
    of name -> `metric(outputs, targets)` (one value per sample) or built-in names. `options` are
    TrainConfig fields (`epochs=3, batch_size=256, ...`), applied over `config`. Every process of a
    launch calls this with the same arguments; returns the run summary.
    """
    cfg = fit_config(model, train_data, config, options)
    return run(cfg, components.from_objects(model, train_data, eval_data, loss, metrics))


def fit_config(model, train_data, config: TrainConfig | None, options: dict) -> TrainConfig:
    """`config` with `options` over it, naming the model and data by their classes."""
    values = config.to_dict() if config is not None else {}
    unknown = sorted(set(options) - set(TrainConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"fit: unknown option {unknown[0]!r} (options are TrainConfig fields, e.g. epochs, batch_size)")
    values.update(options)
    values["model"], values["dataset"] = components.qualified_name(model), components.qualified_name(train_data)
    return make_config(values)


def run(cfg: TrainConfig, job: Workload) -> dict:
    """The training loop, on the objects of `job`: the model, the data, the loss and the metrics."""
    started = time.perf_counter()
    speedups.apply()
    state, engine, cpu, timeout = _start_processes(cfg)
    _warn_if_one_process_was_meant(state)
    _check_topology(cfg, state)
    out = _output_dir(cfg, job)
    resume = find_resume(cfg, out)
    resumed = read_state(resume, cfg, state.num_processes, engine) if resume else None
    if torch.cuda.is_available():  # TF32 tensor cores for float32 matmuls and convolutions (Ampere on)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=cfg.mixed_precision,  # None: the accelerate config's choice, else "no"
        dynamo_plugin=TorchDynamoPlugin(backend="inductor") if cfg.compile else None,
        gradient_accumulation_steps=cfg.grad_accum,
        log_with=_tracker(cfg.log_with),
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        dataloader_config=dataloader_config(cfg),
        kwargs_handlers=[timeout],
        deepspeed_plugin=engines.deepspeed_plugin(cfg) if engine == "DEEPSPEED" else None,
    )
    world = accelerator.num_processes
    per_process_batch = cfg.batch_size // (world * cfg.grad_accum)  # of one micro-batch
    engines.set_up(accelerator, engine)  # FSDP on CPU processes; no engine silently replaced
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "fp16":
        raise ConfigError("fp16 mixed precision needs a GPU; on a CPU use --mixed-precision bf16 or no")

    set_seed(cfg.seed)  # dropout and every other random number of the run start from --seed
    model, data = job.model, job.data
    _same_data_everywhere(accelerator, data)
    if resumed:
        check_model(resume, resumed, model)
    # One sample through the model, the loss and the metrics, before anything is written.
    loss_fn, loss_name, metrics = components.check_fit(job)
    _check_save_best(cfg, metrics, data)
    augment = augmentation.from_config(cfg, data)  # None, or each sample's from (seed, epoch, index)
    loss_fn = _cross_entropy_options(cfg, loss_fn, loss_name, augment)
    if cfg.ema and engine != "DDP":
        raise ConfigError(f"--ema needs the whole model on every process; with {engine} each holds a shard")
    shapes = parameter_shapes(model)
    # Counted on the main process only, so before BatchNorm layers become collective (--sync-bn).
    flops = flops_per_sample(model, first_samples(data.train, 1)) if accelerator.is_main_process else 0
    # Compared (and made equal, with a note) before `prepare`, whose DDP wrapper would silently copy
    # rank 0's weights over a seeding mistake.
    notes = _same_initial_weights(accelerator, model)
    if cfg.sync_bn:
        model = sync_batchnorm(model, accelerator.device.type)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    peak_flops = device_peak_flops(accelerator.device)
    per_epoch = steps_per_epoch(data, cfg)
    total_steps = cfg.max_steps or cfg.epochs * per_epoch  # --max-steps wins over --epochs, as in HF's Trainer
    epochs = math.ceil(total_steps / per_epoch)
    lr = cfg.lr * cfg.batch_size / cfg.lr_reference_batch if cfg.scale_lr else cfg.lr
    optimizer = build_optimizer(cfg, model.parameters(), lr)
    scheduler = build_scheduler(cfg, optimizer, lr, total_steps, per_epoch)

    train_loader, eval_loader = build_loaders(cfg, data, world, accelerator.device, augment)
    input_dtype = engines.prepare_deepspeed(accelerator, per_process_batch)
    # Batches of tensors already on the training device need no copy: Accelerate's send_to_device would
    # still walk every batch (12 us of a 90 us step of a small model here). DeepSpeed and Megatron-LM refuse
    # the list; FSDP2 and tensor parallelism ignore it.
    placement = None if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM) else [
        None, None, *(False if _on(loader, accelerator.device) else None for loader in (train_loader, eval_loader)),
        None]
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler, device_placement=placement
    )

    # The exponential moving average of the weights: updated after every optimizer step, evaluated and
    # saved in their place, and part of every checkpoint.
    ema = None
    if cfg.ema:
        ema = torch.optim.swa_utils.AveragedModel(
            accelerator.unwrap_model(model, keep_torch_compile=False), use_buffers=True,
            multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema))
        accelerator.register_for_checkpointing(ema)
    trained = accelerator.unwrap_model(model, keep_torch_compile=False) if ema else None

    # Where the run starts: step 0, or a checkpoint's step with its RNGs, optimizer and schedule.
    step, skipped, evals, best = 0, 0, [], None
    losses = IntervalLosses(cfg.log_every, cfg.grad_accum, accelerator.device)
    if resumed:
        load_checkpoint(accelerator, resume)
        step, skipped, evals, best = resumed["step"], resumed["skipped_steps"], resumed["evals"], resumed["best"]
        losses.load(resumed["losses"], accelerator.process_index)
    # Startup succeeded: only now does the run write anything, so a failed start leaves nothing behind.
    _lock(accelerator, out, resuming=resume is not None)
    files = RunFiles(out, enabled=accelerator.is_main_process, resumed_step=step if resumed else None)
    files.write_config(cfg)
    checkpoints = Checkpoints(accelerator, out / "checkpoints", cfg.keep_last)
    checkpoints.last = resume
    if cfg.log_with:
        accelerator.init_trackers("acc_trainer", config=_tracker_config(cfg))

    def training_state() -> dict:
        # Everything besides save_state's files that the rest of the run depends on (all processes
        # call this). The position in the data is the step: every epoch has exactly `per_epoch` steps.
        return {"step": step, "skipped_steps": skipped, "evals": evals, "best": best, "world_size": world,
                "engine": engine, "parameters": shapes,
                "losses": losses.state(accelerator), "config": cfg.to_dict()}

    def save_checkpoint(name: str | None = None) -> None:
        _, bad = losses.read(accelerator)
        if bad is not None and not cfg.skip_nonfinite:  # never checkpoint weights a NaN/inf has reached
            raise TrainingStopped(_nonfinite_message(bad, checkpoints.last), code=1)
        checkpoints.save(training_state(), name)

    def stop_if_signalled(check: bool = True) -> None:
        stop = signals.agreed(check)  # the same answer on every process
        if stop:
            if checkpoints.last is None or checkpoints.last.name != f"step-{step:08d}":
                save_checkpoint()
            raise TrainingStopped(
                f"stopped by {signal.Signals(stop).name} at step {step}; checkpoint saved in {checkpoints.last}; "
                f"continue with --resume auto --output-dir {out}", code=128 + stop)

    progress = Progress(cfg.progress, accelerator.is_main_process, total_steps, epochs, per_epoch)
    progress.print(
        f"[bold]acc_trainer[/] {job.model_name} on {job.dataset_name}: {world} process(es) "
        f"({accelerator.distributed_type.value}, {accelerator.device.type}), precision {accelerator.mixed_precision}, "
        f"global batch {cfg.batch_size} = {world} x {cfg.grad_accum} x {per_process_batch}, "
        f"{total_steps} steps" + (f", resuming at step {step} from {resume}" if resumed else "")
    )
    for note in notes:
        progress.print(note)

    guarded, unreadable, bad_samples, bad_steps, overflows = reads_files(data.train), [], [], 0, 0

    def raise_unreadable(indices: list[int], split: str, at: int) -> None:
        # All processes agree on it; the steps so far are kept in a checkpoint first.
        optimizer.zero_grad()
        if checkpoints.last is None or checkpoints.last.name != f"step-{step:08d}":
            save_checkpoint()
        dataset = data.train if split == "training" else data.eval
        more = f" (and {len(indices) - 1} more)" if len(indices) > 1 else ""
        raise TrainingStopped(f"{split} sample {sample_name(dataset, indices[0])}{more} cannot be read, at step {at}; "
                              f"checkpoint saved in {checkpoints.last}; acc-trainer check-data lists every such sample"
                              + ("; --skip-bad-samples skips them" if split == "training" else ""), code=1)

    logged_step, train_time, data_time = step, 0.0, 0.0
    checkpoint_steps = cfg.checkpoint_steps  # parsed once, not in every step
    where = lambda: f"epoch {epoch + 1}, after optimizer step {step}, process {accelerator.process_index} of {world}"
    with progress, StopSignals(accelerator) as signals, files.plots_if_stopped(cfg.plots), _naming_the_step(where):
        interval_start, data_wait = time.perf_counter(), 0.0
        # A checkpoint at the very end (after the final evaluation) leaves nothing to train.
        for epoch in range(step // per_epoch if step < total_steps else epochs, epochs):
            model.train()
            progress.new_epoch(epoch, done=step - epoch * per_epoch)
            # The epoch seeds the shuffle; a resumed epoch skips the micro-batches it has already seen.
            seen = (step - epoch * per_epoch) * cfg.grad_accum
            batches = accelerator.skip_first_batches(train_loader, seen) if seen else train_loader
            batches.set_epoch(epoch)
            if augment:
                augment.set_epoch(epoch)  # and each sample's augmentation, whatever process or batch reads it
            batch_ready = time.perf_counter()
            for batch in batches:
                data_wait += time.perf_counter() - batch_ready
                if guarded:  # (batch, indices of the samples that could not be read, else -1)
                    batch, indices = batch
                    unreadable += [i for i in indices if i >= 0]  # plain ints: no device sync
                batch = model_inputs(batch, cfg.channels_last, input_dtype)
                with accelerator.accumulate(model):
                    outputs, targets = forward(model, batch)
                    loss = loss_fn(outputs, targets)
                    accelerator.backward(loss)
                    losses.add(loss)  # on the device; read back only at log steps and checkpoints
                    if accelerator.sync_gradients:
                        bad = _unreadable_everywhere(accelerator, unreadable) if guarded else []
                        unreadable = []
                        if bad and not cfg.skip_bad_samples:
                            raise_unreadable(bad, "training", step + 1)
                        if bad:
                            bad_samples += [sample_name(data.train, i) for i in bad]
                            bad_steps += 1  # no update from a batch with stand-ins for unreadable samples
                        elif cfg.skip_nonfinite and losses.last_step_nonfinite(accelerator):
                            skipped += 1  # no update from this step's gradients
                        else:
                            if cfg.max_grad_norm:
                                accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                            optimizer.step()
                            scheduler.step()
                            if ema:
                                ema.update_parameters(trained)
                            # fp16: the grad scaler skips a step whose gradients overflowed (no host sync: a flag)
                            overflows += accelerator.optimizer_step_was_skipped
                    optimizer.zero_grad()
                batch_ready = time.perf_counter()
                if not accelerator.sync_gradients:
                    continue
                step += 1
                progress.step()
                if step % cfg.log_every == 0 or step == total_steps:
                    # Every rank's mean loss over the interval, gathered: the logged loss is their mean.
                    per_rank, bad = losses.read(accelerator)
                    if bad is not None and not cfg.skip_nonfinite:
                        raise TrainingStopped(_nonfinite_message(bad, checkpoints.last), code=1)
                    elapsed = time.perf_counter() - interval_start
                    steps_done, logged_step = step - logged_step, step
                    record = {
                        "step": step,
                        "epoch": epoch + 1,
                        "loss": sum(per_rank) / len(per_rank),
                        "loss_per_rank": per_rank,
                        "lr": scheduler.get_last_lr()[0],
                        "samples_per_s": steps_done * cfg.batch_size / elapsed,
                        "step_time_s": elapsed / steps_done,
                        "data_time_s": data_wait / steps_done,
                        "flops_per_s": flops * steps_done * cfg.batch_size / elapsed,
                    }
                    files.log(record)
                    if cfg.log_with:
                        accelerator.log({"train/loss": record["loss"], "train/lr": record["lr"],
                                         "train/samples_per_s": record["samples_per_s"]}, step=step)
                    progress.log(step, epoch, record["loss"], record["lr"], record["samples_per_s"])
                    train_time += elapsed
                    data_time += data_wait
                    losses.restart(step)
                    data_wait = 0.0
                    interval_start = time.perf_counter()
                # At an epoch's last step, checkpoints and stops wait for that epoch's evaluation.
                if step == total_steps or step % per_epoch == 0:
                    break
                if checkpoint_steps and step % checkpoint_steps == 0:
                    save_checkpoint()
                stop_if_signalled(check=step % cfg.log_every == 0)
                batch_ready = time.perf_counter()  # logging and checkpoints are not waiting for data
            # Evaluate after every epoch (and after the last step when --max-steps ends mid-epoch).
            eval_start = time.perf_counter()
            if eval_loader is not None:
                results = evaluate(accelerator, ema.module if ema else model, eval_loader, loss_fn, metrics,
                                   cfg.channels_last, input_dtype, guarded=reads_files(data.eval))
                if results.pop("unreadable", False):  # an evaluation counts every sample: never skipped
                    raise_unreadable(results["unreadable_indices"], "evaluation", step)
                results.pop("unreadable_indices", None)
                evals.append({"step": step, "epoch": epoch + 1, **results})
                files.log({"step": step, "epoch": epoch + 1, **{f"eval_{k}": v for k, v in results.items()}})
                if cfg.log_with:
                    accelerator.log({f"eval/{k}": v for k, v in results.items() if k != "samples"}, step=step)
                progress.print(f"epoch {epoch + 1}/{epochs}: " + _format_eval(results))
                if cfg.save_best and _improves(cfg.save_best, results, best):
                    best = {"step": step, "metric": cfg.save_best, "value": results[cfg.save_best]}
                    save_checkpoint(BEST)
            if cfg.checkpoint_epochs or (checkpoint_steps and step % checkpoint_steps == 0):
                save_checkpoint()
            interval_start += time.perf_counter() - eval_start  # evaluation is not training time
            stop_if_signalled()

    ranks_agree = check_ranks_agree(accelerator, model, "final")
    accelerator.wait_for_everyone()
    # Accelerate saves a compiled model under its wrapper's names (`_orig_mod.fc1.weight`); saved from
    # the module itself, the weights load into the model as the user built it. FSDP and DeepSpeed need
    # their wrapper to gather the full weights.
    to_save = model if engine != "DDP" else accelerator.unwrap_model(model, keep_torch_compile=False)
    to_save = ema.module if ema else to_save
    try:
        accelerator.save_model(to_save, out)
    except WRITE_ERRORS as e:
        if not accelerator.is_main_process:
            raise
        kept = f"the last complete checkpoint is {checkpoints.last}" if checkpoints.last else "no checkpoint was saved"
        raise TrainingStopped(f"writing the final weights {out / 'model.safetensors'} failed: "
                              f"{write_failure(e, out)}; {kept}", code=1, alone=True) from None
    final = evals[-1] if evals else None
    summary = {
        "model": job.model_name,
        "dataset": job.dataset_name,
        "loss_function": loss_name,
        "metrics": list(metrics),
        "augment": _describe_augment(augment, cfg),
        "weights": f"ema (decay {cfg.ema})" if ema else "trained",
        "world_size": world,
        "distributed_type": accelerator.distributed_type.value,
        "device": accelerator.device.type,
        "mixed_precision": accelerator.mixed_precision,
        "global_batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "per_process_batch_size": per_process_batch,
        "steps": step,
        "skipped_steps": skipped,
        "bad_sample_steps": bad_steps,
        "loss_scale_skipped_steps": overflows,
        "unreadable_samples": bad_samples,
        "epochs": epochs,
        "train_samples": step * cfg.batch_size,
        "eval": {k: v for k, v in final.items() if k not in ("samples", "step", "epoch")} if final else None,
        "eval_samples": final["samples"] if final else 0,
        "evals": evals,
        "best": best,
        "resumed_from": str(resume) if resume else None,
        "wall_time_s": time.perf_counter() - started,
        "train_time_s": train_time,
        "data_time_share": data_time / train_time if train_time else None,
        "samples_per_s": (step - (resumed or {"step": 0})["step"]) * cfg.batch_size / train_time if train_time else None,
        "model_flops_per_sample": flops,
        "flops_per_s": None,
        "mfu": None,
        "peak_memory_mb": peak_memory_mb(accelerator.device),
        "ranks_agree": ranks_agree,
        "notes": notes,
        "output_dir": str(out),
        "versions": library_versions(),
    }
    if summary["samples_per_s"]:
        summary["flops_per_s"] = flops * summary["samples_per_s"]
        if peak_flops:  # against the bf16 peak of one device, as nanoGPT reports MFU
            summary["mfu"] = summary["flops_per_s"] / (peak_flops * world)
    if cfg.model == "linreg" and accelerator.is_main_process:
        # From the full weights just saved: under FSDP a process's own parameters are only its shard.
        weights = load_file(out / "model.safetensors")
        summary["learned"] = {"weight": weights["linear.weight"].item(), "bias": weights["linear.bias"].item()}
        progress.print(f"learned weight {summary['learned']['weight']:.4f}, bias {summary['learned']['bias']:.4f}")
    files.write_summary(summary)
    plots = []
    if accelerator.is_main_process and cfg.plots:
        from .plots import plot_run  # matplotlib: 0.4 s to import, needed only here

        with files.writing(out / "plots"):
            plots = plot_run(out)
    progress.print(f"[bold]final[/] {_format_eval(final) if final else 'no evaluation set'}; "
                   f"{summary['samples_per_s'] or 0:,.0f} samples/s; "
                   f"run files in {out}")
    progress.print(summary_table(summary, plots))
    accelerator.end_training()
    return summary


def dataloader_config(cfg: TrainConfig) -> DataLoaderConfiguration:
    """Each process takes its slice of every loader batch (so loader batches are global), and the
    shuffle is reseeded from --seed every epoch, identically on every process and in every run."""
    return DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=cfg.seed,
                                   non_blocking=True)  # copies from pinned memory overlap the GPU's work


def build_loaders(cfg: TrainConfig, data: Data, world: int, device: torch.device,
                  augment: augmentation.Augment | None = None) -> tuple[DataLoader, DataLoader | None]:
    """The training loader yields global micro-batches; the evaluation loader `--eval-batch-size` per process
    (None without an evaluation set)."""
    per_epoch = steps_per_epoch(data, cfg)
    # Exactly `per_epoch` whole global batches per epoch (the first per_epoch x batch_size indices of
    # each epoch's permutation): no partial step and no partial accumulation on any topology.
    # Over indices, not the dataset: Accelerate pickles the sampler into every checkpoint.
    sampler = RandomSampler(range(len(data.train)), num_samples=per_epoch * cfg.batch_size)
    micro_batch = cfg.batch_size // cfg.grad_accum
    train_set = _placed(augmented(data.raw, augment) if augment else data.train, cfg, device)
    eval_set = _placed(data.eval, cfg, device) if data.eval is not None else None
    workers = cfg.num_workers
    if workers is None:  # workers for the built-in datasets read per sample; a user's may not survive spawn
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        per_sample = not (isinstance(train_set, InMemory) and cfg.data_pipeline == "batched")
        workers = min(8, max(1, (os.cpu_count() or 1) // local - 1)) if per_sample and cfg.dataset in DATASETS else 0

    def loading(dataset) -> dict:
        if isinstance(dataset, InMemory) and dataset.tensors[0].device.type != "cpu":  # gathered right here
            return {"num_workers": 0, "pin_memory": False}
        return {"num_workers": workers, "pin_memory": device.type == "cuda", "persistent_workers": workers > 0}

    if isinstance(train_set, InMemory) and cfg.data_pipeline == "batched":  # whole batches at once
        batching = {"batch_sampler": IndexBatches(sampler, micro_batch), "collate_fn": InMemory.collate}
    else:
        batching = {"sampler": sampler, "batch_size": micro_batch, "drop_last": True}
        if reads_files(train_set):
            train_set, batching["collate_fn"] = Guarded(train_set), Guarded.collate
    # Each loader draws its workers' base seed from a generator of its own at every iteration, not from
    # the global RNG: a resumed run starts a new iteration mid-epoch, which would shift every random
    # number the model draws after it (dropout) against the uninterrupted run.
    train_loader = DataLoader(train_set, generator=torch.Generator().manual_seed(cfg.seed), **loading(train_set),
                              **batching)
    if eval_set is None:
        return train_loader, None
    per_process = cfg.eval_batch_size or cfg.batch_size // (world * cfg.grad_accum)
    guarded = reads_files(eval_set)
    eval_loader = DataLoader(Guarded(eval_set) if guarded else eval_set, batch_size=per_process * world,
                             shuffle=False, generator=torch.Generator().manual_seed(cfg.seed), **loading(eval_set),
                             collate_fn=Guarded.collate if guarded else InMemory.collate if isinstance(eval_set, InMemory)
                             else None)
    return train_loader, eval_loader


def _on(loader: DataLoader | None, device: torch.device) -> bool:
    """Whether the loader's batches are gathered on `device` itself."""
    if loader is None or not isinstance(loader.dataset, InMemory):
        return False
    where = loader.dataset.tensors[0].device
    return where.type == device.type and device.index in (None, where.index)


def _placed(dataset, cfg: TrainConfig, device: torch.device):
    """Tensors in memory are served a batch at a time (`--data-pipeline batched`), from the training
    device when they take at most half of its free memory; or one sample at a time (`per-sample`)."""
    if type(dataset) not in (TensorDataset, InMemory):  # a subclass may have a __getitem__ of its own
        return dataset
    if cfg.data_pipeline == "per-sample":  # one sample per __getitem__, collated by the DataLoader
        plain = TensorDataset(*dataset.tensors)
        if isinstance(dataset, InMemory) and (dataset.prepare or dataset.augment):
            return PerSample(plain, dataset.prepare, dataset.augment)
        return plain
    if not isinstance(dataset, InMemory):
        dataset = InMemory(*dataset.tensors)
    if device.type == "cuda" and dataset.nbytes() <= torch.cuda.mem_get_info(device)[0] // 2:
        dataset = dataset.on(device)
    return dataset


def _cross_entropy_options(cfg: TrainConfig, loss_fn, loss_name: str, augment) -> callable:
    """--label-smoothing, and the class probabilities of mixup and cutmix, are cross-entropy's."""
    if not (cfg.label_smoothing or (augment and augment.mixes)):
        return loss_fn
    if loss_fn is not tasks.cross_entropy:
        raise ConfigError(f"--label-smoothing, --mixup and --cutmix apply to the cross_entropy loss; this run uses {loss_name}")
    return partial(tasks.cross_entropy, label_smoothing=cfg.label_smoothing) if cfg.label_smoothing else loss_fn


def _describe_augment(augment, cfg: TrainConfig) -> str:
    if augment is None:
        return "none"
    parts = [augment.kind] if augment.kind != "none" else []
    parts += [f"mixup {cfg.mixup}"] * bool(cfg.mixup) + [f"cutmix {cfg.cutmix}"] * bool(cfg.cutmix)
    return ", ".join(parts)


def evaluate(accelerator: Accelerator, model, loader, loss_fn, metrics: dict, channels_last: bool = False,
             input_dtype: torch.dtype | None = None, guarded: bool = False) -> dict:
    """The loss and every metric over the whole evaluation set, each sample counted once whatever the
    number of processes, and nothing but running sums kept (never the whole set's outputs).

    Accelerate pads the last batch so that every process gets as many samples; `gather_for_metrics`
    drops that padding, so gathering each process's own index through it says how many of its samples
    are real. Only those are passed through the model (every process still makes one call, as FSDP
    needs), and each batch's loss and per-sample metrics are weighted by that count. With `guarded`
    batches (data.Guarded), the indices of samples that could not be read come back as `unreadable`.
    """
    model.eval()
    totals = torch.zeros(len(metrics) + 2, dtype=torch.float64, device=accelerator.device)  # loss, metrics, count
    unreadable = []
    with torch.no_grad():
        for batch in loader:
            if guarded:
                batch, indices = batch
                unreadable += [i for i in indices if i >= 0]
            batch = model_inputs(batch, channels_last, input_dtype)
            size = find_batch_size(batch)
            real = _real_samples(accelerator, size)
            if real < size:
                batch = recursively_apply(lambda t: t[: max(real, 1)], batch)
            outputs, targets = forward(model, batch)
            if real == 0:
                continue
            values = [loss_fn(outputs, targets), *(metric(outputs, targets) for metric in metrics.values())]
            totals += torch.stack([_sample_sum(v, real) for v in values] + [totals.new_tensor(real)])
    model.train()
    totals = accelerator.reduce(totals, "sum").tolist()
    count = int(totals[-1])
    results = {"loss": totals[0] / count, **{name: total / count for name, total in zip(metrics, totals[1:-1])},
               "samples": count}
    if guarded:
        results["unreadable_indices"] = _unreadable_everywhere(accelerator, unreadable)
        results["unreadable"] = bool(results["unreadable_indices"])
    return results


def _unreadable_everywhere(accelerator: Accelerator, local: list[int]) -> list[int]:
    """The indices of unreadable samples on any process, the same list on all (one tiny all-reduce;
    the indices themselves are gathered only when there are some)."""
    if accelerator.num_processes == 1:
        return sorted(set(local))
    if accelerator.reduce(torch.tensor(len(local), device=accelerator.device), "sum").item() == 0:
        return []
    return sorted({i for part in gather_object([local]) for i in part})


def _real_samples(accelerator: Accelerator, size: int) -> int:
    if not accelerator.gradient_state.end_of_dataloader:
        return size  # only the last batch is padded
    owner = torch.full((size,), accelerator.process_index, device=accelerator.device)
    return int((accelerator.gather_for_metrics(owner) == accelerator.process_index).sum())


def _sample_sum(value: torch.Tensor, samples: int) -> torch.Tensor:
    """A batch's total over its samples: a scalar is the batch's mean, a vector holds one value per sample."""
    value = value.detach().double()
    return value * samples if value.dim() == 0 else value.reshape(samples, -1).mean(dim=1).sum()


def model_inputs(batch, channels_last: bool, dtype: torch.dtype | None):
    """A batch as the model takes it: NHWC images for --channels-last, floating inputs in the weights'
    dtype under DeepSpeed. Targets (the pair's second item, a dict's labels) stay as they are."""
    if not channels_last and dtype is None:
        return batch

    def convert(t: torch.Tensor) -> torch.Tensor:
        if channels_last and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    if isinstance(batch, dict):
        return {k: v if k == "labels" else recursively_apply(convert, v) for k, v in batch.items()}
    inputs, targets = batch
    return [recursively_apply(convert, inputs), targets]


def _start_processes(cfg: TrainConfig) -> tuple[PartialState, str, bool, InitProcessGroupKwargs]:
    """The process group (Accelerate's PartialState, a singleton: calling this again returns the same),
    the engine the accelerate config selects, and whether to run on the CPU."""
    # Without a GPU, cpu=True is what makes processes started by `accelerate launch --multi_gpu`
    # form one gloo group (MULTI_CPU) instead of running as independent copies.
    cpu = cfg.cpu or not torch.cuda.is_available()
    engine = engines.requested()  # FSDP or DEEPSPEED when the accelerate config selects one, else DDP
    engines.leave_deepspeed_alone(engine)
    if engine == "DEEPSPEED":
        engines.check_deepspeed(cfg)
        cpu = False  # Accelerate sets DeepSpeed up only without cpu=True (on a CPU it then runs one process)
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout))
    return PartialState(cpu=cpu, **timeout.to_kwargs()), engine, cpu, timeout


def _lock(accelerator: Accelerator, out: Path, resuming: bool) -> None:
    """The main process locks the run folder; every process learns whether it could."""
    error = [None]
    if accelerator.is_main_process:
        try:
            lock_run_folder(out, resuming)
        except ConfigError as e:
            error = [str(e)]
    broadcast_object_list(error)
    if error[0]:
        raise ConfigError(error[0])


def _warn_if_one_process_was_meant(state: PartialState) -> None:
    """Without a GPU, `accelerate launch --num_processes 2` (no --multi_gpu) starts ONE process through
    Accelerate's simple launcher, which still exports MASTER_ADDR but no WORLD_SIZE: say so."""
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ and "MASTER_ADDR" in os.environ
    if state.num_processes == 1 and launched and "WORLD_SIZE" not in os.environ:
        print("acc-trainer: warning: accelerate launch started ONE process (without --multi_gpu it starts several "
              "only on GPUs); for N: accelerate launch --multi_gpu --num_processes N -m acc_trainer ..., or "
              "--config_file accelerate_configs/cpu_ddp.yaml", file=sys.stderr)


def _same_data_everywhere(accelerator: Accelerator, data: Data) -> None:
    """Every process must hold the same datasets: with different lengths their shuffles and epochs
    would differ (and one process could wait for the others for ever at an epoch's end)."""
    if accelerator.num_processes == 1:
        return
    sizes = [len(data.train), len(data.eval) if data.eval is not None else -1]
    everywhere = accelerator.gather(torch.tensor([sizes], device=accelerator.device)).tolist()
    if any(row != everywhere[0] for row in everywhere):
        shown = "; ".join(f"process {i}: {t} training, {max(e, 0)} evaluation samples" for i, (t, e) in enumerate(everywhere))
        raise ConfigError(f"the datasets differ between processes ({shown}); every process must build the same data")


def _same_initial_weights(accelerator: Accelerator, model) -> list[str]:
    """A model built outside the trainer (fit(), or a factory drawing from another generator) may start
    from different weights on each process: all then start from process 0's, as DDP would make them
    (FSDP would not). Returns the note to print."""
    if accelerator.num_processes == 1 or _ranks_equal(accelerator, model):
        return []
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.copy_(broadcast(tensor.detach().to(accelerator.device), from_process=0))
    return ["note: the model's initial weights differed between processes (build it after seeding, e.g. "
            "accelerate.utils.set_seed); every process starts from process 0's"]


def _check_topology(cfg: TrainConfig, state: PartialState) -> None:
    world = state.num_processes
    if cfg.batch_size % (world * cfg.grad_accum):
        raise ConfigError(
            f"--batch-size {cfg.batch_size} does not split into {world} processes x {cfg.grad_accum} "
            f"accumulation micro-batches; use a multiple of {world * cfg.grad_accum}"
        )


def _output_dir(cfg: TrainConfig, job: Workload) -> Path:
    if cfg.output_dir:
        out = Path(cfg.output_dir)
    elif cfg.resume not in (None, "auto"):  # <run>/checkpoints/<checkpoint>
        out = Path(cfg.resume).resolve().parent.parent
    elif cfg.resume == "auto":
        raise ConfigError("--resume auto needs the --output-dir of the run to continue")
    else:  # the main process names it, so that every process writes to the same folder
        labels = [re.sub(r"[^\w.-]+", "_", name.rpartition(":")[2]) for name in (job.model_name, job.dataset_name)]
        name = [f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{labels[0]}-{labels[1]}"]
        broadcast_object_list(name)
        out = Path(name[0])
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out} exists and is not a folder")
    in_use = [None]
    if PartialState().is_main_process:
        try:
            check_not_in_use(out)
        except ConfigError as e:
            in_use = [str(e)]
    broadcast_object_list(in_use)
    if in_use[0]:
        raise ConfigError(in_use[0])
    if cfg.resume is None and any((out / name).exists() for name in RunFiles.OUTPUTS):
        raise ConfigError(f"--output-dir {out} already holds a run; choose a new folder, or add --resume auto")
    PartialState().wait_for_everyone()  # every process has checked before the main one writes
    return out


def _tracker(name: str | None) -> str | None:
    """Accelerate drops a tracker that is not installed with a warning; a user who asked for it gets an error."""
    if name is None:
        return None
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    if name not in LOGGER_TYPE_TO_CLASS:
        raise ConfigError(f"unknown tracker {name!r}; Accelerate supports {', '.join(sorted(LOGGER_TYPE_TO_CLASS))}")
    if name not in [str(t) for t in get_available_trackers()]:
        extra = ' (pip install -e ".[tensorboard]")' if name == "tensorboard" else ""
        raise ConfigError(f"--log-with {name}: the {name} package is not installed{extra}")
    return name


def check_ranks_agree(accelerator: Accelerator, model, when: str) -> bool:
    """Compares the parameters of every process (checked, not assumed); a difference is a bug.

    Under FSDP or DeepSpeed each process holds a different shard once the model is prepared:
    there, only the initial (unsharded) model is compared.
    """
    if when != "initial" and accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        return True
    # Before `prepare` the model is plain; unwrapping it anyway would import torch._dynamo (~1 s).
    if not _ranks_equal(accelerator, model if when == "initial" else accelerator.unwrap_model(model)):
        raise RuntimeError(f"the {when} parameters differ between processes")
    return True


def _ranks_equal(accelerator: Accelerator, model) -> bool:
    prints = accelerator.gather(fingerprint(model).to(accelerator.device)[None])
    return bool((prints == prints[0]).all())


LOWER_IS_BETTER = re.compile(r"(^|_)(loss|error|mae|mse)$")


def _improves(metric: str, metrics: dict, best: dict | None) -> bool:
    if best is None:
        return True
    lower = LOWER_IS_BETTER.search(metric)
    return metrics[metric] < best["value"] if lower else metrics[metric] > best["value"]


def _check_save_best(cfg: TrainConfig, metrics: dict, data: Data) -> None:
    if cfg.save_best is None:
        return
    if data.eval is None:
        raise ConfigError("--save-best needs an evaluation set")
    if cfg.save_best != "loss" and cfg.save_best not in metrics:
        raise ConfigError(f"--save-best {cfg.save_best}: the run evaluates {', '.join(['loss', *metrics])}")


@contextmanager
def _naming_the_step(where):
    """An error from the user's code (model, loss, metric, dataset) keeps its traceback, with where it
    happened added: it is theirs to fix. The trainer's own errors pass through as they are."""
    try:
        yield
    except (ConfigError, TrainingStopped):
        raise
    except Exception as e:
        note = f"acc_trainer: raised in {where()}"
        if hasattr(e, "add_note"):
            e.add_note(note)
        else:  # Python 3.10
            print(note, file=sys.stderr)
        raise


def _nonfinite_message(step: int, last: Path | None) -> str:
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was saved before it"
    return f"the loss became NaN or inf at step {step}; stopped all processes ({kept}; --skip-nonfinite skips such steps)"


def _tracker_config(cfg: TrainConfig) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in cfg.to_dict().items()}


def _format_eval(metrics: dict) -> str:
    parts = [f"eval loss {metrics['loss']:.4f}"]
    parts += [format_metric(name, value) for name, value in metrics.items()
              if name not in ("loss", "samples", "step", "epoch")]
    return ", ".join(parts) + f" on {metrics['samples']} samples"
