"""The command-line flags: one per field of `TrainConfig`, whose help text is their documentation.

Values are taken in this order, later winning: defaults, `--config FILE` (YAML), flags on the command
line. A mistake raises ConfigError (one line on stderr and exit 2 from the CLI), never argparse's
usage block; an option is never abbreviated, and an unknown one is answered with the nearest known one.
The sub-commands (evaluate, predict, check, bench) take the same options through `add_training_options`.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from .config import ConfigError, TrainConfig, did_you_mean, load_yaml, make_config

EXAMPLES = """\
commands (acc-trainer COMMAND --help describes each):
  acc-trainer [options]                                train (the options above)
  acc-trainer launch [accelerate launch's args] -m acc_trainer ...   several processes, with the trainer's exit codes;
                                                       --max_restarts N restarts a failed group (nothing to set)
  acc-trainer report RUN_DIR [RUN_DIR ...]             compare runs: a table and a figure
  acc-trainer bench [--processes 1,2] [options]        speed vs hand-written loops, 1 and N processes
  acc-trainer bench-lm [--processes 1,2] [options]     a language model's tokens/s vs the Hugging Face Trainer
  acc-trainer check [--steps N] [options]              prove the job trains the same on 1 and 2 processes and resumes exactly
  acc-trainer check-data [options]                     open every sample once; list those that cannot be read
  acc-trainer lr-find [--min-lr] [--max-lr] [--steps] [options]   the learning-rate range test: a figure, a suggestion
  acc-trainer evaluate RUN_DIR [--weights F] [--output F.json] [options]   a finished run's weights on any set
  acc-trainer predict RUN_DIR --output F.jsonl|.csv|.npz [options]         one row per sample, in order
  acc-trainer export RUN_DIR --format onnx|pt2|safetensors [--output F]     the model for other tools, checked
  acc-trainer consolidate CHECKPOINT OUT [--accept-unverified]   any engine's checkpoint as whole weights
  acc-trainer rerun RUN_DIR [options]                  train a run again from its config.yaml; same weights?
  acc-trainer sweep SPACE.yaml [--trials N]            an Optuna search, each trial a run, pruned as it goes

examples:
  acc-trainer                                          default job: LeNet on generated images, about 7 s on a 2-core CPU
  acc-trainer --model linreg --dataset linear --optimizer sgd --lr 0.01 --batch-size 32 --epochs 10
  acc-trainer --model resnet18 --dataset cifar10 --data-dir data --image-size 224 --batch-size 512 --optimizer sgd
  acc-trainer --model my_model:Net --model-args '{width: 64}' --dataset my_data:load      your own model and data
  acc-trainer --model torchvision:resnet50 --dataset imagefolder --data-dir photos --image-size 224
  accelerate launch --multi_gpu --num_processes 2 -m acc_trainer ...        2 GPUs, or 2 CPU processes without a GPU
  accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m acc_trainer ...
"""


# --help's groups of options, as docs/options.md groups them (a test keeps the two in step).
THEMES = {
    "What to train": ("model", "dataset", "data_dir", "model_args", "dataset_args", "loss", "collate", "forward",
                      "tokenizer", "objective", "dpo_beta", "dpo_reference"),
    "Reinforcement learning": ("rewards", "num_generations", "max_completion_length", "temperature", "top_p", "top_k",
                               "grpo_beta", "epsilon", "epsilon_high", "num_iterations", "scale_rewards", "loss_type",
                               "mask_truncated_completions", "log_completions", "generation_groups",
                               "center_rewards_coefficient"),
    "How long": ("epochs", "max_steps"),
    "Batches": ("batch_size", "grad_accum", "micro_batch", "eval_batch_size"),
    "Fine-tuning": ("init_from", "init_strict", "pretrained", "freeze", "unfreeze_at", "param_groups",
                    "no_decay_norm_bias", "layer_decay", "lora", "lora_alpha", "lora_dropout", "lora_targets",
                    "lora_merge", "load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_compute_dtype"),
    "Optimizer and schedule": ("optimizer", "optimizer_args", "fused_optimizer", "momentum", "nesterov", "weight_decay",
                               "lr", "scale_lr", "lr_reference_batch", "scheduler", "warmup_steps", "lr_step_epochs", "lr_gamma",
                               "max_grad_norm"),
    "Precision and devices": ("mixed_precision", "cpu", "sync_bn", "seed", "dist_timeout", "hang_timeout"),
    "Data": ("augment", "mixup", "cutmix", "label_smoothing", "ema", "data_pipeline", "num_workers", "train_size",
             "eval_size", "image_size", "pack", "max_length", "truncation", "train_on_prompt", "chat_template",
             "token_cache", "tokenize_workers"),
    "Run files and output": ("output_dir", "log_every", "log_with", "project", "progress", "plots"),
    "Evaluation": ("metrics", "eval_every", "early_stop", "patience", "min_delta", "prompts", "judge", "max_new_tokens"),
    "Checkpoints and faults": ("checkpoint_every", "keep_last", "resume", "accept_unverified", "save_best",
                               "skip_nonfinite", "skip_bad_samples"),
    "GPU speed": ("compile", "channels_last", "tf32", "gradient_checkpointing"),
}


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake raised as ConfigError (one line, exit 2) instead of its usage block, and no
    abbreviated options (`--epoch` is not taken for `--epochs`: it is refused with a suggestion)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str):
        raise ConfigError(message)

    def _check_value(self, action, value):  # argparse's check of `choices`, with the nearest choice suggested
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            raise argparse.ArgumentError(action, f"{e.message}{did_you_mean(str(value), map(str, action.choices))}") \
                from None

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        option = next((a.split("=", 1)[0] for a in extra if a.startswith("-")), None)
        if option is not None:
            known = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
            raise ConfigError(f"unknown option {option}{did_you_mean(option, known)}")
        if extra:
            raise ConfigError(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


class _OnOrOff(argparse.Action):
    """A yes/no option whose name starts with no-: its first flag (--no-x) sets it, its second (--x) clears it.
    BooleanOptionalAction would read --no-x as the OFF form of an option x."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string == self.option_strings[0])


def build_parser() -> Parser:
    parser = Parser(
        prog="acc-trainer",
        usage="%(prog)s [options]  (or a command, listed at the end)",
        description="Train a model with one Accelerate loop on a CPU, one GPU, several GPUs or several machines.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_training_options(parser)
    return parser


def add_training_options(parser: argparse.ArgumentParser, summary: str | None = None) -> None:
    """--config and one option per TrainConfig field, in THEMES' groups. A sub-command gives a `summary`
    instead: it takes them all, and its --help shows that one line in their place."""
    hidden = summary is not None
    if hidden:
        parser.add_argument_group("training options", summary)
    help_text = "YAML file of options (names as below); flags override it"
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS if hidden else help_text)
    by_name = {f.name: f for f in fields(TrainConfig)}
    for theme, names in THEMES.items():
        group = parser if hidden else parser.add_argument_group(theme)
        for name in names:
            _add_option(group, by_name[name], hidden)


def _add_option(group, f, hidden: bool) -> None:
    flag = "--" + f.name.replace("_", "-")
    help_text = f.metadata["help"]
    if "(default:" not in help_text:  # some say what their default means themselves
        help_text += f" (default: {f.default if f.default is not MISSING else None})"
    help_text = argparse.SUPPRESS if hidden else help_text.replace("%", "%%")
    # Only flags actually given override the config file.
    common = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind.startswith("bool"):
        if f.name.startswith("no_"):
            group.add_argument(flag, "--" + flag[len("--no-"):], action=_OnOrOff, **common)
        else:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        return
    base = {"int": int, "float": float}.get(kind.split("|")[0].strip(), str)
    many = kind.replace(" ", "") == "str|list"  # --dataset, once for each set of a mixture (data/mixtures.py)
    group.add_argument(flag, type=base, choices=f.metadata.get("choices"), metavar=_metavar(f, base),
                       action="append" if many else "store", **common)


def _metavar(f, base) -> str:
    if "metavar" in f.metadata:
        return f.metadata["metavar"]
    choices = f.metadata.get("choices")
    if choices:
        return "{" + ",".join(choices) + "}"
    return {int: "N", float: "X"}.get(base, "TEXT")


def config_from(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed arguments: the flags given, over --config's file, over the defaults (a
    sub-command's own arguments are left out)."""
    values = vars(args)
    given = {f.name: values[f.name] for f in fields(TrainConfig) if f.name in values}
    base = load_yaml(values["config"]) if "config" in values else {}
    return make_config({**base, **given})


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    return config_from(build_parser().parse_args(argv))
