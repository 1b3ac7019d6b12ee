"""The command line: `acc-trainer [options]` / `python -m acc_trainer [options]` trains;
`acc-trainer report RUN_DIR ...` compares runs; `acc-trainer bench ...` measures speed.

Options come from the fields of `TrainConfig` (their help text is the documentation). Values are
taken in this order, later winning: defaults, `--config FILE` (YAML), flags on the command line.
A user mistake prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING, fields

from .config import ConfigError, TrainConfig, first_line, load_yaml, make_config

EXAMPLES = """\
commands:
  acc-trainer [options]                                train (the options below)
  acc-trainer report RUN_DIR [RUN_DIR ...]             compare runs: a table and a figure (report --help)
  acc-trainer bench [--processes 1,2] [options]        speed vs hand-written loops, 1 and N processes (bench --help)
  acc-trainer check [--steps N] [options]              prove the job trains the same on 1 and 2 processes and resumes exactly
  acc-trainer check-data [options]                     open every sample once; list those that cannot be read

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


def check_data(argv: list[str]) -> None:
    """`acc-trainer check-data [options]`: opens every sample of the dataset the options name, once, and
    lists those that cannot be read; exit 1 when there are some."""
    from .components import build_data
    from .data import unreadable_samples
    from .progress import make_console

    cfg = parse_config(argv)
    data = build_data(cfg)
    console, bad = make_console(), 0
    for split, dataset in (("training", data.train), ("evaluation", data.eval)):
        if dataset is None:
            continue
        names = unreadable_samples(dataset)
        bad += len(names)
        for name in names:
            console.print(f"unreadable {split} sample: {name}", markup=False)
        console.print(f"{split}: {len(dataset) - len(names)} of {len(dataset)} samples read")
    if bad:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    rank = os.environ.get("RANK")
    several = rank is not None and os.environ.get("WORLD_SIZE", "1") != "1"
    try:
        argv = sys.argv[1:] if argv is None else argv
        if argv[:1] == ["report"]:
            from .report import main as report

            return report(argv[1:])
        if argv[:1] == ["check-data"]:
            return check_data(argv[1:])
        if argv[:1] == ["check"]:
            from .proofs import main as check

            return check(argv[1:])
        if argv[:1] == ["bench"]:
            from .bench import main as bench

            return bench(argv[1:])
        cfg = parse_config(argv)
        from .loop import train  # imported here so that --help and input errors answer at once

        train(cfg)
    except ConfigError as e:
        where = f" (rank {rank})" if several else ""
        print(f"acc-trainer: error{where}: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        from .stopping import TrainingStopped, lost_contact

        if isinstance(e, TrainingStopped):
            if not several or rank == "0":  # every process stops together, for the same reason
                print(f"acc-trainer: {e}", file=sys.stderr)
            if several and not e.alone:
                # The others wait for the main process (plots, message): a launcher that sees one
                # process exit ends the rest at once.
                import torch.distributed as dist

                dist.barrier()
            sys.exit(e.code)
        if lost_contact(e):
            print(f"acc-trainer: error (rank {rank}): lost contact with another process, which died, hung or lost "
                  f"its network (waited at most --dist-timeout): {first_line(e)}; continue from the last checkpoint with "
                  f"--resume auto", file=sys.stderr)
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
