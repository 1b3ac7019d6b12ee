"""The one configuration object of a training run, where command-line flags and YAML files enter.

Every option is a field of `TrainConfig`; its `help` metadata is what `--help` prints, so the
dataclass is the single place an option is declared. `TrainConfig.validate()` checks what can be
checked before any process starts; the trainer checks the rest (world size, device) once the
Accelerator exists. User mistakes raise `ConfigError`, which the CLI turns into one line on stderr
and exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

import yaml

# The built-in names (the registries themselves, models.MODELS and datasets.DATASETS, import torch; a test
# keeps these in step with them).
MODELS = ("linreg", "mlp", "lenet", "convnet", "resnet18", "resnet18_cifar")
DATASETS = ("synthetic", "linear", "fake", "cifar10", "cifar100", "imagefolder")
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULERS = ("constant", "cosine", "step", "onecycle")
PRECISIONS = ("no", "fp16", "bf16")
PROGRESS = ("auto", "rich", "plain", "none")
AUGMENTS = ("auto", "none", "standard", "trivialaugment")  # augment.AUGMENTS, and auto
PIPELINES = ("batched", "per-sample")
TRUNCATIONS = ("keep_start", "off")
DATA_FILES = (".jsonl", ".json", ".parquet")  # --dataset FILE (or a folder of them, or one save_to_disk wrote)
FORWARDS = ("default", "with_targets")  # losses.FORWARDS
OBJECTIVES, DPO_REFERENCES = ("lm", "dpo", "grpo", "reward"), ("auto", "adapter", "copy")
LOSS_TYPES, SCALE_REWARDS = ("dapo", "grpo", "bnpo", "dr_grpo"), ("group", "batch", "none")
# accelerate.tracking.LOGGER_TYPE_TO_CLASS's names, for --help (importing it takes a second; a test keeps them in step).
TRACKERS = ("aim", "clearml", "comet_ml", "dvclive", "mlflow", "swanlab", "tensorboard", "trackio", "wandb")


class ConfigError(ValueError):
    """A mistake in the user's input: reported as one line on stderr, exit code 2."""


def first_line(error: BaseException) -> str:
    """An exception's message cut to its first line (its type when it has none), to quote in one line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """'; did you mean X?' for a mistyped or shortened name (the known names it starts, else the nearest), or ''."""
    known = list(known)
    near = [k for k in known if k.startswith(name)][:3] or difflib.get_close_matches(name, known, n=1, cutoff=0.7)
    if not near:
        return ""
    return "; did you mean " + (f"{', '.join(near[:-1])} or {near[-1]}" if len(near) > 1 else near[0]) + "?"


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class TrainConfig:
    # What to train.
    model: str = _opt(
        "lenet", f"model: a built-in one ({', '.join(MODELS)}), torchvision:<name>, timm:<name>, or an import path "
        "pkg.module:factory (a function or class returning an nn.Module)", metavar="NAME|PATH")
    dataset: str | list = _opt(
        "synthetic", f"dataset: a built-in one ({', '.join(DATASETS)}), an import path pkg.module:factory "
        "returning (train_dataset, eval_dataset), or files of samples: a .jsonl, .json or .parquet file, or a folder "
        "of them or of a Hugging Face dataset's save_to_disk (chat messages, prompt/completion or text data are "
        "tokenized with --tokenizer); given more than once, each NAME=WEIGHT (1 if left out), the sets are mixed "
        "with those weights (docs/data.md#mixtures)", metavar="NAME|PATH[=WEIGHT]")
    model_args: dict | None = _opt(
        None, "keyword arguments for the model factory, a YAML/JSON mapping, e.g. '{width: 64, dropout: 0.1}' (a "
        "num_classes parameter gets the data's number of classes unless set here)", metavar="MAPPING")
    dataset_args: dict | None = _opt(None, "keyword arguments for the dataset factory, a YAML/JSON mapping", metavar="MAPPING")
    loss: str | None = _opt(
        None, "loss: cross_entropy, mse, l1, smooth_l1, bce_with_logits, or pkg.module:function(outputs, targets) "
        "(default: the model's own loss when its outputs carry one, else cross-entropy for class labels, MSE for "
        "real-valued targets)", metavar="NAME|PATH")
    metrics: list | None = _opt(
        None, "evaluation metrics, comma-separated: accuracy, top5, mae, or pkg.module:function(outputs, targets) "
        "returning one value per sample (default: accuracy for class labels)", metavar="NAMES")
    collate: str | None = _opt(
        None, "collate function pkg.module:function(list of samples) -> batch, for samples of different sizes (e.g. "
        "padding sequences); batches may be any nesting of lists, tuples and dicts of tensors (default: torch's "
        "default_collate)", metavar="PATH")
    forward: str | None = _opt(
        None, "how a batch goes through the model: default (a pair calls model(inputs), a dict model(**batch)), "
        "with_targets (model(inputs, targets) while training, model(inputs) in evaluation: torchvision's detection "
        "models), or pkg.module:function(model, batch) returning (outputs, targets)", metavar="NAME|PATH")
    tokenizer: str | None = _opt(
        None, "the text's tokenizer: a folder saved with save_pretrained, a tokenizer.json, or pkg.module:factory "
        "returning one; saved into the run folder and each checkpoint (AutoTokenizer.from_pretrained loads them), "
        "used by --prompts and predict --generate", metavar="PATH")
    objective: str = _opt("lm", "what the run trains: lm (the loss of --loss, or the model's own), dpo (preference pairs "
                          "against the starting weights), grpo (prompts, --rewards), reward (a reward model)", choices=OBJECTIVES)
    dpo_beta: float = _opt(0.1, "--objective dpo: beta, the scale of the log-probability ratios (rewards)", metavar="BETA")
    dpo_reference: str = _opt("auto", "--objective dpo: the reference, the model with its LoRA adapters off (adapter) or "
                              "a frozen copy (copy); auto: adapter with --lora, else copy", choices=DPO_REFERENCES)
    rewards: list | None = _opt(None, "--objective grpo: the reward functions, import paths pkg.module:fn, comma-"
                                "separated, each with =WEIGHT unless 1 (called as TRL calls them)", metavar="PATHS")
    num_generations: int = _opt(8, "--objective grpo: completions per prompt (G); --batch-size counts completions")
    max_completion_length: int = _opt(256, "--objective grpo: the longest completion, in tokens")
    temperature: float = _opt(1.0, "--objective grpo: the sampling temperature (also of the log-probabilities)")
    top_p: float = _opt(1.0, "--objective grpo: sample from the most likely tokens of this total probability")
    top_k: int = _opt(0, "--objective grpo: sample among the K most likely tokens (0: all)")
    grpo_beta: float = _opt(0.0, "--objective grpo: the weight of the KL to the reference (TRL's beta)")
    epsilon: float = _opt(0.2, "--objective grpo: the clipping range below 1 (and above, unless --epsilon-high)")
    epsilon_high: float | None = _opt(None, "--objective grpo: the clipping range above 1 (DAPO: 0.28)")
    num_iterations: int = _opt(1, "--objective grpo: optimizer steps on each generation (its log-probabilities kept)")
    scale_rewards: str = _opt("group", "--objective grpo: advantages scaled per group, batch or none", choices=SCALE_REWARDS)
    loss_type: str = _opt("dapo", "--objective grpo: the loss's normalisation, as TRL names it", choices=LOSS_TYPES)
    generation_groups: int = _opt(1, "--objective grpo: prompts generated together (the same completions on processes "
                                  "holding multiples of K prompts a micro-batch)", metavar="K")
    mask_truncated_completions: bool = _opt(False, "--objective grpo: completions cut at the maximum left out of the loss")
    log_completions: int = _opt(0, "--objective grpo: every N steps, the completions and rewards in completions.jsonl")
    center_rewards_coefficient: float | None = _opt(None, "--objective reward: the weight of mean((chosen + rejected)^2) "
                                                    "in the loss, rewards centred on 0 (TRL's; e.g. 0.01)", metavar="X")
    data_dir: str = _opt("data", "folder of cifar10/cifar100 (torchvision's layout) or imagefolder (train|val/<class>/*)")
    train_size: int = _opt(8192, "training samples of the generated datasets (synthetic, linear, fake)")
    eval_size: int = _opt(2048, "evaluation samples of the generated datasets (synthetic, linear, fake)")
    image_size: int | None = _opt(
        None, "resize images to this side length (e.g. 224 to upscale CIFAR as in the ResNet-18 experiment); "
              "imagefolder: resize and centre-crop to N x N (default: the images' own size, 32 when augmented)")
    data_pipeline: str = _opt(
        "batched", "batched: datasets held in memory (CIFAR, the generated ones, a user's tensors) stay on the training "
        "device and are augmented a batch at a time there; per-sample: every sample through the DataLoader (CIFAR "
        "through torchvision's PIL path). Datasets read from files are always per sample", choices=PIPELINES)
    pack: int | None = _opt(
        None, "pack the documents of tokens of the training and evaluation sets into blocks of this many tokens, each "
        "document attending to itself only (through position_ids; refused for a model that attends across them) "
        "and its first token never a target (docs/language-models.md#packing)", metavar="LENGTH")
    max_length: int | None = _opt(
        None, "text data: the most tokens of a sample (a pair's prompt + completion); longer ones are cut from the end, "
        "counted in the start line (see --truncation) (default: no limit)", metavar="TOKENS")
    truncation: str = _opt("keep_start", "text data longer than --max-length: keep_start cuts it, off refuses it",
                           choices=TRUNCATIONS)
    train_on_prompt: bool = _opt(False, "chat and prompt/completion data: the loss on every token, not only on the "
                                        "assistant's (the completion's)")
    chat_template: str | None = _opt(None, "a Jinja file of the chat template for messages, replacing the tokenizer's "
                                           "(and saved with it)", metavar="FILE")
    token_cache: str = _opt("auto", "text data: the folder its tokens are kept in, reused by later runs (auto: "
                            "$ACC_TRAINER_CACHE, else ~/.cache/acc_trainer/tokens; off: tokenized at every start)", metavar="DIR")
    tokenize_workers: int | None = _opt(None, "text data: processes tokenizing it (default: the CPU cores, up to 8)")

    # Augmentation (training only; each sample's is a function of --seed, the epoch and its index).
    augment: str = _opt(
        "auto", "none; standard: random crop (4 px padding) + flip, RandomResizedCrop + flip for imagefolder; "
        "trivialaugment: standard + TrivialAugmentWide; auto: standard for cifar10/cifar100, else none (imagefolder and your "
        "own data opt in)", choices=AUGMENTS)
    mixup: float = _opt(0.0, "mix each training image with a partner sample, weight ~ Beta(A, A) (torchvision's "
                             "reference: 0.2); 0: off", metavar="A")
    cutmix: float = _opt(0.0, "paste a box of a partner sample, area ~ Beta(A, A) (torchvision's reference: 1.0); "
                              "with --mixup too, each sample takes one of the two", metavar="A")
    label_smoothing: float = _opt(0.0, "cross-entropy label smoothing (torchvision's reference: 0.1)", metavar="X")
    ema: float | None = _opt(None, "keep an exponential moving average of the weights with this decay (e.g. 0.999): "
                                   "evaluated, kept as best and saved as model.safetensors instead of the raw weights",
                             metavar="DECAY")

    # How long and how big.
    epochs: int = _opt(3, "passes over the training set")
    max_steps: int | None = _opt(None, "train exactly this many optimizer steps, over as many epochs as that takes "
                                       "(--epochs applies when this is not given)")
    batch_size: int = _opt(128, "GLOBAL batch per optimizer step, summed over processes and accumulation micro-batches")
    grad_accum: int = _opt(1, "micro-batches accumulated per optimizer step")
    micro_batch: str | None = _opt(
        None, "samples per process in one forward pass, the rest of --batch-size made up by accumulation (sets "
              "--grad-accum); auto: the largest that fits the device's memory, halving from the global batch's share",
        metavar="N|auto")
    eval_batch_size: int | None = _opt(None, "evaluation batch PER PROCESS (default: the per-process training "
                                             "micro-batch); results do not depend on it")

    # Starting point (fine-tuning).
    init_from: str | None = _opt(
        None, "start from these weights: a .safetensors file, a torch state dict (.pt, .pth, .bin), or a run folder or "
        "checkpoint of acc_trainer; tensors whose shape differs (another head) keep their fresh initialisation",
        metavar="PATH")
    init_strict: bool = _opt(False, "--init-from: refuse weights that do not match the model exactly")
    pretrained: bool = _opt(False, "torchvision:<name> and timm:<name> models: start from the library's pretrained "
                                   "weights (downloaded once into its cache), with a new head for the data's classes")
    freeze: str | None = _opt(
        None, "keep the parameters whose names match this regular expression as they are (BatchNorm layers among "
        "them keep their statistics), e.g. '^(?!fc\\.)' for all but a ResNet's head", metavar="REGEX")
    unfreeze_at: int | None = _opt(None, "--freeze: train the frozen parameters from this epoch on (1 is the first)",
                                   metavar="EPOCH")
    param_groups: dict | None = _opt(
        None, "per-parameter options, a YAML mapping from a regular expression on parameter names (the first that "
        "matches) to lr_mult and/or weight_decay, e.g. '{\"^layer[12]\\.\": {lr_mult: 0.1}}'", metavar="MAPPING")
    no_decay_norm_bias: bool = _opt(False, "no weight decay on biases and normalisation weights (1-dim parameters)")
    layer_decay: float | None = _opt(
        None, "layer-wise learning-rate decay: a layer at depth d of D gets lr x X^(D - d) (ResNets, ViTs, ConvNeXts)",
        metavar="X")
    lora: int | None = _opt(
        None, "train LoRA adapters of this rank (peft) instead of the model's weights, added after its starting weights "
        "(its factory's, --init-from's); the run folder holds the adapter in peft's format", metavar="RANK")
    lora_alpha: float | None = _opt(None, "--lora: the adapters' scale is alpha / rank (default: 2 x rank)", metavar="ALPHA")
    lora_dropout: float = _opt(0.0, "--lora: dropout on the adapters' input", metavar="P")
    lora_targets: list | None = _opt(
        None, "--lora: the layers to adapt, by the last part of their names, comma-separated (e.g. q_proj,v_proj; "
        "default for a transformers model: every linear layer but the output one)", metavar="NAMES")
    lora_merge: bool = _opt(False, "--lora: also write the model with the adapters merged into <output-dir>/merged/")
    load_in_4bit: bool = _opt(False, "--lora on the --init-from folder's model loaded in 4 bits (QLoRA, through bitsandbytes)")
    bnb_4bit_quant_type: str = _opt("nf4", "--load-in-4bit: the 4-bit data type", choices=("nf4", "fp4"))
    bnb_4bit_compute_dtype: str = _opt("float32", "--load-in-4bit: the dtype the 4-bit layers compute in",
                                       choices=("float32", "bfloat16", "float16"))

    # Optimisation.
    optimizer: str = _opt("adam", "optimizer: sgd, adam, adamw, or an import path pkg.module:Class taking parameter "
                                  "groups (e.g. torch.optim:RAdam)", metavar="NAME|PATH")
    optimizer_args: dict | None = _opt(None, "keyword arguments for --optimizer, a YAML/JSON mapping (lr and the groups "
                                             "are the trainer's)", metavar="MAPPING")
    fused_optimizer: bool = _opt(False, "sgd, adam and adamw under DDP or on one process: torch's fused implementation "
                                        "(one kernel over every parameter) instead of its default (foreach on a GPU, its "
                                        "loop over parameters on a CPU); on a CPU it breaks the 1e-5 guarantee "
                                        "between process counts (docs/performance.md)")
    lr: float = _opt(1e-3, "learning rate (before --scale-lr)")
    momentum: float = _opt(0.9, "SGD momentum")
    nesterov: bool = _opt(False, "use Nesterov momentum with SGD")
    weight_decay: float = _opt(0.0, "weight decay (decoupled for adamw, L2 for sgd and adam)")
    scheduler: str = _opt("constant", f"learning-rate schedule: {', '.join(SCHEDULERS)}, or an import path "
                                      "pkg.module:factory(optimizer, total_steps)", metavar="NAME|PATH")
    warmup_steps: int = _opt(0, "linear warmup from 0 over this many optimizer steps")
    lr_step_epochs: int = _opt(1, "'step' schedule: multiply the LR by --lr-gamma every this many epochs")
    lr_gamma: float = _opt(0.1, "'step' schedule: decay factor")
    scale_lr: bool = _opt(False, "scale the LR linearly with the global batch: lr x batch_size / --lr-reference-batch")
    lr_reference_batch: int = _opt(256, "global batch at which --lr applies unscaled, with --scale-lr")
    max_grad_norm: float | None = _opt(None, "clip the gradient norm to this value at every optimizer step")

    # Devices and precision.
    mixed_precision: str | None = _opt(None, "no, fp16 or bf16 (default: what the accelerate config says when "
                                       "launched with one, else no)", choices=PRECISIONS)
    cpu: bool = _opt(False, "train on the CPU even when a GPU is present")
    sync_bn: bool = _opt(False, "convert BatchNorm layers to SyncBatchNorm (statistics over all processes)")
    compile: bool = _opt(False, "compile the model with torch.compile (inductor), through Accelerate")
    channels_last: bool = _opt(False, "keep images and convolution weights in channels-last memory format")
    gradient_checkpointing: bool = _opt(
        False, "recompute activations in the backward pass instead of keeping them (less memory, more compute): a "
        "transformers model's own switch, non-reentrant")
    tf32: bool = _opt(True, "on GPUs from Ampere on, let float32 matmuls and convolutions use TF32 tensor cores")
    dist_timeout: int = _opt(1800, "seconds a process waits for the others at a collective before failing with an "
                             "error (the backstop: --hang-timeout finds a hung process sooner)")
    hang_timeout: float | None = _opt(
        None, "seconds without progress after which a process counts as hung: the run names the process that holds "
        "the others up (and prints its Python stacks), then stops every process (default: 20 x the run's median step "
        "time, at least 60 s; 10 x that for the first step and checkpoint writes; 0: no watchdog)", metavar="S")
    seed: int = _opt(42, "seed for weights, data order and generated data")
    num_workers: int | None = _opt(
        None, "DataLoader worker processes per training process (default: none for data in memory; for the built-in "
        "datasets read per sample, the CPU cores per process minus one, at most 8; a stream: 0 reads ahead in a thread, "
        "1 or more in one worker process, which keeps the stream's order)")

    # Output.
    output_dir: str | None = _opt(None, "where the run writes its files (default: runs/<time>-<model>-<dataset>)")
    log_every: int = _opt(10, "log loss, LR and speed every this many optimizer steps")
    log_with: list | None = _opt(
        None, f"also log to these Accelerate trackers, comma-separated ({', '.join(TRACKERS)}), or all: every one "
        "installed; each tracker's run is named after the run folder (docs/experiments.md#trackers) (default: None, no "
        "tracker)", metavar="TRACKERS")
    project: str | None = _opt(
        None, "the trackers' project (wandb, trackio; MLflow's experiment; TensorBoard's <output-dir>/logs/<project>) "
        "(default: the tracker's own environment variable, WANDB_PROJECT or MLFLOW_EXPERIMENT_NAME, else acc_trainer)",
        metavar="NAME")
    checkpoint_every: str | None = _opt(None, "save full training state every N optimizer steps, every 'epoch', or both "
                                        "('500,epoch')")
    keep_last: int | None = _opt(None, "keep only the newest K step checkpoints (the best one is kept apart)")
    resume: str | None = _opt(None, "'auto': continue from the newest complete checkpoint in --output-dir; or a checkpoint "
                                    "folder")
    accept_unverified: bool = _opt(False, "resume from, evaluate, predict with, export or rerun a checkpoint or run "
                                   "folder whose files cannot be checked (no SHA256SUMS, or a file it does not list: "
                                   "one written before digests, or put together elsewhere); the run's notes say so")
    save_best: str | None = _opt(None, "keep the checkpoint with the best evaluation 'loss' or metric (e.g. accuracy; "
                                 "lower is better for loss, mae and names ending in loss or error)", metavar="METRIC")
    early_stop: str | None = _opt(
        None, "stop when the evaluation 'loss' or this metric has not improved for --patience evaluations (lower is "
        "better for loss, mae and names ending in loss or error)", metavar="METRIC")
    patience: int = _opt(3, "--early-stop: evaluations without improvement before the run stops")
    eval_every: int | None = _opt(None, "evaluate every N optimizer steps (and after the last) instead of after every "
                                        "epoch; --early-stop, --save-best and --patience count these evaluations",
                                  metavar="N")
    min_delta: float = _opt(0.0, "--early-stop: the least change that counts as an improvement", metavar="X")
    prompts: list | None = _opt(
        None, "texts the model continues (greedy) at each evaluation, into <output-dir>/samples.jsonl and the tracker: a "
        "file of one prompt a line, or a YAML list ('[[{role: user, content: hi}]]': chat, through the template)",
        metavar="FILE|LIST", lines=True)
    judge: list | None = _opt(None, "at each evaluation, each held-out chat or prompt/completion sample continued before "
                              "its answer and judged: exact_match, or pkg.module:fn, comma-separated", metavar="FNS")
    max_new_tokens: int = _opt(32, "--prompts, --judge and predict --generate: the most tokens generated for a text")
    skip_bad_samples: bool = _opt(
        False, "skip optimizer steps whose batch holds a training sample that cannot be read (counted and named in "
        "the summary) instead of stopping")
    skip_nonfinite: bool = _opt(False, "skip optimizer steps whose loss is NaN/inf (counted in the summary) instead of stopping")
    plots: bool = _opt(True, "draw the run's figures into <output-dir>/plots/ at its end")
    progress: str = _opt("auto", "rich: live bars; plain: one line per log step; auto: rich on a terminal, else plain",
                         choices=PROGRESS)

    def _check_micro_batch(self) -> None:
        if self.micro_batch is None:
            return
        self.micro_batch = str(self.micro_batch)  # a YAML file gives a number
        if self.micro_batch != "auto" and not (self.micro_batch.isdigit() and int(self.micro_batch) > 0):
            raise ConfigError(f"--micro-batch takes a positive number of samples or auto, not {self.micro_batch!r}")
        if self.grad_accum != 1:
            raise ConfigError("give --micro-batch or --grad-accum, not both: --micro-batch sets the accumulation")

    def validate(self) -> "TrainConfig":
        """Check everything that does not need the Accelerator. Returns self."""
        self._check_choices()
        self._check_counts()
        self._check_hyperparameters()
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"--batch-size {self.batch_size} does not divide into --grad-accum {self.grad_accum} micro-batches")
        self._check_micro_batch()
        self._check_model_and_data()
        self._checkpoint_parts()  # parses --checkpoint-every
        self._check_optimizer_setup()
        self._check_lora()
        if self.nesterov and self.optimizer != "sgd":
            raise ConfigError("--nesterov applies to --optimizer sgd only")
        self._check_trackers()
        return self

    def _check_choices(self) -> None:
        """The options that take one of a few names (a field's `choices`)."""
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                kind = f.name.replace("_", " ")
                raise ConfigError(f"unknown {kind} {value!r}; choose from {', '.join(choices)}"
                                  + did_you_mean(str(value), choices))

    def _check_counts(self) -> None:
        """Sizes, step counts and timeouts: positive where given."""
        for name in ("train_size", "eval_size", "epochs", "batch_size", "grad_accum", "log_every", "patience",
                     "lr_step_epochs", "lr_reference_batch", "dist_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag(name)} must be positive, got {getattr(self, name)}")
        for name in ("max_steps", "eval_batch_size", "image_size", "keep_last", "eval_every", "max_new_tokens",
                     "max_length", "tokenize_workers"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{_flag(name)} must be positive, got {value}")
        if self.pack is not None and self.pack < 2:
            raise ConfigError(f"--pack takes a block length of at least 2 tokens, got {self.pack}")
        if self.hang_timeout is not None and self.hang_timeout < 0:
            raise ConfigError(f"--hang-timeout must be 0 (no watchdog) or positive, got {self.hang_timeout}")

    def _check_hyperparameters(self) -> None:
        """Learning rates, regularisation, --seed and --num-workers: within their ranges."""
        for name in ("lr", "lr_gamma"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{_flag(name)} must be positive, got {getattr(self, name)}")
        for name in ("momentum", "weight_decay", "warmup_steps", "seed", "mixup", "cutmix", "label_smoothing",
                     "min_delta"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_flag(name)} must not be negative, got {getattr(self, name)}")
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"--num-workers must not be negative, got {self.num_workers}")
        for name in ("mixup", "cutmix"):  # Beta(a, a); above ~100 it is 0.5 to three decimals
            if not 0 <= getattr(self, name) <= 100:
                raise ConfigError(f"--{_flag(name)} takes a Beta parameter from 0 (off) to 100, got {getattr(self, name)}")
        if not self.label_smoothing < 1:
            raise ConfigError(f"--label-smoothing must be below 1, got {self.label_smoothing}")
        if self.ema is not None and not 0 < self.ema < 1:
            raise ConfigError(f"--ema takes a decay between 0 and 1 (e.g. 0.999), got {self.ema}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"--max-grad-norm must be positive, got {self.max_grad_norm}")

    def _check_model_and_data(self) -> None:
        """--model, --dataset (each set of a mixture), --collate and --forward: a built-in name or an import path."""
        sets = [name for name, _ in dataset_sets(self.dataset)]
        for dataset in sets:
            if is_data_path(dataset) and not Path(dataset).exists():
                raise ConfigError(f"--dataset {dataset}: no such file or folder")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ConfigError(f"--chat-template {self.chat_template}: no such file")
        for name, builtins, value in (("model", MODELS, self.model), *(("dataset", DATASETS, d) for d in sets)):
            if value not in builtins and not IMPORT_PATH.match(value) and not (name == "dataset" and is_data_path(value)):
                raise ConfigError(f"unknown {name} {value!r}; choose from {', '.join(builtins)}, or give an import path "
                                  f"pkg.module:factory" + (", torchvision:<name> or timm:<name>" if name == "model" else "")
                                  + did_you_mean(value, builtins))
        if self.collate is not None and not IMPORT_PATH.match(self.collate):
            raise ConfigError(f"--collate takes an import path pkg.module:function, got {self.collate!r}")
        if self.forward is not None and self.forward not in FORWARDS and not IMPORT_PATH.match(self.forward):
            raise ConfigError(f"unknown forward {self.forward!r}; choose from {', '.join(FORWARDS)}, or give an import "
                              "path pkg.module:function")

    def _check_optimizer_setup(self) -> None:
        """--optimizer and --scheduler (a built-in name or an import path), --unfreeze-at and --layer-decay."""
        for name, builtins in (("optimizer", OPTIMIZERS), ("scheduler", SCHEDULERS)):
            value = getattr(self, name)
            if value not in builtins and not IMPORT_PATH.match(value):
                raise ConfigError(f"unknown {name} {value!r}; choose from {', '.join(builtins)}, or give an import path "
                                  "pkg.module:attr" + did_you_mean(value, builtins))
        if self.unfreeze_at is not None and (self.freeze is None or self.unfreeze_at < 1):
            raise ConfigError("--unfreeze-at takes an epoch from 1 on, with --freeze")
        if self.freeze is not None:
            try:
                re.compile(self.freeze)
            except re.error as e:
                raise ConfigError(f"--freeze {self.freeze!r} is not a regular expression ({e})") from None
        if self.layer_decay is not None and not 0 < self.layer_decay <= 1:
            raise ConfigError(f"--layer-decay takes a factor in (0, 1], got {self.layer_decay}")

    def _check_lora(self) -> None:
        """--lora RANK and the options that apply only with it."""
        if self.lora is not None and self.lora <= 0:
            raise ConfigError(f"--lora takes a positive rank, got {self.lora}")
        lora_options = [n for n in ("lora_alpha", "lora_targets") if getattr(self, n) is not None]
        lora_options += [n for n in ("lora_dropout", "lora_merge") if getattr(self, n)]
        if lora_options and self.lora is None:
            raise ConfigError(f"--{_flag(lora_options[0])} applies with --lora RANK")
        if self.lora is not None and self.freeze is not None:
            raise ConfigError("--freeze does not combine with --lora, which trains the adapters alone (the rest is frozen)")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora-dropout takes a probability from 0 to below 1, got {self.lora_dropout}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ConfigError(f"--lora-alpha must be positive, got {self.lora_alpha}")
        bnb = [n for n, d in (("bnb_4bit_quant_type", "nf4"), ("bnb_4bit_compute_dtype", "float32")) if getattr(self, n) != d]
        if bnb and not self.load_in_4bit:
            raise ConfigError(f"--{_flag(bnb[0])} applies with --load-in-4bit")

    def _check_trackers(self) -> None:
        """--log-with's names and --project (which trackers are installed is checked at start: trackers.chosen)."""
        for name in self.log_with or []:
            if name not in (*TRACKERS, "all"):
                raise ConfigError(f"unknown tracker {name!r}; Accelerate supports {', '.join(TRACKERS)}, or all (every "
                                  f"one installed){did_you_mean(name, TRACKERS)}")
        if self.project is not None and not self.project.strip():
            raise ConfigError("--project needs a name")

    @property
    def checkpoint_steps(self) -> int | None:
        return next((int(p) for p in self._checkpoint_parts() if p != "epoch"), None)

    @property
    def checkpoint_epochs(self) -> bool:
        return "epoch" in self._checkpoint_parts()

    def _checkpoint_parts(self) -> list[str]:
        if self.checkpoint_every is None:
            return []
        parts = [p.strip() for p in str(self.checkpoint_every).split(",")]
        steps = [p for p in parts if p != "epoch"]
        if len(steps) > 1 or any(not p.isdigit() or int(p) <= 0 for p in steps):
            raise ConfigError(f"--checkpoint-every takes a positive number of steps, 'epoch', or both ('500,epoch'); "
                              f"got {self.checkpoint_every!r}")
        return parts

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def is_data_path(dataset: str) -> bool:
    """Whether --dataset names files of samples (JSONL, JSON, parquet, or a folder of them or of save_to_disk) rather
    than a built-in dataset or an import path."""
    return dataset not in DATASETS and not IMPORT_PATH.match(dataset) and (
        dataset.endswith(DATA_FILES) or "/" in dataset or Path(dataset).exists())


def dataset_sets(dataset: str | list) -> list[tuple[str, float]]:
    """--dataset's sets with their weights: one set (weight 1), or a mixture's, each NAME=WEIGHT (1 if left out)."""
    sets = [d.rpartition("=")[::2] if "=" in d else (d, "1") for d in dataset] if isinstance(dataset, list) else [(dataset, "1")]
    bad = next((f"{n}={w}" for n, w in sets if not re.fullmatch(r"(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", w) or not float(w) > 0), None)
    if bad:
        raise ConfigError(f"--dataset {bad}: a mixture's sets are NAME=WEIGHT, each weight a positive number (chat.jsonl=0.7)")
    return [(n, float(w)) for n, w in sets]


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _lines(path: str, name: str) -> list[str]:
    """The non-blank lines of a text file, each as it is (a prompt's spaces count), for an option of texts."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--{_flag(name)} {path}: cannot be read ({getattr(e, 'strerror', None) or type(e).__name__}); "
                          "give a text file with one item per line, or a YAML list '[\"...\", \"...\"]'") from None
    if not lines:
        raise ConfigError(f"--{_flag(name)} {path}: the file holds no text")
    return lines


class UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (PyYAML's own keeps the last one, silently:
    `epochs: 3` above `epochs: 30` would train 30)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        again = next((i for i, k in enumerate(keys) if k in keys[:i]), None)
        if again is not None:
            line = node.value[again][0].start_mark.line + 1
            raise yaml.constructor.ConstructorError(None, None, f"the key {keys[again]!r} is given twice (again on line "
                                                    f"{line})")
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict of known option names (dashes or underscores)."""
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeys)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option: value, not {type(data).__name__}")
    return option_names(data, f"config file {path}")


def option_names(data: dict, where: str) -> dict[str, Any]:
    """`data`'s keys as TrainConfig's field names (a file may write them with dashes, as the flags are); an
    unknown one is refused naming `where`, with the nearest known name."""
    known = {f.name for f in fields(TrainConfig)}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            # Suggested as the file writes its keys: with underscores, or with dashes as the flags and docs do.
            spelled = sorted(known) if "_" in str(key) else sorted(k.replace("_", "-") for k in known)
            raise ConfigError(f"{where}: unknown option {key!r}{did_you_mean(str(key), spelled)}")
        out[name] = value
    return out


def make_config(values: dict[str, Any]) -> TrainConfig:
    """Build a validated TrainConfig from option values, checking each value's type (and each name)."""
    unknown = sorted(set(values) - {f.name for f in fields(TrainConfig)})
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}{did_you_mean(str(unknown[0]), TrainConfig.__dataclass_fields__)}")
    typed = {}
    for f in fields(TrainConfig):
        if f.name not in values:
            continue
        typed[f.name] = _coerce(f, values[f.name])
    return TrainConfig(**typed).validate()


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """YAML and argparse both hand over loosely typed values; accept what is unambiguous."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    optional = "None" in kind
    if value is None:
        if optional:
            return None
        raise ConfigError(f"option {f.name!r} needs a value")
    base = kind.split("|")[0].strip()
    texts = bool(f.metadata.get("lines"))  # a list of texts (kept as they are), or a text file of them
    if texts and isinstance(value, str) and not value.lstrip().startswith("["):
        value = _lines(value, f.name)
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            raise TypeError
        if base == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if base == "float":
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if base == "str":
            if "list" in kind and isinstance(value, (list, dict)) and value:  # --dataset: a mixture (data/mixtures.py)
                value = [f"{k}={w}" for k, w in value.items()] if isinstance(value, dict) else [f"{k}={w}" for i in value
                         for k, w in i.items()] if all(isinstance(i, dict) for i in value) else value
                return [str(v).strip() for v in value] if len(value) > 1 or "=" in str(value[0]) else str(value[0]).strip()
            if isinstance(value, (dict, list)):
                raise TypeError
            return str(value)
        if base == "dict":  # a mapping in YAML, or its YAML/JSON text from the command line
            parsed = yaml.safe_load(value) if isinstance(value, str) else value
            if not isinstance(parsed, dict) or not all(isinstance(k, str) for k in parsed):
                raise TypeError
            return parsed
        if base == "list":  # a YAML list, its YAML/JSON text, or comma-separated text
            if isinstance(value, str):
                value = yaml.safe_load(value) if value.lstrip().startswith("[") else value.split(",")
            items = value
            chat = texts and all(isinstance(i, str) or (isinstance(i, list) and all(isinstance(m, dict) for m in i))
                                 for i in items)  # a prompt may be chat messages
            if not isinstance(items, list) or not (chat or all(isinstance(i, str) for i in items)):
                raise TypeError
            return [i if texts else i.strip() for i in items if not isinstance(i, str) or i.strip()]
    except (TypeError, ValueError, yaml.YAMLError):
        kind = {"dict": "a mapping", "list": "a list of texts" if texts else "a list of names"}.get(base, base)
        raise ConfigError(f"option {f.name!r} must be {kind}, got {value!r}") from None
    return value
