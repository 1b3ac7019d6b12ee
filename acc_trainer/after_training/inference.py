"""The model after training: evaluate it on any set, and predict, exactly, on any number of processes.

    acc-trainer evaluate RUN_DIR [options] [--weights FILE] [--output FILE.json]
    acc-trainer predict RUN_DIR --output FILE.jsonl|.csv|.npz [options] [--weights FILE] [--split eval|train]
    acc_trainer.evaluate(model, dataset, metrics=..., batch_size=...)
    acc_trainer.predict(model, dataset, output=None, batch_size=...)

From a run folder, the model and data are rebuilt from its `config.yaml` (options given override it: another
`--dataset`, `--data-dir`, `--eval-batch-size`), and its `model.safetensors` (or `--weights`) is loaded:
never an evaluation of random weights. Both go through the training run's own evaluation path
(evaluation.py): the Accelerator built the same way, the set in its order, each global batch split between
the processes by Accelerate, the padding of the last batch left out (`real_batches` counts the real
samples with `gather_for_metrics`; predictions of every process are joined in order by `everyones`).
Predictions are written by the main process as the batches arrive.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import PartialState

from .. import objectives
from ..config import ConfigError, TrainConfig, first_line
from ..data.datasets import Data
from ..data.faults import stream_faults, unreadable_everywhere
from ..data.kinds import settle
from ..data.loaders import evaluation_loader, placed, stream_evaluation
from ..distributed import processes
from ..language import adapters
from ..language.generation import check_generates, generated_rows
from ..outputs import checkpoints
from ..outputs.checkpoints import damage, unverified
from ..stopping import TrainingStopped
from ..training import evaluation
from ..training.evaluation import everyones, format_results, real_batches
from ..training.setup import accelerator_for, training_loss
from ..workload import components, quantized
from ..workload.first_batch import check_fit
from ..workload.losses import IGNORE_INDEX, count_tokens, forward, own_items, own_loss, predictions
from ..workload.models import accelerate_marks_undone
from .prediction_files import Writer, check_replaceable, check_rows

FORMATS = (".jsonl", ".csv", ".npz")


# ----------------------------------------------------------------------------------------- Python


def evaluate(model_or_run, /, dataset=None, *, model=None, data=None, weights=None, loss=None, metrics=None,
             collate_fn=None, forward=None, tokenizer=None, config: TrainConfig | None = None, rewards=None,
             **options) -> dict:
    """`model` (with its weights loaded) evaluated on `dataset`, exactly, on every process of a launch:
    the loss and every metric over the whole set (metrics as for `fit`; metrics with state computed once),
    `samples`, and for classification the confusion matrix and per-class table under `tables`.

    `evaluate(RUN_DIR, model=..., data=...)`: a finished run's weights (RUN_DIR/model.safetensors, or `weights`,
    verified against the run's digests) loaded into `model`, as built before training, with the run's options
    (config.yaml) under `config` and `options`; how to evaluate a run that `fit()` made from objects (give its
    `loss` and `metrics` again: config.yaml names only those given by name). `weights` with a model object: loaded
    into it first. Text data (chat, prompt/completion, preference pairs) is tokenized as the run did, with
    `tokenizer` (an object, or what --tokenizer takes; default: the run folder's). A GRPO run's reward functions:
    `rewards` (callables, as fit() took them; import paths are in config.yaml)."""
    from ..training.api import fit_config

    given = _given(model_or_run, dataset, model, data, weights, config, "evaluate", options.get("accept_unverified", False))
    model, dataset = given.model, given.dataset
    cfg = fit_config(model, dataset, given.config, {"plots": False, **options}, collate_fn, forward)
    # The run's own loss and metrics (config.yaml names those given by name) unless others are given: its perplexity,
    # its F1, as the run evaluated them.
    job = components.from_objects(model, dataset, None, loss if loss is not None else cfg.loss,
                                  metrics if metrics is not None else cfg.metrics, collate_fn or cfg.collate,
                                  forward or cfg.forward, cfg.pack, cfg.data_pipeline, cfg,
                                  _tokenizer_of(model_or_run, tokenizer))
    job.objective = objectives.of(cfg, rewards) if rewards is not None else None
    ready(cfg, job, given.weights)
    with _mode_kept(job.model):
        return _evaluate(cfg, job, job.data.train)  # packed as the run's sets were (--pack)


def predict(model_or_run, /, dataset=None, *, model=None, data=None, weights=None,
            output: str | os.PathLike | None = None, collate_fn=None, forward=None, generate: bool = False,
            tokenizer=None, config: TrainConfig | None = None, rewards=None, **options) -> list[dict] | Path:
    """The model's predictions for every sample of `dataset`, in its order, one row per sample with its
    `index` (and `class`, the highest score, for class scores; `loss`, `perplexity` and `tokens` for a language
    model given labels). Written to `output` (.jsonl, .csv or .npz) as the batches arrive, by the main process,
    which returns its path; without `output`, the rows (every process gets them all). `predict(RUN_DIR, model=...,
    data=...)`: a finished run's, as `evaluate`. `generate`: each input's `prompt` and the `text` generated after it
    (greedy, `max_new_tokens`), with `tokenizer` (an object, or what --tokenizer takes; default: the run folder's);
    `rewards`: as `evaluate`'s."""
    from ..training.api import fit_config

    given = _given(model_or_run, dataset, model, data, weights, config, "predict", options.get("accept_unverified", False))
    model, dataset = given.model, given.dataset
    cfg = fit_config(model, dataset, given.config, {"plots": False, **options}, collate_fn, forward)
    job = components.from_objects(model, dataset, None, None, {}, collate_fn or cfg.collate, forward or cfg.forward,
                                  cfg.pack, cfg.data_pipeline, cfg, _tokenizer_of(model_or_run, tokenizer))
    job.objective = objectives.of(cfg, rewards) if rewards is not None else None
    ready(cfg, job, given.weights)
    if output is not None:
        check_replaceable(Path(output))
    with _mode_kept(job.model):  # a row per block with --pack
        return _predict(cfg, job, job.data.train, Path(output) if output else None, generate=generate)[0]


@contextmanager
def _mode_kept(model):
    """The caller's model is left as it was given: in its mode (training or evaluation), and without what
    Accelerate's `prepare` set on it (models.accelerate_marks_undone)."""
    training = model.training
    try:
        with accelerate_marks_undone(model):
            yield
    finally:
        model.train(training)


@dataclass
class Given:
    """What `evaluate`/`predict`/`export` were given: the model, the data, the run's config, and for a run folder the
    run's weights, not loaded yet (`ready` loads them, after what the run's objective takes from the model as built)."""

    model: Any
    dataset: Any
    config: TrainConfig | None
    weights: Path | None = None


def _given(model_or_run, dataset, model, data, weights, config: TrainConfig | None, command: str,
           accept: bool = False) -> Given:
    """What `evaluate`/`predict` were given: a model and a dataset, or a run folder with the model (as built before
    training) and the data; `accept`: --accept-unverified."""
    if dataset is not None and data is not None:
        raise ConfigError(f"{command}: give the data once (second, or as data=)")
    if not isinstance(model_or_run, (str, os.PathLike)):
        if model is not None:
            raise ConfigError(f"{command}: give the model once (first, or as model= after a run folder)")
        if weights is not None:
            _load_weights(model_or_run, _verified(Path(weights), "weights=", accept), type(model_or_run).__name__)
        return Given(model_or_run, dataset if dataset is not None else data, config)
    run = Path(model_or_run)
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"{command}: {run} holds no config.yaml: not the folder of an acc_trainer run")
    if model is None or (dataset if dataset is not None else data) is None:
        raise ConfigError(f"{command}({str(run)!r}, model=..., data=...): give the model as it was built before "
                          "training (the run's weights are loaded into it) and the data to use")
    if config is None:
        from ..flags import parse_config

        say_note(unverified(f"run folder {run} (config.yaml)", damage(run, ["config.yaml"]), accept))
        config = parse_config(["--config", str(run / "config.yaml")])
    weights = _verified(Path(weights) if weights is not None else run / weights_name(config), "weights=", accept)
    return Given(model, dataset if dataset is not None else data, config, weights)


def ready(cfg: TrainConfig, job: components.Workload, weights: Path | None, name: str | None = None) -> None:
    """`job` as the run had it: --objective dpo's forward, loss and collate, its reference made from the model as built
    (a frozen copy of the starting weights, before the run's) or, once they are in, the model with its adapters
    off; `weights` (a run's, None: in the model already) loaded into `job.model` (`name`: the model's, in errors;
    default its class)."""
    job.objective = job.objective or objectives.of(cfg)
    job.objective.shape(cfg, job)
    mode = job.objective.reference.mode if job.objective.reference is not None else None
    if mode == "copy":  # a frozen copy of the starting weights (LoRA's too: its new adapters added nothing yet)
        if weights is None:
            raise ConfigError(f"--objective {cfg.objective} compares the model with the run's starting weights: give "
                              "the run folder (evaluate(RUN_DIR, model=..., data=...)), whose model as built is the "
                              "reference")
        if cfg.init_from:
            checkpoints.initial_weights(job.model, cfg.init_from, cfg.init_strict)
        job.objective.start(job.model)
    if weights is not None:
        job.model = _trained(job.model, weights, cfg, name)
    if mode != "copy":  # the run's model with its adapters switched off, or no reference
        job.objective.start(job.model)


def _verified(weights: Path, give: str, accept: bool = False) -> Path:
    """`weights`, once they exist and match the digest written with them in their folder's SHA256SUMS; `give`: how to
    name other weights; `accept`: --accept-unverified (weights without a digest are read, saying so)."""
    if not weights.is_file():
        raise ConfigError(f"{weights} does not exist (a run writes model.safetensors when it finishes); give {give}"
                          f"{'' if give.endswith('=') else ' '}FILE: never an evaluation of random weights")
    say_note(unverified(f"the weights {weights}", damage(weights.parent, [weights.name]), accept, "are"))
    return weights


def say_note(note: str | None) -> None:
    """A note on reading something unchecked, on the main process's stderr."""
    if note and PartialState().is_main_process:
        print(f"acc-trainer: {note}", file=sys.stderr)


def weights_name(cfg: TrainConfig) -> str:
    """What a run folder holds its trained weights in: the adapter of a LoRA run, else the whole model."""
    return "adapter_model.safetensors" if cfg.lora else "model.safetensors"


def _trained(model, weights: Path, cfg: TrainConfig, name: str | None = None):
    """`model`, built as the run built it before training, with the run's `weights`: a LoRA run's adapter goes on
    the base weights the run started from (--init-from read again)."""
    if not cfg.lora:
        _load_weights(model, weights, name or type(model).__name__)
        return model
    if cfg.init_from and not quantized.is_4bit(model):  # a 4-bit base holds --init-from's weights (quantized.load)
        checkpoints.initial_weights(model, cfg.init_from, cfg.init_strict)
    return adapters.load_adapter(model, weights.parent)


def _load_weights(model, weights: Path, name: str) -> None:
    """`weights` (verified: `_verified`) into `model`, every tensor. A tied tensor (a causal LM's output layer, tied to
    its embedding) may be in the file once, under either name (safetensors writes it once), or under both (FSDP's
    gathered weights): either fills the parameter."""
    try:
        if weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(weights))
        else:
            state = torch.load(weights, weights_only=True, map_location="cpu")
        missing, unexpected = model.load_state_dict(state, strict=False)
    except Exception as e:  # noqa: BLE001 - a file that is not these weights is the user's input
        raise ConfigError(f"the weights {weights} do not load into {name}: {type(e).__name__}: {first_line(e)}") from None
    names = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(key)
    tied = {key: group for group in names.values() for key in group}
    missing = [k for k in missing if not any(other in state for other in tied.get(k, []))]
    if missing or unexpected:
        problem = f"{len(missing)} missing (e.g. {missing[0]})" if missing else f"{len(unexpected)} unexpected (e.g. " \
                                                                                f"{unexpected[0]})"
        raise ConfigError(f"the weights {weights} do not load into {name}: {problem} of its tensors")


# ----------------------------------------------------------------------------------------- the pieces


def _prepared(cfg: TrainConfig, job: components.Workload, dataset, group: processes.Group | None = None) -> tuple:
    """The Accelerator (as a training run builds it: setup.accelerator_for) and the prepared model and loader;
    the caller has checked the first samples (first_batch.check_fit)."""
    group = group or processes.start(cfg)
    accelerator = accelerator_for(cfg, group)
    world = accelerator.num_processes
    per_process = cfg.eval_batch_size or max(1, cfg.batch_size // (world * cfg.grad_accum))
    kind = job.data.kind.train  # the set evaluated is the workload's only one
    if kind.stream:  # its own loader (streams.py), which already holds this process's share
        loader = stream_evaluation(cfg, dataset, per_process * world, world, accelerator.process_index, job.collate,
                                   accelerator.device, processes.summing(accelerator), job.dataset_name, job.data.heads)
    else:  # served as a training run serves its evaluation set, from the CPU (the model may need the device's memory)
        loader = evaluation_loader(placed(dataset, kind, torch.device("cpu")), kind, per_process * world, cfg.seed,
                                   collate=job.collate)
    job.data.heads.clear()  # the first samples read for the checks at start
    model, loader = accelerator.prepare(job.model, loader)
    if job.objective is not None and job.objective.reference is not None:  # under the run's mixed precision
        job.objective.reference.autocast = accelerator.autocast
    return accelerator, model, loader


def _evaluate(cfg: TrainConfig, job: components.Workload, dataset, group: processes.Group | None = None) -> dict:
    checked = check_fit(job)
    accelerator, model, loader = _prepared(cfg, job, dataset, group)
    loss = training_loss(cfg, checked) if checked.eval_loss else None  # as the run evaluated (--label-smoothing)
    with stream_faults(str):
        results = evaluation.evaluate(accelerator, model, loader, loss, checked.metrics, guarded=job.data.kind.train.guarded,
                                      forward_fn=job.forward, tables=checked.tables)
    if results.pop("unreadable", None):
        raise ConfigError("some samples cannot be read; acc-trainer check-data lists them")
    return results


def _predict(cfg: TrainConfig, job: components.Workload, dataset, output: Path | None,
             group: processes.Group | None = None, generate: bool = False) -> tuple:
    """(OUTPUT, or the rows without one; the number of rows). `generate`: each input's generated text (generation.py)
    instead of the model's outputs."""
    kind = job.data.kind.train
    size = kind.length
    if size is None and output is not None and output.suffix == ".npz":
        raise ConfigError(f"predict: .npz arrays are made at the stream's size, and {job.dataset_name} does not say it "
                          "(no __len__); write .jsonl or .csv")
    if generate:  # prompts to continue: no labels, no loss (the first-sample check is the training path's)
        check_generates(job.model, job.tokenizer, "predict --generate", "--tokenizer (the run folder holds none)")
    else:
        check_fit(job)  # one line for data that does not fit the model
    accelerator, model, loader = _prepared(cfg, job, dataset, group)
    model.eval()
    writer = Writer(output, size) if accelerator.is_main_process else None
    rows, index, unreadable = [], 0, []
    # A signal stops every process at the same batch (the largest signal number any process got, agreed before
    # each batch), never one process alone in the middle of the batch's gathers.
    agree = (lambda n: n) if accelerator.num_processes == 1 else \
        (lambda n: int(accelerator.gather(torch.tensor([n], device=accelerator.device)).max()))
    try:
        shown = accelerator.is_main_process and output is not None
        with _stopped_by_signals(output) as stop_if_asked, stream_faults(str), torch.no_grad(), \
                _progress(shown, None if kind.stream else len(loader)) as advance:
            for batch, real, bad in real_batches(accelerator, loader, kind.guarded):
                stop_if_asked(agree)
                unreadable += bad
                values, columns = _batch_values(job, model, batch, cfg.max_new_tokens if generate else None)
                # every process's real outputs, in process order: the global batch's, in the dataset's order
                even = not kind.stream and not accelerator.gradient_state.end_of_dataloader
                batch_rows = _rows(everyones(accelerator, values, real, even), index, columns)
                if output is not None and index == 0:
                    check_rows(batch_rows, output)  # on every process: none is left waiting for the main one
                index += len(batch_rows)
                if writer:
                    writer.write(batch_rows)
                if output is None:
                    rows += batch_rows
                advance()
            stop_if_asked(agree)  # a signal during the last batch
        if unreadable_everywhere(accelerator, unreadable):
            raise ConfigError("predict: some samples cannot be read (their rows would be another sample's); "
                              "acc-trainer check-data lists them")
        if writer:
            writer.close()
    finally:
        if writer:
            writer.discard()  # what is left of an unfinished file
    accelerator.wait_for_everyone()
    return (output if output is not None else rows), index


@contextmanager
def _stopped_by_signals(output: Path | None):
    """SIGTERM or SIGINT while predicting ends it with one line and exit 128 + the signal, after the unfinished
    file's folder is removed (`_predict`'s finally): the signal's default would end the process before it.
    Yields `stop_if_asked(agree)`, which the loop calls before each batch with a function that turns this
    process's signal number (0: none) into every process's: the handler only takes note, since an exception
    raised from a handler lands wherever the main thread happens to be (inside `Thread.start`, say, which it
    leaves broken). A second signal stops this process at once, for a batch that never comes."""
    import signal
    import threading

    asked = []

    def stop_if_asked(agree=lambda n: n):
        number = agree(asked[0] if asked else 0)
        if number:
            name = signal.Signals(number).name
            raise TrainingStopped(f"predict stopped by {name}" + (f"; nothing was written to {output}" if output else ""),
                                  code=128 + number)

    if threading.current_thread() is not threading.main_thread():
        yield stop_if_asked
        return

    def note(number, frame):
        asked.append(number)
        if len(asked) > 1:
            stop_if_asked()

    previous = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop_if_asked
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _batch_values(job: components.Workload, model, batch, generate: int | None) -> tuple:
    """(what predict writes of each sample of `batch`, the names of its columns; None: `output`, and `class` for
    class scores): the text generated after each input (`generate`: the most new tokens; by the module itself,
    which makes no collective call), a language model's per-sequence loss (its outputs carry token logits and the
    batch its labels), or else the model's predictions."""
    if generate:  # chat and prompt/completion data: continued before their answer, which is kept beside
        answers = getattr(job.data.train, "kind", None) in ("messages", "prompt_completion")
        return (generated_rows(job.model, job.tokenizer, batch, generate, answers),
                ("prompt", "text", "reference") if answers else ("prompt", "text"))
    outputs, targets = (job.forward or forward)(model, batch)
    if _token_logits(outputs, targets):
        return _sequence_losses(outputs, targets), ("loss", "perplexity", "tokens")
    return _per_sample(outputs), None


def _token_logits(outputs, targets) -> bool:
    """Whether the outputs are scores over a vocabulary for each token [B, T, V] of labels [B, T]."""
    if not (isinstance(targets, torch.Tensor) and targets.dim() == 2 and not targets.is_floating_point()):
        return False
    try:
        scores = predictions(outputs)
    except ValueError:
        return False
    return scores.dim() == 3 and scores.shape[:-1] == targets.shape


def _sequence_losses(outputs, targets: torch.Tensor) -> torch.Tensor:
    """[B, 3]: each sequence's loss (the cross-entropy's mean over its labelled tokens, -100 left out), perplexity
    (exp of that loss) and labelled tokens. A model whose own loss counts the next token (Hugging Face's causal
    LMs; also a loss of its own that is no plain cross-entropy) has each position scored against the next label,
    as it trains; otherwise each position against its own (the built-in cross_entropy's tokens)."""
    logits = predictions(outputs).detach().float()
    own = own_loss(outputs)
    if own is not None and own_items(outputs, targets, own) is not count_tokens:
        logits, targets = logits[:, :-1], targets[:, 1:]
    per_token = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    tokens = (targets != IGNORE_INDEX).sum(1)
    loss = per_token.sum(1) / tokens  # NaN for a sequence with no labelled token
    return torch.stack([loss, loss.exp(), tokens.float()], 1)


def _per_sample(outputs):
    """What is gathered of a batch's outputs: the predictions tensor (class scores, values) when it is a batch
    of one size per sample ([B] or [B, C]), or else one plain object per sample (a detector's dicts, a
    sequence model's [B, T, C] padded to another length on each process)."""
    try:
        values = predictions(outputs).detach().float()
    except ValueError:
        if isinstance(outputs, dict):
            sizes = {len(v) for v in outputs.values() if isinstance(v, torch.Tensor) and v.dim()}
            if len(sizes) != 1:
                raise ConfigError(f"predict: cannot split outputs with keys {sorted(outputs)} into samples") from None
            return [{k: _plain(v[i]) for k, v in outputs.items()} for i in range(sizes.pop())]
        return [_plain(o) for o in outputs]
    return values if values.dim() <= 2 else [_plain(v) for v in values]


def _plain(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().tolist()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _rows(gathered, start: int, columns: tuple | None = None) -> list[dict]:
    if columns is not None:  # named values: a tensor's columns, or each sample's dict
        values = gathered.cpu().tolist() if isinstance(gathered, torch.Tensor) else gathered
        rows = [{"index": start + i, **(dict(zip(columns, v, strict=True)) if isinstance(v, list) else v)}
                for i, v in enumerate(values)]
        for row in rows:
            if "tokens" in row:
                row["tokens"] = int(row["tokens"])  # a count, gathered in the float tensor of its row
        return rows
    if isinstance(gathered, torch.Tensor):
        values = gathered.cpu()
        rows = []
        for i, value in enumerate(values):
            row = {"index": start + i}
            if value.dim() == 1 and value.numel() > 1:
                row["class"] = int(value.argmax())
            row["output"] = value.tolist() if value.numel() > 1 else value.item()
            rows.append(row)
        return rows
    return [{"index": start + i, "output": value} for i, value in enumerate(gathered)]


class _progress:
    """A rich progress bar over the batches on the main process (nothing on the others)."""

    def __init__(self, show: bool, total: int):
        self.show, self.total = show, total

    def __enter__(self):
        if not self.show:
            return lambda: None
        from rich.progress import Progress

        self.bar = Progress(transient=True)
        self.bar.start()
        task = self.bar.add_task("predicting", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.show:
            self.bar.stop()


# ----------------------------------------------------------------------------------------- the command line


@dataclass
class _Command:
    """What `evaluate`/`predict` on a run folder were given besides the training options."""

    run: Path
    weights: Path
    output: Path | None
    split: str
    generate: bool = False  # predict --generate
    tokenizer: str | None = None  # --tokenizer's, else the run folder's own, else config.yaml's


def _run_options(argv: list[str], command: str, about: str, output_help: str,
                 parents: tuple = ()) -> tuple[TrainConfig, _Command]:
    """RUN_DIR, --weights, --output, --split and the training options over the run's config.yaml (`parents`: parsers
    of the command's own options, shown in its --help)."""
    from ..flags import Parser, add_training_options, config_from

    parser = Parser(prog=f"acc-trainer {command}", description=about, parents=list(parents))
    parser.add_argument("run", type=Path, metavar="RUN_DIR", help="the folder of a finished run")
    parser.add_argument("--weights", type=Path, metavar="FILE", help="the weights to load (default: "
                        "RUN_DIR/model.safetensors)")
    parser.add_argument("--output", type=Path, metavar="FILE", help=output_help)
    parser.add_argument("--split", choices=("eval", "train"), default="eval",
                        help="the data's evaluation or training set (default: eval)")
    if command == "predict":
        parser.add_argument("--generate", action="store_true", help="write the text the model generates after each "
                            "input (greedy, --max-new-tokens), with the run's tokenizer or --tokenizer")
    add_training_options(parser, "every option of acc-trainer --help, over the run's own config.yaml (e.g. "
                                 "--dataset, --data-dir, --eval-batch-size)")
    args = parser.parse_args(argv)
    if not (args.run / "config.yaml").is_file():
        raise ConfigError(f"{args.run} holds no config.yaml: not the folder of an acc_trainer run")
    made = json.loads((args.run / "summary.json").read_text()) if (args.run / "summary.json").is_file() else {}
    if made.get("built_from") == "objects (fit)" and ("model" not in args or "dataset" not in args):
        raise ConfigError(f"{args.run} was trained by fit() on objects ({made['model']}, {made['dataset']}), which the "
                          "command line cannot build again: give --model and --dataset as functions that build them "
                          f"(module:function), or from Python: acc_trainer.{command}({str(args.run)!r}, model=..., "
                          "data=...)")
    accept = getattr(args, "accept_unverified", False)
    if "config" not in args:  # a --config given here replaces the run's, as it always did
        say_note(unverified(f"run folder {args.run} (config.yaml)", damage(args.run, ["config.yaml"]), accept))
        args.config = args.run / "config.yaml"
    cfg = config_from(args)
    weights = _verified(args.weights or args.run / weights_name(cfg), "--weights", accept)
    tokenizer = args.tokenizer if "tokenizer" in args else _saved_tokenizer(args.run) or cfg.tokenizer
    return cfg, _Command(args.run, weights, args.output, args.split, getattr(args, "generate", False), tokenizer)


def _tokenizer_of(model_or_run, tokenizer):
    """The tokenizer evaluate/predict from Python use: `tokenizer` (an object, or what --tokenizer takes), else the run
    folder's own (None: a model object, or a run saved without one)."""
    if tokenizer is None and isinstance(model_or_run, (str, os.PathLike)):
        tokenizer = _saved_tokenizer(Path(model_or_run))
    return components.load_tokenizer(str(tokenizer), "tokenizer=") if isinstance(tokenizer, (str, os.PathLike)) else tokenizer


def _saved_tokenizer(run: Path) -> str | None:
    """The run folder, when it holds the run's tokenizer (saved with it: pretrained.tokenizer_files)."""
    return str(run) if (run / "tokenizer_config.json").is_file() or (run / "tokenizer.json").is_file() else None


def _workload(cfg: TrainConfig, weights: Path, split: str):
    """The run's model with `weights` loaded, and its `split` set (the processes are started)."""
    from accelerate.utils import set_seed

    set_seed(cfg.seed)
    # The run's weights replace pretrained ones, but for a LoRA run's base.
    job = components.build_workload(replace(cfg, pretrained=cfg.pretrained and bool(cfg.lora)), trains=False)
    ready(cfg, job, weights, cfg.model)
    dataset = job.data.eval if split == "eval" else job.data.train
    if dataset is None:
        raise ConfigError(f"{job.dataset_name} has no evaluation set; give --split train or another --dataset")
    # The first-sample check and everything after it read this split only.
    job.data = settle(Data(dataset, None, job.data.task, job.data.num_classes, job.data.input_shape), cfg.data_pipeline,
                      job.collate)
    return job, dataset


def main_evaluate(argv: list[str]) -> None:
    """`acc-trainer evaluate RUN_DIR [options] [--weights FILE] [--output FILE.json]`."""
    cfg, given = _run_options(
        argv, "evaluate", "A finished run's loss and metrics on its evaluation set, or on any set the options name.",
        "also write the results to FILE.json")
    weights, output, split = given.weights, given.output, given.split
    if output is not None and output.suffix != ".json":
        raise ConfigError(f"--output {output}: evaluate writes .json")
    group = processes.start(cfg)  # before the workload: a download happens on the main process first
    job, dataset = _workload(cfg, weights, split)
    results = _evaluate(cfg, job, dataset, group)
    if PartialState().is_main_process:
        tables = results.pop("tables", {})
        print(f"{cfg.model} ({weights}) on {job.dataset_name} ({split}): {format_results(results)}")
        if output is not None:
            output.write_text(json.dumps({**results, **tables, "weights": str(weights), "split": split}, indent=1))


def main_predict(argv: list[str]) -> None:
    """`acc-trainer predict RUN_DIR --output FILE [options] [--weights FILE] [--split eval|train]`."""
    cfg, given = _run_options(
        argv, "predict", "A finished run's predictions: one row per sample, in the set's order.",
        f"where the rows go: FILE with a suffix of {', '.join(FORMATS)} (needed)")
    weights, output, split = given.weights, given.output, given.split
    if output is None or output.suffix not in FORMATS:
        raise ConfigError(f"acc-trainer predict needs --output FILE with a suffix of {', '.join(FORMATS)}"
                          + (f", not {output.suffix or output.name!r}" if output is not None else ""))
    if not output.parent.is_dir():
        raise ConfigError(f"--output {output}: the folder {output.parent} does not exist")
    check_replaceable(output)
    group = processes.start(cfg)
    job, dataset = _workload(cfg, weights, split)
    if given.generate and given.tokenizer:
        job.tokenizer = components.load_tokenizer(given.tokenizer)
    written, count = _predict(cfg, job, dataset, output, group, given.generate)
    if PartialState().is_main_process:
        what = "generated text" if given.generate else "predictions"
        print(f"{what} of {cfg.model} for {count:,} samples of {job.dataset_name} ({split}) in {written}",
              file=sys.stdout)
