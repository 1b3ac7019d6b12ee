"""The command-line flags: one per field of `TrainConfig`, whose help text is their documentation.

Values are taken in this order, later winning: defaults, `--config FILE` (YAML), flags on the command
line. A mistake raises ConfigError (one line on stderr and exit 2 from the CLI), never argparse's
usage block.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from .config import ConfigError, TrainConfig, load_yaml, make_config

EXAMPLES = """\
commands:
  acc-trainer [options]                                train (the options below)
  acc-trainer report RUN_DIR [RUN_DIR ...]             compare runs: a table and a figure (report --help)
  acc-trainer bench [--processes 1,2] [options]        speed vs hand-written loops, 1 and N processes (bench --help)
  acc-trainer check [--steps N] [options]              prove the job trains the same on 1 and 2 processes and resumes exactly
  acc-trainer check-data [options]                     open every sample once; list those that cannot be read
  acc-trainer evaluate RUN_DIR [--weights F] [--output F.json] [options]   a finished run's weights on any set
  acc-trainer predict RUN_DIR --output F.jsonl|.csv|.npz [options]         one row per sample, in order

examples:
  acc-trainer                                          default job: LeNet on generated images, ~30 s on a laptop CPU
  acc-trainer --model linreg --dataset linear --optimizer sgd --lr 0.01 --batch-size 32 --epochs 10
  acc-trainer --model resnet18 --dataset cifar10 --data-dir data --image-size 224 --batch-size 512 --optimizer sgd
  acc-trainer --model my_model:Net --model-args '{width: 64}' --dataset my_data:load      your own model and data
  acc-trainer --model torchvision:resnet50 --dataset imagefolder --data-dir photos --image-size 224
  accelerate launch --multi_gpu --num_processes 2 -m acc_trainer ...        2 GPUs, or 2 CPU processes without a GPU
  accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m acc_trainer ...
"""


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake raised as ConfigError (one line, exit 2) instead of its usage block."""

    def error(self, message: str):
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="acc-trainer",
        description="Train a model with one Accelerate loop on a CPU, one GPU, several GPUs or several machines.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only flags actually given override the config file
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file of options (names as below); flags override it")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        help_text = f"{f.metadata['help']} (default: {default})"
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind.startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
            continue
        base = {"int": int, "float": float}.get(kind.split("|")[0].strip(), str)
        parser.add_argument(flag, type=base, choices=f.metadata.get("choices"), metavar=_metavar(f, base),
                            help=help_text.replace("%", "%%"))
    return parser


def _metavar(f, base) -> str:
    if "metavar" in f.metadata:
        return f.metadata["metavar"]
    choices = f.metadata.get("choices")
    if choices:
        return "{" + ",".join(choices) + "}"
    return {int: "N", float: "X"}.get(base, "TEXT")


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    args = vars(build_parser().parse_args(argv))
    values = load_yaml(args.pop("config")) if "config" in args else {}
    values.update(args)
    return make_config(values)
