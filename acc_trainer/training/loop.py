"""The training steps: the same on a CPU, one GPU, many GPUs and many machines.

`run(cfg, job)` reads like a recipe: `setup` (setup.py) -> `train_epoch` -> `evaluate` (evaluation.py) ->
`finish` (summary.py). The Accelerate calls of the training steps are here, each visible where it is made:
`skip_first_batches` for a resumed epoch, `accumulate` + `backward` for gradient accumulation and loss
scaling, `clip_grad_norm_`, `reduce` for the token count of a summed loss and for early stopping, `log`
for trackers and `save_state` for checkpoints.

How batches are counted: `--batch-size` is the GLOBAL batch of one optimizer step. The training
loader yields global micro-batches of batch_size / grad_accum samples, and Accelerate
(`split_batches=True`) hands each of the N processes 1/N of every one. So 1 process, or 2, or 2 with
accumulation, all see the same samples at every optimizer step, and the LR schedule counts
optimizer steps whatever the topology.

The run's progress (step, evaluations, best, skipped steps, losses) is one `RunState` (state.py), saved
in every checkpoint; the prepared objects are the parts of one `Run` (setup.py).
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import ConfigError, TrainConfig
from ..data.datasets import overlapped
from ..data.faults import sample_name, stream_faults, unreadable_everywhere
from ..data.loaders import workers_stopped
from ..distributed.processes import Group
from ..distributed.watchdog import Watchdog
from ..language.adapters import gathered_state
from ..language.generation import ready, write_samples
from ..language.pretrained import config_files, tokenizer_files
from ..outputs.checkpoints import BEST
from ..stopping import StopSignals, TrainingStopped
from ..workload.components import Workload
from ..workload.losses import batch_loss, model_inputs
from ..workload.metrics import improves
from .evaluation import evaluate, format_results
from .setup import Run, setup, stream_position
from .summary import finish


def run(cfg: TrainConfig, job: Workload, group: Group | None = None) -> dict:
    """The training loop, on the objects of `job`: the model, the data, the loss and the metrics (`group`: the
    processes, when the caller has started them)."""
    ready(cfg, job)  # --tokenizer loaded, --prompts checked: before anything is written
    r = setup(cfg, job, group)
    state = r.state
    where = lambda: (f"epoch {r.epoch + 1}, after optimizer step {state.step}, process "
                     f"{r.accelerator.process_index} of {r.world}")
    try:
        with _watched(r):  # the steps, and the final save and every collective after the last step
            with r.output.progress, StopSignals(r.accelerator) as signals, \
                    r.output.files.plots_if_stopped(cfg.plots), _naming_the_step(where):
                for epoch in epochs_left(r):
                    r.epoch = epoch
                    if not _epoch_trained(r, epoch):  # else: resumed before this epoch's evaluation
                        with stream_faults(lambda e: _stream_stop(r, e, "training")):
                            train_epoch(r, signals)
                    # Evaluate after every epoch (with --eval-every, every N steps instead), and after the last step.
                    since = time.perf_counter()
                    if _evaluation_due(r):
                        evaluate_now(r)
                    if r.streaming and state.stream.get("ended"):  # evaluated: a checkpoint now starts the next epoch
                        state.stream = stream_position(epoch + 1, state.step, state.stream["epoch_steps"])
                    if cfg.checkpoint_epochs or (r.shape.checkpoint_steps and state.step % r.shape.checkpoint_steps == 0):
                        save_checkpoint(r)
                    r.clock.exclude(since)  # evaluation is not training time
                    stop_if_signalled(r, signals)
                    if state.stopped_early:  # --early-stop: decided alike on every process (keep_evaluation)
                        break
            with r.watch.slow("final weights"):  # a process stopped while they are saved is named too
                return finish(r)
    except BaseException:
        _trackers_finished(r.accelerator)
        raise
    finally:
        try:
            workers_stopped(r.loaders.train, r.loaders.eval)
        finally:  # the folder's lock let go whatever ending the workers met
            r.output.files.release()


def _evaluation_due(r: Run) -> bool:
    """Whether the end of an epoch (or of the run) at this step is evaluated: always, unless --eval-every N
    evaluates only at multiples of N (and after the last step)."""
    step = r.state.step
    return not r.cfg.eval_every or step % r.cfg.eval_every == 0 or step == r.shape.total_steps


def evaluate_now(r: Run) -> None:
    """Evaluates the model (the EMA's, with --ema) at this step and keeps the result (keep_evaluation); once a
    step: an early stop at an --eval-every evaluation ends the epoch at that step, which is evaluated."""
    trained = r.trained
    if r.loaders.eval is None or (r.state.evals and r.state.evals[-1]["step"] == r.state.step):
        return
    with stream_faults(lambda e: _stream_stop(r, e, "evaluation")):
        results = evaluate(r.accelerator, trained.ema.module if trained.ema else trained.model, r.loaders.eval,
                           r.scoring.eval_loss_fn, r.scoring.metrics, r.cfg.channels_last, trained.input_dtype,
                           guarded=r.job.data.kind.eval.guarded, forward_fn=r.job.forward,
                           tables=r.scoring.checked.tables, watch=r.watch)
    keep_evaluation(r, results)
    write_samples(r)  # --prompts: generated by the main process


def _trackers_finished(accelerator) -> None:
    """A run that ends early (a signal, a NaN, bad input met mid-run, a full disk, a bug) still finishes its
    trackers: their last events are written and their runs marked finished (a process of several may end without
    the interpreter's teardown, where wandb and MLflow would finish theirs). Not `end_training`, which would also
    dissolve the process group that the error's own path still uses."""
    for tracker in accelerator.trackers:
        with contextlib.suppress(Exception):  # the run's own error is the one to report
            tracker.finish()


def epochs_left(r: Run):
    """The epochs to train, from the checkpoint's when resuming: a checkpoint at the very end after the final
    evaluation leaves none; one between an epoch's last step and its evaluation (the evaluation failed)
    resumes into that epoch, to evaluate it. A stream's epoch ends where the stream ends; with --max-steps
    and a stream of unknown length, epochs follow each other until the last step."""
    state = r.state
    finished = r.shape.total_steps is not None and state.step >= r.shape.total_steps
    evaluated = (r.loaders.eval is None or bool(state.evals) and state.evals[-1]["step"] == state.step
                 or not _evaluation_due(r))  # --eval-every: an epoch's end that calls for none
    if state.stopped_early or (finished and evaluated):
        return
    if r.streaming:
        epoch = state.stream["epoch"]
    elif state.step and (finished or state.step % r.shape.per_epoch == 0) and not evaluated:
        epoch = (state.step - 1) // r.shape.per_epoch  # its steps are done, its evaluation is not (it failed)
    else:
        epoch = state.step // r.shape.per_epoch
    while r.shape.epochs is None or epoch < r.shape.epochs:
        yield epoch
        if state.stopped_early or (r.shape.total_steps is not None and state.step >= r.shape.total_steps):
            return
        epoch += 1


def _epoch_trained(r: Run, epoch: int) -> bool:
    """Whether the steps of `epoch` are all made: resumed from a checkpoint between its last step and its
    evaluation (a stream's end is marked in its position, see _stream_ended)."""
    if r.shape.total_steps is not None and r.state.step >= r.shape.total_steps:
        return True
    return bool(r.state.stream.get("ended")) if r.streaming else r.state.step >= (epoch + 1) * r.shape.per_epoch


def _stream_stop(r: Run, error, split: str) -> str:
    """A stream that cannot be read stops every process at the same step (its loader agrees on it), after a
    checkpoint of the last whole step: what to say."""
    r.trained.optimizer.zero_grad()
    _checkpoint_this_step(r)
    return (f"{error}, at step {r.state.step + (split == 'training')}; checkpoint saved in {r.output.checkpoints.last}; "
            f"continue with --resume auto --output-dir {r.output.folder} once it can be read")


def train_epoch(r: Run, signals: StopSignals) -> None:
    """The optimizer steps of epoch `r.epoch` (what is left of it, when resuming mid-epoch)."""
    cfg, accelerator, state, clock = r.cfg, r.accelerator, r.state, r.clock
    model, optimizer, input_dtype = r.trained.model, r.trained.optimizer, r.trained.input_dtype
    loss_fn, forward_fn, checked = r.scoring.loss_fn, r.job.forward, r.scoring.checked
    items, item_scale = checked.items, checked.item_scale
    guarded, channels_last = r.job.data.kind.train.guarded, cfg.channels_last
    _training_mode(r)
    batches = r.job.objective.rollouts(r, _epoch_batches(r))  # GRPO: the step's completions generated first
    clock.paused(forget=True)  # the epoch's start (after an evaluation) is not waiting for data
    watch = r.watch
    watch.at("data")
    for batch in batches:
        watch.at("compute")
        clock.batch_arrived()
        if guarded:  # (batch, indices of the samples that could not be read, else -1)
            batch, indices = batch
            state.unreadable_now += [i for i in indices if i >= 0]  # plain ints: no device sync
        batch = model_inputs(batch, channels_last, input_dtype)
        with accelerator.accumulate(model):
            _, _, loss = batch_loss(model, batch, loss_fn, forward_fn)
            if loss is None:
                raise ValueError("the model returned no loss in training (its outputs carry none)")
            # A sum over items is scaled to about a mean's size here; normalise_gradients divides by the count.
            accelerator.backward(loss.value / item_scale if items else loss.value)
            state.losses.add(loss)  # on the device; read back only at log steps and checkpoints
            if accelerator.sync_gradients:
                optimizer_step(r, guarded)
            optimizer.zero_grad()
        clock.batch_done()
        if not accelerator.sync_gradients:
            watch.at("data")
            continue
        state.step += 1
        watch.at("compute", state.step)
        r.output.progress.step()
        if r.streaming and r.loaders.train.resumed and r.shape.start_step == state.step - 1:
            _resumed_stream(r)
        if state.step % cfg.log_every == 0 or state.step == r.shape.total_steps:
            log_interval(r)
        # At an epoch's last step, checkpoints and stops wait for that epoch's evaluation (a stream's last step
        # is known only once it ends: a checkpoint there resumes into the evaluation).
        if state.step == r.shape.total_steps or (not r.streaming and state.step % r.shape.per_epoch == 0):
            return
        if cfg.eval_every and state.step % cfg.eval_every == 0:  # before the checkpoint, which then holds it
            since = time.perf_counter()
            evaluate_now(r)
            clock.exclude(since)  # evaluation is not training time
            _training_mode(r)
            if state.stopped_early:  # --early-stop: the run ends at this step (run evaluates no more)
                return
        if r.shape.checkpoint_steps and state.step % r.shape.checkpoint_steps == 0:
            save_checkpoint(r)
            clock.gaps.forget()
        stop_if_signalled(r, signals, check=state.step % cfg.log_every == 0)
        clock.paused()  # logging and checkpoints are not the host's wait for data (Clock forgets the device's gap)
        watch.at("data")
    if r.streaming:
        _stream_ended(r)


def _epoch_batches(r: Run):
    """The micro-batches of epoch `r.epoch` left to train, and the progress bar at that epoch."""
    state = r.state
    if r.streaming:  # read from the stream's position (the loader moves it on as it hands out each step)
        r.output.progress.new_epoch(r.epoch, done=state.step - state.stream["start"], first_step=state.stream["start"])
        batches = r.loaders.train.epoch(r.epoch, state.stream)
    else:
        r.output.progress.new_epoch(r.epoch, done=state.step - r.epoch * r.shape.per_epoch)
        # The epoch seeds the shuffle; a resumed epoch skips the micro-batches it has already seen.
        seen = _loader_steps(r, state.step - r.epoch * r.shape.per_epoch) * r.cfg.grad_accum
        batches = r.accelerator.skip_first_batches(r.loaders.train, seen) if seen else r.loaders.train
        batches.set_epoch(r.epoch)
        # On a GPU, batches made on the device go on a side stream, beside the step before theirs.
        batches = overlapped(batches, r.loaders.train.dataset, r.accelerator.device)
    if r.loaders.augment:
        r.loaders.augment.set_epoch(r.epoch)  # and each sample's augmentation, whatever process or batch reads it
    return batches


def _loader_steps(r: Run, steps: int) -> int:
    """The loader's steps behind `steps` optimizer steps: one each, or one per --num-iterations (GRPO)."""
    return steps // r.job.objective.iterations  # a resume inside a generation is refused at setup


def _training_mode(r: Run) -> None:
    r.trained.model.train()
    if _frozen_now(r):
        for norm in r.trained.tuning.frozen_norms:
            norm.eval()  # their running statistics stay as they are


def _stream_ended(r: Run) -> None:
    """The stream's epoch is over: its length is learnt from the first (the run's length then known). The
    position stays at the epoch's end (`ended`) until the epoch's evaluation is done (run), so that a
    checkpoint before it (the evaluation stream failed, say) resumes into that evaluation."""
    state, position, shape = r.state, r.state.stream, r.shape
    steps = state.step - position["start"]
    if shape.per_epoch is None:
        shape.learn(steps)
        position["epoch_steps"] = steps
        r.output.progress.learnt(shape.total_steps, shape.per_epoch, shape.epochs)
    elif steps != shape.per_epoch:
        r.output.progress.print(f"note: epoch {r.epoch + 1} of the stream had {steps} steps, the first {shape.per_epoch}")
    position["ended"] = True


def _resumed_stream(r: Run) -> None:
    """How long the resumed stream took to reach its position, said once and kept for the summary."""
    how = r.loaders.train.resumed
    r.stream_resume = how
    r.output.progress.print(f"stream resumed at sample {how['samples']:,} of epoch {r.epoch + 1}: "
                     + ("loaded its saved position" if how["how"] == "saved state" else "read again from the epoch's start")
                     + f" in {how['seconds']:.2f} s")


def optimizer_step(r: Run, guarded: bool) -> None:
    """The update at the end of an accumulation: skipped for a step with unreadable samples (with
    --skip-bad-samples) or a NaN/inf loss (with --skip-nonfinite), else clip, step, schedule, EMA."""
    cfg, accelerator, state = r.cfg, r.accelerator, r.state
    bad = unreadable_everywhere(accelerator, state.unreadable_now) if guarded else []
    state.unreadable_now = []
    if bad and not cfg.skip_bad_samples:
        raise_unreadable(r, bad, "training", state.step + 1)
    if bad:
        state.unreadable_samples += [sample_name(r.job.data.train, i) for i in bad]
        state.bad_sample_steps += 1  # no update from a batch with stand-ins for unreadable samples
    elif cfg.skip_nonfinite and state.losses.last_step_nonfinite(accelerator):
        state.skipped_steps += 1  # no update from this step's gradients
    else:
        if _frozen_now(r):  # --freeze until --unfreeze-at: no update (the optimizer skips parameters without one)
            for p in r.trained.tuning.frozen:
                p.grad = None
        if r.scoring.checked.items:
            normalise_gradients(r)
        if cfg.max_grad_norm:
            accelerator.clip_grad_norm_(r.trained.model.parameters(), cfg.max_grad_norm)
        r.trained.optimizer.step()
        r.trained.scheduler.step()
        if r.trained.ema:
            r.trained.ema.update_parameters(r.trained.averaged)
        # fp16: the grad scaler skips a step whose gradients overflowed (no host sync: a flag)
        state.loss_scale_skipped_steps += accelerator.optimizer_step_was_skipped


def _frozen_now(r: Run) -> bool:
    return bool(r.trained.tuning.frozen) and (r.cfg.unfreeze_at is None or r.epoch + 1 < r.cfg.unfreeze_at)


def normalise_gradients(r: Run) -> None:
    """For a loss summed over items (tokens, boxes): the gradient of the sum over the whole global batch
    divided by its number of items, whatever the processes and micro-batches it was split into.

    Each micro-batch's backward took sum / item_scale, Accelerate divided it by grad_accum, and DDP
    averaged over the processes; so the gradients are multiplied by item_scale x processes x grad_accum
    / (the items of every process's micro-batches of this step): one all-reduce of one number, and no
    host sync (the factor stays on the device)."""
    accelerator = r.accelerator
    items = r.state.losses.step_items().to(torch.float32)
    total = accelerator.reduce(items, "sum") if r.world > 1 else items
    factor = r.scoring.checked.item_scale * r.world * r.cfg.grad_accum / total.clamp(min=1)
    grads = [p.grad for p in r.trained.model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor.to(grads[0].device))


def log_interval(r: Run) -> None:
    """The loss over the interval on every process (a mean over micro-batches, or over every item), with speed."""
    cfg, state = r.cfg, r.state
    interval = state.losses.read(r.accelerator)
    if interval.bad is not None and not cfg.skip_nonfinite:
        raise TrainingStopped(_nonfinite_message(interval.bad, r.output.checkpoints.last), code=1)
    elapsed, steps, waited = r.clock.interval(state.step)
    record = {
        "step": state.step,
        "epoch": r.epoch + 1,
        "loss": interval.loss,
        **interval.parts,  # a model's named losses (loss_classifier, loss_box_reg, ...)
        "loss_per_rank": interval.per_rank,
        "lr": r.trained.scheduler.get_last_lr()[0],
        "samples_per_s": steps * cfg.batch_size / elapsed,
        "step_time_s": elapsed / steps,
        "data_time_s": waited / steps,
        "flops_per_s": r.trained.flops * steps * cfg.batch_size / elapsed if r.trained.flops else None,
    }
    figures = r.job.objective.read_figures(r.accelerator)  # GRPO: rewards, completion lengths, KL, clipping, entropy
    record.update(figures)
    r.output.files.log(record)
    if cfg.log_with:
        r.accelerator.log({"train/loss": record["loss"], **{f"train/{k}": v for k, v in {**interval.parts, **figures}.items()},
                           "train/lr": record["lr"], "train/samples_per_s": record["samples_per_s"]}, step=state.step)
    r.output.progress.log(state.step, r.epoch, record["loss"], record["lr"], record["samples_per_s"], figures.get("reward"))
    state.losses.restart(state.step)
    r.clock.restart()


def save_checkpoint(r: Run, name: str | None = None) -> None:
    """Everything needed to continue: `save_state`'s files and the run's state (all processes call this)."""
    bad = r.state.losses.read(r.accelerator).bad
    if bad is not None and not r.cfg.skip_nonfinite:  # never checkpoint weights a NaN/inf has reached
        raise TrainingStopped(_nonfinite_message(bad, r.output.checkpoints.last), code=1)
    saved = {**r.state.saved(r.accelerator), "world_size": r.world, "engine": r.engine.name,
             "parameters": r.trained.parameters, "frozen": r.trained.frozen, "config": r.cfg.to_dict()}
    with r.watch.slow("checkpoint"), r.output.checkpoints.writing(saved, name) as folder:
        partly = bool(r.trained.frozen) and name != BEST  # the frozen base left out (the best stays a whole model)
        r.engine.save_checkpoint(r.accelerator, folder, partly)
        module = r.accelerator.unwrap_model(r.trained.model, keep_torch_compile=False)
        adapter = gathered_state(module)  # a sharded model's adapter, gathered by every process
        if r.accelerator.is_main_process:  # a transformers model's config.json: it loads with from_pretrained too
            config_files(module, folder, whole=not r.trained.frozen or name == BEST, adapter=adapter,
                         apart=r.engine.shards)
            tokenizer_files(r.job.tokenizer, folder)


def stop_if_signalled(r: Run, signals: StopSignals, check: bool = True) -> None:
    """A SIGTERM/SIGINT on any process stops every process, after a checkpoint of this step."""
    stop = signals.agreed(check)  # the same answer on every process
    if not stop:
        return
    _checkpoint_this_step(r)
    raise TrainingStopped(
        f"stopped by {signal.Signals(stop).name} at step {r.state.step}; checkpoint saved in {r.output.checkpoints.last}; "
        f"continue with --resume auto --output-dir {r.output.folder}", code=128 + stop)


def raise_unreadable(r: Run, indices: list[int], split: str, at: int) -> None:
    """A sample that cannot be read stops every process (they all agree on it), after a checkpoint."""
    r.trained.optimizer.zero_grad()
    _checkpoint_this_step(r)
    dataset = r.job.data.train if split == "training" else r.job.data.eval
    more = f" (and {len(indices) - 1} more)" if len(indices) > 1 else ""
    raise TrainingStopped(f"{split} sample {sample_name(dataset, indices[0])}{more} cannot be read, at step {at}; "
                          f"checkpoint saved in {r.output.checkpoints.last}; acc-trainer check-data lists every such sample"
                          + ("; --skip-bad-samples skips them" if split == "training" else ""), code=1)


def _checkpoint_this_step(r: Run) -> None:
    if r.output.checkpoints.last is None or r.output.checkpoints.last.name != f"step-{r.state.step:08d}":
        save_checkpoint(r)


def keep_evaluation(r: Run, results: dict) -> None:
    """Logs an evaluation, keeps it in the state, checkpoints the best one (--save-best) and hands it to fit's
    `on_evaluation`."""
    cfg, state, epoch = r.cfg, r.state, r.epoch
    unreadable = results.pop("unreadable", [])
    if unreadable:  # an evaluation counts every sample: never skipped
        raise_unreadable(r, unreadable, "evaluation", state.step)
    r.tables = results.pop("tables", {})
    if "loss" in results and not math.isfinite(results["loss"]):  # every process has the same all-reduced loss
        _checkpoint_this_step(r)
        raise TrainingStopped(f"the evaluation at step {state.step} gave a {results['loss']} loss (a NaN or inf in the "
                              "evaluation set, or in the model's outputs on it); stopped all processes, checkpoint saved "
                              f"in {r.output.checkpoints.last}", code=1)
    state.evals.append({"step": state.step, "epoch": epoch + 1, **results})
    r.output.files.log({"step": state.step, "epoch": epoch + 1, **{f"eval_{k}": v for k, v in results.items()}})
    if cfg.log_with:
        r.accelerator.log({f"eval/{k}": v for k, v in results.items() if k != "samples"}, step=state.step)
    r.output.progress.print(f"epoch {epoch + 1}/{r.shape.epochs or '?'}: " + format_results(results))
    for flag, name in (("--save-best", cfg.save_best), ("--early-stop", cfg.early_stop)):
        if name is not None and name not in results:
            raise ConfigError(f"{flag} {name}: the evaluation has no such result (it has {', '.join(results)})")
    if cfg.early_stop:  # decided first, so that a best checkpoint holds the decision too
        _early_stop(r, results[cfg.early_stop])
    if cfg.save_best and improves(cfg.save_best, results[cfg.save_best], state.best["value"] if state.best else None):
        state.best = {"step": state.step, "metric": cfg.save_best, "value": results[cfg.save_best]}
        save_checkpoint(r, BEST)
    if r.job.on_evaluation:  # fit's callback, last: an exception it raises (optuna.TrialPruned) ends the run
        r.job.on_evaluation(dict(state.evals[-1]))


def _early_stop(r: Run, value: float) -> None:
    """--early-stop: counts the evaluations since the metric last improved by more than --min-delta; at
    --patience the run stops, on every process at once (the results are the same everywhere, and the
    decision is all-reduced anyway). The counts are part of the state, so a resumed run stops where the
    uninterrupted one does."""
    cfg, state = r.cfg, r.state
    if improves(cfg.early_stop, value, state.early_best, cfg.min_delta):  # NaN (AUROC without a class) never does
        state.early_best, state.stale_evals = value, 0
    else:
        state.stale_evals += 1
    stop = state.stale_evals >= cfg.patience
    if r.world > 1:  # no process stops alone
        stop = bool(r.accelerator.reduce(torch.tensor(float(stop), device=r.accelerator.device), "sum").item())
    if stop:
        state.stopped_early = {"step": state.step, "epoch": r.epoch + 1, "metric": cfg.early_stop,
                               "best": state.early_best, "patience": cfg.patience,
                               "reason": f"{cfg.early_stop} did not improve by more than {cfg.min_delta} for "
                                         f"{cfg.patience} evaluations (best {state.early_best:.6g})"}
        r.output.progress.print(f"early stop at step {state.step}: {state.stopped_early['reason']}")


@contextmanager
def _watched(r: Run):
    """The watchdog of this process (watchdog.py) while the loop runs and the final weights are saved; --hang-timeout 0
    leaves it out."""
    if r.cfg.hang_timeout == 0:
        yield
        return
    last = r.output.checkpoints
    hint = lambda: (f"continue from {last.last} with --resume auto --output-dir {r.output.folder}" if last.last else
                    "no checkpoint was saved")
    with Watchdog(r.output.folder, r.accelerator.process_index, r.world, r.cfg.hang_timeout, hint) as r.watch:
        yield


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
