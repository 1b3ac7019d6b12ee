"""`acc-trainer launch ARGS`: `accelerate launch ARGS`, ending as a command line should (docs/scaling.md).

Accelerate's launch command runs in this process, unchanged; only its ending is translated. Stopped by a
signal (a scheduler's SIGTERM, Ctrl-C): exit 128 + the signal, and the trainer's own line ("stopped by
SIGTERM at step ...") is all that is printed. Bad input: exit 2, the main process's one line. A process
that failed otherwise: its exit code and one line naming it (its own output above says why). torch elastic's
launcher, which Accelerate runs for several processes, would exit 1 with a traceback in each case. For one
process Accelerate's plain launcher runs, which passes no SIGTERM on: run `acc-trainer` itself there.

Every process of a run hands its bad-input line to the launcher (`tell_launcher`) and only the main process
prints it: one line for any number of processes, and a line that another machine's processes alone met is
printed by that machine's launcher.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

# torch elastic's log lines (torch 2.14) that say again what the run's processes or this command say; the rest
# (a process that had to be killed, a rendezvous problem) is kept. Reworded in another torch, they show again
# (tests/test_checkpoints.py's SIGTERM test then fails: it wants the trainer's line alone).
_SAID_ALREADY = {
    "torch.distributed.elastic.agent.server.api": {"Received %s death signal, shutting down workers"},
    "torch.distributed.elastic.multiprocessing.api": {"Sending process %s closing signal %s",
                                                      "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"},
}


def _not_said_already(record: logging.LogRecord) -> bool:
    return record.msg not in _SAID_ALREADY.get(record.name, ())


def main(argv: list[str]) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = launch_command_parser()
    parser.prog, parser.usage = "acc-trainer launch", "acc-trainer launch [accelerate launch's arguments] -m acc_trainer ..."
    parser.description = ("Accelerate's launch command, ending with the trainer's exit codes (143 after SIGTERM, 130 after "
                          "Ctrl-C, 2 on bad input) and one line instead of the launcher's traceback. With --max_restarts N "
                          "a failed worker group is started again, up to N times, and continues from its last checkpoint "
                          "(give the trainer --resume auto): each attempt gets a rendezvous store of its own, set here "
                          "(docs/checkpoints.md#restarts).")
    args = parser.parse_args(argv)
    if args.max_restarts > 0:
        _restartable(args)
    for name in _SAID_ALREADY:
        logging.getLogger(name).addFilter(_not_said_already)
    try:
        launch_command(args)
    except SignalException as e:  # the launcher was signalled; it passed the signal on and waited for the processes
        sys.exit(128 + e.sigval)
    except KeyboardInterrupt:  # Ctrl-C before torch's launcher took the signal (no process yet), or to Accelerate's
        # one-process launcher, whose process got it too and stops on its own
        sys.exit(128 + signal.SIGINT)
    except ChildFailedError as e:
        sys.exit(_failed(e))
    except subprocess.CalledProcessError as e:  # one process, started by Accelerate's plain launcher
        sys.exit(_exit_code(e.returncode, "the process"))


def _restartable(args) -> None:
    """Restarts whose groups form. torch elastic hands every attempt one store its agent keeps (its static rendezvous,
    Accelerate's default, always; its c10d one unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), where a restarted attempt
    reads the dead one's addresses and fails ("Gloo connectFullMesh failed ... Connection refused") or hangs
    (pytorch/pytorch#135712; measured here on torch 2.14: 3 of 3 restarts failed). So this launcher takes the c10d
    rendezvous, at the main process's address and port on one machine, and sets the switch in its own environment,
    where torch's agent reads it."""
    if args.rdzv_backend == "static":
        args.rdzv_backend = "c10d"
        if not args.num_machines or int(args.num_machines) <= 1:
            args.rdzv_endpoint = f"{args.main_process_ip or '127.0.0.1'}:{args.main_process_port or 29500}"
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def _failed(error) -> int:
    """The exit code of a run whose processes failed (torch's ChildFailedError), after at most one line on stderr."""
    if any(f.exitcode == 2 for f in error.failures.values()):  # bad input, whichever process torch saw end first
        told = {r: f.message["message"] for r, f in error.failures.items() if isinstance(f.message, dict)}
        if told and 0 not in told:  # the main process prints its own; this one it never met (another machine's)
            print(told[min(told)], file=sys.stderr)
        return 2
    # The first failure decides: the launcher then stopped the others, which it reports as failed too.
    rank, first = error.get_first_failure()
    return _exit_code(first.exitcode, f"process {rank}")


def _exit_code(code: int, who: str) -> int:
    """A failed process's exit code as this command's: 2 (bad input) and 128 + SIGTERM/SIGINT (stopped) come
    from processes that printed why; anything else gets one line."""
    if code < 0:  # ended by a signal it did not handle: it printed nothing
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        print(f"acc-trainer: {who} was ended by {name}", file=sys.stderr)
        return 128 - code
    if code not in (2, 128 + signal.SIGTERM, 128 + signal.SIGINT):
        print(f"acc-trainer: {who} failed with exit code {code} (its own output above says why)", file=sys.stderr)
    return code


def tell_launcher(line: str) -> bool:
    """Hands a process's bad-input line to torch elastic's launcher (`accelerate launch` with several processes,
    torchrun), which reads it when the process has failed: in the reply file it gives each process
    (TORCHELASTIC_ERROR_FILE), in the layout torch's ErrorHandler writes. False, with nothing written, under
    another launcher."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    try:
        with open(path, "w") as file:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, file)
    except OSError:
        return False
    return True
