"""The training loop: one function, the same on a CPU, one GPU, many GPUs and many machines.

Read `train()` top to bottom. Accelerate does every distributed step, each one visible here:
`Accelerator(...)` picks devices, processes and precision; `prepare` wraps the model (DDP when
there are several processes, or FSDP / DeepSpeed when the accelerate config selects them: see
engines.py), the optimizer, the scheduler and the data loaders (each process gets
its slice of every global batch); `accumulate` + `backward` handle gradient accumulation and
loss scaling; `gather_for_metrics` collects evaluation outputs from every process exactly once;
`save_model` writes the final weights from the main process.

How batches are counted: `--batch-size` is the GLOBAL batch of one optimizer step. The training
loader yields global micro-batches of batch_size / grad_accum samples, and Accelerate
(`split_batches=True`) hands each of the N processes 1/N of every one. So 1 process, or 2, or 2 with
accumulation, all see the same samples at every optimizer step, and the LR schedule counts
optimizer steps whatever the topology.
"""

from __future__ import annotations

import math
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs, PartialState
from accelerate.utils import ProjectConfiguration, TorchDynamoPlugin, broadcast_object_list, set_seed
from safetensors.torch import load_file
from torch.utils.data import DataLoader, RandomSampler

from .checkpoints import BEST, Checkpoints, find_resume, read_state
from .checkpoints import load as load_checkpoint
from .config import ConfigError, TrainConfig
from .data import Data, IndexBatches, InMemory, build_data, steps_per_epoch
from .metrics import RunFiles, device_peak_flops, fingerprint, flops_per_sample, library_versions, peak_memory_mb
from .models import build_model, sync_batchnorm
from . import engines, speedups
from .optim import build_optimizer, build_scheduler
from .progress import Progress, summary_table
from .stopping import IntervalLosses, StopSignals, TrainingStopped


def train(cfg: TrainConfig) -> dict:
    """Train as `cfg` says; every process calls this. Returns the run summary (also in summary.json).

    Raises ConfigError for bad input and TrainingStopped when a signal or a NaN/inf loss stops the run.
    """
    cfg.validate()
    started = time.perf_counter()
    speedups.apply()
    # Without a GPU, cpu=True is what makes processes started by `accelerate launch --multi_gpu`
    # form one gloo group (MULTI_CPU) instead of running as independent copies.
    cpu = cfg.cpu or not torch.cuda.is_available()
    engine = engines.requested()  # FSDP or DEEPSPEED when the accelerate config selects one, else DDP
    if engine == "DEEPSPEED":
        engines.check_deepspeed(cfg)
        cpu = False  # Accelerate sets DeepSpeed up only without cpu=True (on a CPU it then runs one process)
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout))
    # The process group comes first (Accelerate's PartialState), so that the main process can name
    # the run folder for everyone before the Accelerator, whose trackers write there, is created.
    state = PartialState(cpu=cpu, **timeout.to_kwargs())
    _check_topology(cfg, state)
    out = _output_dir(cfg)
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

    # Same seed on every process: identical initial weights, identical generated data.
    set_seed(cfg.seed)
    data = _prepare_data(cfg, accelerator)
    model = build_model(cfg.model, data)
    # Counted on the main process only, so before BatchNorm layers become collective (--sync-bn).
    flops = flops_per_sample(model, data.train[0][0]) if accelerator.is_main_process else 0
    if cfg.sync_bn:
        model = sync_batchnorm(model, accelerator.device.type)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    # Compared before `prepare`, whose DDP wrapper would copy rank 0's weights over a seeding mistake.
    ranks_agree = check_ranks_agree(accelerator, model, "initial")
    peak_flops = device_peak_flops(accelerator.device)
    per_epoch = steps_per_epoch(data, cfg)
    total_steps = min(cfg.epochs * per_epoch, cfg.max_steps or math.inf)
    epochs = math.ceil(total_steps / per_epoch)
    lr = cfg.lr * cfg.batch_size / cfg.lr_reference_batch if cfg.scale_lr else cfg.lr
    optimizer = build_optimizer(cfg, model.parameters(), lr)
    scheduler = build_scheduler(cfg, optimizer, lr, total_steps, per_epoch)

    train_loader, eval_loader = build_loaders(cfg, data, world, pin_memory=accelerator.device.type == "cuda")
    input_dtype = engines.prepare_deepspeed(accelerator, per_process_batch)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    loss_fn = F.cross_entropy if data.task == "classification" else F.mse_loss

    # Where the run starts: step 0, or a checkpoint's step with its RNGs, optimizer and schedule.
    step, skipped, evals, best = 0, 0, [], None
    losses = IntervalLosses(cfg.log_every, cfg.grad_accum, accelerator.device)
    if resumed:
        load_checkpoint(accelerator, resume)
        step, skipped, evals, best = resumed["step"], resumed["skipped_steps"], resumed["evals"], resumed["best"]
        losses.load(resumed["losses"], accelerator.process_index)
    # Startup succeeded: only now does the run write anything, so a failed start leaves nothing behind.
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
                "engine": engine,
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
        f"[bold]acc_trainer[/] {cfg.model} on {cfg.dataset}: {world} process(es) "
        f"({accelerator.distributed_type.value}, {accelerator.device.type}), precision {accelerator.mixed_precision}, "
        f"global batch {cfg.batch_size} = {world} x {cfg.grad_accum} x {per_process_batch}, "
        f"{total_steps} steps" + (f", resuming at step {step} from {resume}" if resumed else "")
    )

    logged_step, train_time, data_time = step, 0.0, 0.0
    checkpoint_steps = cfg.checkpoint_steps  # parsed once, not in every step
    with progress, StopSignals(accelerator) as signals, files.plots_if_stopped():
        interval_start, data_wait = time.perf_counter(), 0.0
        # A checkpoint at the very end (after the final evaluation) leaves nothing to train.
        for epoch in range(step // per_epoch if step < total_steps else epochs, epochs):
            model.train()
            progress.new_epoch(epoch, done=step - epoch * per_epoch)
            # The epoch seeds the shuffle; a resumed epoch skips the micro-batches it has already seen.
            seen = (step - epoch * per_epoch) * cfg.grad_accum
            batches = accelerator.skip_first_batches(train_loader, seen) if seen else train_loader
            batches.set_epoch(epoch)
            batch_ready = time.perf_counter()
            for inputs, targets in batches:
                data_wait += time.perf_counter() - batch_ready
                inputs = model_inputs(inputs, cfg.channels_last, input_dtype)
                with accelerator.accumulate(model):
                    loss = loss_fn(model(inputs), targets)
                    accelerator.backward(loss)
                    losses.add(loss)  # on the device; read back only at log steps and checkpoints
                    if accelerator.sync_gradients:
                        if cfg.skip_nonfinite and losses.last_step_nonfinite(accelerator):
                            skipped += 1  # no update from this step's gradients
                        else:
                            if cfg.max_grad_norm:
                                accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                            optimizer.step()
                            scheduler.step()
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
            # Evaluate after every epoch (and after the last step when --max-steps ends mid-epoch).
            eval_start = time.perf_counter()
            metrics = evaluate(accelerator, model, eval_loader, data.task, cfg.channels_last, input_dtype)
            evals.append({"step": step, "epoch": epoch + 1, **metrics})
            files.log({"step": step, "epoch": epoch + 1, **{f"eval_{k}": v for k, v in metrics.items()}})
            if cfg.log_with:
                accelerator.log({f"eval/{k}": v for k, v in metrics.items() if k != "samples"}, step=step)
            progress.print(f"epoch {epoch + 1}/{epochs}: " + _format_eval(metrics))
            if cfg.save_best and _improves(cfg.save_best, metrics, best):
                best = {"step": step, "metric": cfg.save_best, "value": metrics[cfg.save_best]}
                save_checkpoint(BEST)
            if cfg.checkpoint_epochs or (checkpoint_steps and step % checkpoint_steps == 0):
                save_checkpoint()
            interval_start += time.perf_counter() - eval_start  # evaluation is not training time
            stop_if_signalled()

    ranks_agree = ranks_agree and check_ranks_agree(accelerator, model, "final")
    accelerator.wait_for_everyone()
    accelerator.save_model(model, out)
    final = evals[-1]
    summary = {
        "model": cfg.model,
        "dataset": cfg.dataset,
        "world_size": world,
        "distributed_type": accelerator.distributed_type.value,
        "device": accelerator.device.type,
        "mixed_precision": accelerator.mixed_precision,
        "global_batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "per_process_batch_size": per_process_batch,
        "steps": step,
        "skipped_steps": skipped,
        "epochs": epochs,
        "train_samples": step * cfg.batch_size,
        "eval": {k: v for k, v in final.items() if k not in ("samples", "step", "epoch")},
        "eval_samples": final["samples"],
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
    if accelerator.is_main_process:
        from .plots import plot_run  # matplotlib: 0.4 s to import, needed only here

        plots = plot_run(out)
    progress.print(f"[bold]final[/] {_format_eval(final)}; {summary['samples_per_s'] or 0:,.0f} samples/s; "
                   f"run files in {out}")
    progress.print(summary_table(summary, plots))
    accelerator.end_training()
    return summary


def dataloader_config(cfg: TrainConfig) -> DataLoaderConfiguration:
    """Each process takes its slice of every loader batch (so loader batches are global), and the
    shuffle is reseeded from --seed every epoch, identically on every process and in every run."""
    return DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=cfg.seed,
                                   non_blocking=True)  # copies from pinned memory overlap the GPU's work


def build_loaders(cfg: TrainConfig, data: Data, world: int, pin_memory: bool) -> tuple[DataLoader, DataLoader]:
    """The training loader yields global micro-batches; the evaluation loader `--eval-batch-size` per process."""
    per_epoch = steps_per_epoch(data, cfg)
    # Exactly `per_epoch` whole global batches per epoch (the first per_epoch x batch_size indices of
    # each epoch's permutation): no partial step and no partial accumulation on any topology.
    # Over indices, not the dataset: Accelerate pickles the sampler into every checkpoint.
    sampler = RandomSampler(range(len(data.train)), num_samples=per_epoch * cfg.batch_size)
    micro_batch = cfg.batch_size // cfg.grad_accum
    if isinstance(data.train, InMemory):  # whole batches at once, as index tensors
        batching = {"batch_sampler": IndexBatches(sampler, micro_batch), "collate_fn": InMemory.collate}
    else:
        batching = {"sampler": sampler, "batch_size": micro_batch, "drop_last": True}
    train_loader = DataLoader(data.train, num_workers=cfg.num_workers, pin_memory=pin_memory,
                              persistent_workers=cfg.num_workers > 0, **batching)
    per_process = cfg.eval_batch_size or cfg.batch_size // (world * cfg.grad_accum)
    eval_loader = DataLoader(data.eval, batch_size=per_process * world, shuffle=False, num_workers=cfg.num_workers,
                             pin_memory=pin_memory, collate_fn=InMemory.collate if isinstance(data.eval, InMemory) else None)
    return train_loader, eval_loader


def evaluate(accelerator: Accelerator, model, loader, task: str, channels_last: bool = False,
             input_dtype: torch.dtype | None = None) -> dict:
    """Metrics over the whole evaluation set, each sample counted once whatever the number of processes.

    The loader pads its last batch so that every process gets the same number of samples;
    `gather_for_metrics` drops that padding again.
    """
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    correct = torch.zeros((), dtype=torch.int64, device=accelerator.device)
    count = 0
    with torch.no_grad():
        for inputs, targets in loader:
            inputs = model_inputs(inputs, channels_last, input_dtype)
            outputs, targets = accelerator.gather_for_metrics((model(inputs), targets))
            outputs = outputs.float()
            if task == "classification":
                loss_sum += F.cross_entropy(outputs, targets, reduction="sum").double()
                correct += (outputs.argmax(dim=1) == targets).sum()
            else:
                loss_sum += F.mse_loss(outputs, targets, reduction="sum").double() / outputs[0].numel()
            count += len(targets)
    model.train()
    metrics = {"loss": loss_sum.item() / count, "samples": count}
    if task == "classification":
        metrics["accuracy"] = correct.item() / count
    return metrics


def model_inputs(inputs: torch.Tensor, channels_last: bool, dtype: torch.dtype | None) -> torch.Tensor:
    """A batch as the model takes it: NHWC memory for --channels-last, the weights' dtype under DeepSpeed."""
    if channels_last and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    if dtype is not None and inputs.is_floating_point():
        inputs = inputs.to(dtype)
    return inputs


def _prepare_data(cfg: TrainConfig, accelerator: Accelerator) -> Data:
    # The main process goes first (and downloads, if it must); the others then read its files. An
    # error is raised only after the context, so that no process is left waiting at its barrier.
    error = None
    with accelerator.main_process_first():
        try:
            data = build_data(cfg)
        except ConfigError as e:
            error = e
    if error is not None:
        raise error
    return data


def _check_topology(cfg: TrainConfig, state: PartialState) -> None:
    world = state.num_processes
    if cfg.batch_size % (world * cfg.grad_accum):
        raise ConfigError(
            f"--batch-size {cfg.batch_size} does not split into {world} processes x {cfg.grad_accum} "
            f"accumulation micro-batches; use a multiple of {world * cfg.grad_accum}"
        )


def _output_dir(cfg: TrainConfig) -> Path:
    if cfg.output_dir:
        out = Path(cfg.output_dir)
    elif cfg.resume not in (None, "auto"):  # <run>/checkpoints/<checkpoint>
        out = Path(cfg.resume).resolve().parent.parent
    elif cfg.resume == "auto":
        raise ConfigError("--resume auto needs the --output-dir of the run to continue")
    else:  # the main process names it, so that every process writes to the same folder
        name = [f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.model}-{cfg.dataset}"]
        broadcast_object_list(name)
        out = Path(name[0])
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out} exists and is not a folder")
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
    plain = model if when == "initial" else accelerator.unwrap_model(model)
    prints = accelerator.gather(fingerprint(plain).to(accelerator.device)[None])
    if not bool((prints == prints[0]).all()):
        raise RuntimeError(f"the {when} parameters differ between processes")
    return True


def _improves(metric: str, metrics: dict, best: dict | None) -> bool:
    if best is None:
        return True
    return metrics[metric] > best["value"] if metric == "accuracy" else metrics[metric] < best["value"]


def _nonfinite_message(step: int, last: Path | None) -> str:
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was saved before it"
    return f"the loss became NaN or inf at step {step}; stopped all processes ({kept}; --skip-nonfinite skips such steps)"


def _tracker_config(cfg: TrainConfig) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in cfg.to_dict().items()}


def _format_eval(metrics: dict) -> str:
    text = f"eval loss {metrics['loss']:.4f}"
    if "accuracy" in metrics:
        text += f", accuracy {metrics['accuracy']:.2%}"
    return text + f" on {metrics['samples']} samples"
