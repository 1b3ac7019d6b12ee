"""Runs the acc_trainer command line and interrupts it at a chosen moment, as a scheduler would.

    python tests/interrupt.py [--signal TERM|INT|KILL --at N --rank R] [--kill-in-save N] [--poison I] -- ARGS

--signal/--at/--rank: process R sends itself the signal in its N-th backward pass (a micro-batch).
--kill-in-save N:     the main process is killed (SIGKILL) inside its N-th checkpoint write.
--poison I:           training sample I of the synthetic set is NaN (a runaway loss on one process).
Also under a launch (`acc-trainer launch`), one per process, and in a process forked from a test's (`prepare(OPTIONS)`
there: conftest.run_forked).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from accelerate import Accelerator


def main() -> None:
    cut = sys.argv.index("--")
    prepare([*map(str, sys.argv[1:cut])])
    from acc_trainer.cli import main as cli

    cli(sys.argv[cut + 1:])


def prepare(options: list[str]) -> None:
    """OPTIONS' interruptions, set up in this process (before the command line runs in it)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--signal", choices=("TERM", "INT", "KILL"))
    parser.add_argument("--at", type=int)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--kill-in-save", type=int)
    parser.add_argument("--poison", type=int)
    args = parser.parse_args(options)

    if args.signal:
        backward, count = Accelerator.backward, [0]

        def counting_backward(self, loss, **kwargs):
            count[0] += 1
            if count[0] == args.at and self.process_index == args.rank:
                os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))
            return backward(self, loss, **kwargs)

        Accelerator.backward = counting_backward

    if args.kill_in_save:
        save_state, saves = Accelerator.save_state, [0]

        def dying_save_state(self, output_dir=None, **kwargs):
            result = save_state(self, output_dir, **kwargs)
            saves[0] += 1
            if saves[0] == args.kill_in_save and self.is_main_process:
                os.kill(os.getpid(), signal.SIGKILL)  # the files are written, the checkpoint not yet complete
            return result

        Accelerator.save_state = dying_save_state

    if args.poison is not None:
        from acc_trainer.data import datasets as data

        synthetic = data.DATASETS["synthetic"]

        def poisoned(config):
            made = synthetic(config)
            made.train.tensors[0][args.poison] = float("nan")
            return made

        data.DATASETS["synthetic"] = poisoned


if __name__ == "__main__":
    main()
