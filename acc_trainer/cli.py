"""The command line: `acc-trainer [options]` / `python -m acc_trainer [options]` trains;
`acc-trainer report RUN_DIR ...` compares runs; `acc-trainer bench ...` measures speed (`bench-lm`: on a
language model, against the Hugging Face Trainer and a plain Accelerate loop).

`acc-trainer check` proves the guarantees on a workload; `acc-trainer check-data` reads every sample;
`acc-trainer launch ...` is `accelerate launch ...` with the trainer's exit codes (launching.py).
`acc-trainer export RUN_DIR --format ...` writes a run's model as ONNX, pt2 or safetensors (exporting.py);
`acc-trainer rerun RUN_DIR` trains a run again from its config.yaml (reruns.py).
`acc-trainer sweep SPACE.yaml` searches options with Optuna, each trial a run in its own process (tools/sweep.py).
`acc-trainer lr-find [options]` runs the learning-rate range test and suggests a learning rate (tools/lr_find.py).
`acc-trainer consolidate CHECKPOINT OUT` writes any engine's checkpoint as whole weights (after_training/consolidating.py).
The flags are built from `TrainConfig` (flags.py); the sub-commands live in the tools sub-package,
imported only when named. A user mistake prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import gc
import os
import sys

from .config import ConfigError, did_you_mean, first_line
from .flags import parse_config

COMMANDS = ("launch", "report", "bench", "bench-lm", "check", "check-data", "evaluate", "predict", "export", "rerun", "sweep",
            "lr-find", "consolidate")


def check_data(argv: list[str]) -> None:
    """`acc-trainer check-data [options]`: opens every sample of the dataset the options name, once, and
    lists those that cannot be read (or that --collate cannot batch); exit 1 when there are some."""
    from .data.faults import unreadable_samples
    from .data.streams import read_through
    from .outputs.progress import make_console
    from .workload.components import build_batching, build_data

    cfg = parse_config(argv)
    data = build_data(cfg)
    collate, _ = build_batching(cfg.collate, None)
    console, bad = make_console(), 0
    for split, dataset, kind in (("training", data.train, data.kind.train), ("evaluation", data.eval, data.kind.eval)):
        if dataset is None:
            continue
        if kind.stream:  # read to its end; a read error ends it there
            count, problems = read_through(dataset, collate)
            bad += len(problems)
            for problem in problems:
                console.print(f"unreadable {split} stream: {problem}", markup=False)
            console.print(f"{split}: {count} samples read from the stream", markup=False)
            continue
        names = unreadable_samples(dataset, collate)
        bad += len(names)
        for name in names:
            console.print(f"unreadable {split} sample: {name}", markup=False)
        console.print(f"{split}: {len(dataset) - len(names)} of {len(dataset)} samples read")
    if bad:
        sys.exit(1)


SUBCOMMANDS = ("report", "launch", "check-data", "evaluate", "predict", "check", "bench", "bench-lm", "export", "sweep",
               "lr-find", "consolidate")


def sub_command(name: str):
    """The function of sub-command `name`, its module imported only now (the tools' among them)."""
    if name == "report":
        from .tools.report import main as report

        return report
    if name == "launch":
        import accelerate.commands.launch  # noqa: F401 - the launcher's imports, before collection starts (imported())

        from .distributed.launching import main as launch

        return launch
    if name == "check-data":
        return check_data
    if name in ("evaluate", "predict"):
        from .after_training.inference import main_evaluate, main_predict

        return main_evaluate if name == "evaluate" else main_predict
    if name == "export":
        from .after_training.exporting import main as export

        return export
    if name == "check":
        from .tools.check import main as check

        return check
    if name == "bench":
        from .tools.bench import main as bench

        return bench
    if name == "sweep":
        from .tools.sweep import main as sweep

        return sweep
    if name == "lr-find":
        from .tools.lr_find import main as lr_find

        return lr_find
    if name == "consolidate":
        from .after_training.consolidating import main as consolidate

        return consolidate
    from .tools.lm_bench import main as bench_lm  # acc_trainer against the Hugging Face Trainer on a language model

    return bench_lm


def command() -> None:
    """The `acc-trainer` command and `python -m acc_trainer`: `main`, in a process that then ends."""
    gc.disable()  # the process is the command's own: no garbage collection until its modules are imported
    try:
        main(own_process=True)
    finally:
        # The process ends next. torch leaves about a million objects, and the interpreter's last garbage
        # collection over them takes 0.3 s on a 2-core CPU (of 0.45 s to exit); frozen, they are left out of it.
        # atexit handlers and files still close as before; only garbage in reference cycles goes unfinalised.
        gc.freeze()


def imported(own_process: bool) -> None:
    """The command's modules are imported: in the command's own process (command()), the objects they made are
    frozen, out of every later garbage collection, and collection starts. torch, Accelerate and the libraries they
    import make about a million objects; the collections over them as they were made took 0.4 s of the 2.7 s of
    `acc-trainer --model mlp --max-steps 2` here. Called from main() in another process (a test's, a user's), it
    changes nothing."""
    if own_process:
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None, own_process: bool = False) -> None:
    rank = os.environ.get("RANK")
    several = rank is not None and os.environ.get("WORLD_SIZE", "1") != "1"
    try:
        argv = sys.argv[1:] if argv is None else argv
        if argv[:1] and argv[0] in SUBCOMMANDS:
            command_of = sub_command(argv[0])
            imported(own_process)
            return command_of(argv[1:])
        train_from_command_line(argv, several, own_process)
    except ConfigError as e:
        exit_on_bad_input(e, rank, several)
    except Exception as e:
        exit_if_stopped(e, rank, several)
        raise


def train_from_command_line(argv: list[str], several: bool, own_process: bool = False) -> None:
    """Training: the options parsed (or a run's own, `rerun RUN_DIR`), the run made, the process group left."""
    again = None  # `rerun RUN_DIR [options]`: training, from the run's own config.yaml (reruns.py)
    if argv[:1] == ["rerun"]:
        from .after_training.reruns import rerun_config

        again, cfg = rerun_config(argv[1:])
    elif argv and not argv[0].startswith("-"):  # training takes no positional argument: a mistyped command
        hint = did_you_mean(argv[0], COMMANDS) or f"; the commands are {', '.join(COMMANDS)}"
        raise ConfigError(f"unknown command {argv[0]!r}{hint}")
    else:
        cfg = parse_config(argv)
    from .patches import keep_freed_memory, leave_without_teardown
    from .training.api import train  # imported here so that --help and input errors answer at once

    imported(own_process)
    keep_freed_memory()  # the command's process is the trainer's own (docs/performance.md)
    summary = train(cfg)
    if again is not None:
        from .after_training.reruns import report_weights

        report_weights(again, cfg, summary)  # the main process says whether they are the run's, bit for bit
    if several:
        from accelerate import PartialState

        PartialState().destroy_process_group()  # the run is over; fit() leaves it to the script that called it
        leave_without_teardown(0)


def exit_on_bad_input(e: ConfigError, rank: str | None, several: bool) -> None:
    """A user mistake: one line on stderr (once, however many processes met it), exit code 2."""
    line = f"acc-trainer: error{f' (rank {rank})' if several else ''}: {e}"
    from .distributed.launching import tell_launcher

    # Every process meets the same bad input: under torch's launcher each hands its line over and only the
    # main process prints it; `acc-trainer launch` shows one that another machine's alone met (docs/scaling.md).
    # The main process prints before it hands the line over: a launcher that stops it in between has then
    # seen it printed, not handed over and never shown.
    if not several or rank == "0":
        print(line, file=sys.stderr)
        if several:
            tell_launcher(line)
    elif not tell_launcher(line):
        print(line, file=sys.stderr)
    if several:  # ends with 2, not with gloo's abort in the teardown, as a finished process does
        from .patches import leave_without_teardown

        leave_without_teardown(2)
    sys.exit(2)


def exit_if_stopped(e: Exception, rank: str | None, several: bool) -> None:
    """Exits with the stop's code when the run stopped (TrainingStopped), with 1 when another process was
    lost; returns for any other error, which the caller raises again."""
    from .distributed.processes import MainProcessFailed
    from .stopping import TrainingStopped, lost_contact

    if isinstance(e, TrainingStopped):
        exit_stopped(e, rank, several)
    if isinstance(e, MainProcessFailed):  # the failed process shows its own error, with its traceback
        print(f"acc-trainer: error (rank {rank}): {e}", file=sys.stderr)
        if several:
            from .patches import leave_without_teardown

            leave_without_teardown(1)
        sys.exit(1)
    if lost_contact(e):
        print(f"acc-trainer: error (rank {rank}): lost contact with another process, which died, hung or lost "
              f"its network (waited at most --dist-timeout): {first_line(e)}; continue from the last checkpoint with "
              f"--resume auto", file=sys.stderr)
        sys.exit(1)


def exit_stopped(e, rank: str | None, several: bool) -> None:
    """A stopped run: its reason printed once, every process leaving together with the stop's code."""
    if not several or rank == "0":  # every process stops together, for the same reason
        print(f"acc-trainer: {e}", file=sys.stderr)
    if several and not e.alone:
        # The others wait for the main process (plots, message): a launcher that sees one
        # process exit ends the rest at once.
        import torch.distributed as dist

        dist.barrier()
    if several:
        from .patches import leave_without_teardown

        leave_without_teardown(e.code)
    sys.exit(e.code)


if __name__ == "__main__":
    command()
