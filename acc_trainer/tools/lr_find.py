"""`acc-trainer lr-find`: the learning-rate range test (training/lr_range.py) on the workload the training options
name, a copy of its starting weights trained for `--steps` optimizer steps as the learning rate grows from `--min-lr`
to `--max-lr`; prints the suggested learning rate and where the figure is (docs/lr-find.md).

    acc-trainer lr-find --model mlp --dataset synthetic --optimizer adamw
    cd examples && acc-trainer lr-find --model digits:DigitsNet --dataset digits:make_data --optimizer adamw --batch-size 64
"""

from __future__ import annotations

import argparse
import os

from ..config import TrainConfig
from ..flags import Parser, add_training_options, config_from


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="acc-trainer lr-find",
                    description="The learning-rate range test: a short run whose learning rate grows exponentially, "
                                "each step's loss recorded; suggests the rate where the smoothed loss falls fastest.")
    parser.add_argument("--min-lr", type=float, default=1e-7, help="the first step's learning rate (default: 1e-7)")
    parser.add_argument("--max-lr", type=float, default=1.0, help="the last step's learning rate (default: 1.0)")
    parser.add_argument("--steps", type=int, default=100,
                        help="optimizer steps, the rate multiplied by the same factor at each (default: 100)")
    add_training_options(parser, "every option of acc-trainer --help (--model, --dataset, --batch-size, --optimizer, "
                                 "--mixed-precision, ...) sets the workload; --output-dir is the test's folder "
                                 "(default: runs/lr-find-<time>-<model>-<dataset>); --lr, the schedule, evaluation and "
                                 "checkpoints are the test's own")
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, TrainConfig]:
    args = build_parser().parse_args(argv)
    return args, config_from(args)


def main(argv: list[str]) -> None:
    from ..training.api import range_test

    args, cfg = parse(argv)
    test = range_test(cfg, args.min_lr, args.max_lr, args.steps)
    several = os.environ.get("WORLD_SIZE", "1") != "1"
    if not several or os.environ.get("RANK") == "0":
        stop = f"; the loss {test.stop_reason} at step {test.stopped_at}" if test.stopped_at else ""
        print(f"suggested learning rate: {test.suggestion:.1e} (steepest descent of the smoothed loss{stop}); "
              f"figure: {test.figure}")
        print(f"train with it: acc-trainer --lr {test.suggestion:.1e} [the same options]; a starting point, not an "
              f"optimum (docs/lr-find.md)")
    if several:  # as training leaves (cli.train_from_command_line): the group dissolved, no teardown's abort
        from accelerate import PartialState

        from ..patches import leave_without_teardown

        PartialState().destroy_process_group()
        leave_without_teardown(0)
