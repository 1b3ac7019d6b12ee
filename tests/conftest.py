"""Helpers to run acc_trainer the ways a user does: the CLI, `accelerate launch`, and the Python API."""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import pytest

# Two test files run at a time on two cores (pytest-xdist): each worker's own torch work runs on one
# thread, as the suite's subprocesses do (OMP_NUM_THREADS=1 in _env). Two OpenMP threads per worker
# wait for each other's descheduled thread, and a small run in a worker took 5-10x longer. Set before
# any test module imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
BIN = Path(sys.executable).parent


# The files that take longest, longest first (their seconds in a run of the suite here, 2026-11-28, probes and single
# commands forked): pytest runs with --no-loadscope-reorder (pyproject.toml), so pytest-xdist hands files out in this
# order and the longest ones cannot start last and run alone at the end while the other worker idles (its default
# order, most tests first, ended a run here with one worker on test_restarts.py for 75 s). test_deepspeed.py first: in
# a fresh virtual environment (CI's) its first launch builds DeepSpeed's CPU op, 75-120 s; 20 s here once built.
LONGEST_FIRST = ("test_deepspeed.py", "test_launch.py", "test_checkpoints.py", "test_trl_bench.py", "test_own_model.py",
                 "test_watchdog.py", "test_faults.py", "test_bench.py", "test_restarts.py", "test_lm_example.py",
                 "test_augment.py", "test_streams.py", "test_topology.py", "test_engines.py", "test_scale_out.py",
                 "test_data.py", "test_slurm.py", "test_check.py", "test_language_models.py", "test_grpo.py",
                 "test_sweep.py", "test_tasks.py", "test_readme.py", "test_cli.py", "test_text_streams.py",
                 "test_token_cache.py", "test_evaluation.py", "test_layout.py", "test_reports.py", "test_trackers.py",
                 "test_grpo_example.py", "test_dpo.py", "test_qlora.py", "test_micro_batch.py", "test_reward_model.py",
                 "test_lr_find.py", "test_finetune.py", "test_export.py", "test_judged.py", "test_chat.py",
                 "test_mixtures.py")


def pytest_collection_finish(session):
    """What the test modules imported (torch, transformers, peft, TRL, DeepSpeed...) is frozen out of the garbage
    collector's passes, in each test worker and in the processes forked from it (conftest.forked): a full collection
    over those objects took 0.5-1.1 s, 28 times in a run of the suite."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def _token_cache(tmp_path_factory):
    """Every run of the suite keeps its tokens in a folder of the session's (--token-cache auto reads
    ACC_TRAINER_CACHE), never in the user's ~/.cache; the suite's subprocesses inherit it through _env."""
    os.environ["ACC_TRAINER_CACHE"] = str(tmp_path_factory.mktemp("token-cache"))
    yield


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, **extra)
    return env


def run_cli(*args, cwd=None, timeout=300, command=None) -> subprocess.CompletedProcess:
    """`python -m acc_trainer ARGS` (or another console command) as a user runs it."""
    cmd = command or [sys.executable, "-m", "acc_trainer"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=_env())


def run_forked(*args, cwd=None, before=None, timeout=300) -> subprocess.CompletedProcess:
    """`acc-trainer ARGS` in a process of its own forked from this one, returning what run_cli returns: its exit code
    (negative where a signal ended it) and what it printed on its stdout and stderr (pipes, as run_cli reads them).
    The process starts from what a new one has: Accelerate's state, signal handlers, warnings' display, log handlers
    on its own stderr, the environment _env gives, torch on one thread, no GPU. BEFORE: a function run in that process
    first (a file size limit, say). No interpreter starts and nothing is imported again (2-3 s of CPU a run here); so
    what a new interpreter prints while importing, or a warning this process already showed once, is not printed
    again, and the process ends without the interpreter's teardown: how a command behaves from the shell (`python -m
    acc_trainer`, the console script, no traceback, no noise) stays run_cli's."""
    import selectors

    import torch

    if torch.cuda.is_initialized():  # a forked process cannot use it (the same holds for forked())
        raise RuntimeError("run_forked: this test process uses CUDA; run the command with run_cli")
    reads, writes = zip(os.pipe(), os.pipe())
    pid = os.fork()
    if pid == 0:  # the command's process: whatever happens in it, it never returns into the test
        try:
            _forked_command([str(a) for a in args], str(cwd or os.getcwd()), writes, before)
        finally:
            os._exit(70)
    command, printed = ["acc-trainer", *map(str, args)], {fd: b"" for fd in reads}
    try:
        for fd in writes:
            os.close(fd)
        deadline, selector = time.monotonic() + timeout, selectors.DefaultSelector()
        for fd in reads:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():  # until every process holding the pipes (the command's workers too) has closed them
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(command, timeout, printed[reads[0]], printed[reads[1]])
            for key, _ in selector.select(timeout=1):
                if chunk := os.read(key.fd, 1 << 16):
                    printed[key.fd] += chunk
                else:
                    selector.unregister(key.fd)
        ended = os.waitpid(pid, 0)[1]
    except BaseException:  # a timeout, Ctrl-C: the command does not outlive the test
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    finally:
        for fd in reads:
            os.close(fd)
    stdout, stderr = (printed[fd].decode(errors="backslashreplace") for fd in reads)
    return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(ended), stdout, stderr)


def _forked_command(argv: list[str], cwd: str, writes: tuple[int, int], before) -> None:
    """In run_forked's process: the command, its stdout and stderr into the pipes WRITES, its exit code the
    process's, as the interpreter ends on an error or SystemExit."""
    code, interrupted = 1, False
    try:
        _as_a_new_process(writes, cwd)
        if before is not None:
            before()
        from acc_trainer.cli import main

        main(argv)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # a message: printed, exit 1
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # the interpreter prints it, then ends by SIGINT
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught error
        traceback.print_exc()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _as_a_new_process(writes: tuple[int, int], cwd: str) -> None:
    """This forked process as a new one starts (see run_forked)."""
    previous = {id(stream): i for i, stream in enumerate((sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__))}
    for fd, pipe in zip((1, 2), writes):
        os.dup2(pipe, fd)
        os.close(pipe)
    streams = [open(fd, "w", buffering=1, closefd=False, errors=errors)  # noqa: SIM115
               for fd, errors in ((1, "strict"), (2, "backslashreplace"))]
    sys.stdout, sys.stderr = streams
    logging.root.handlers = []  # records as a new process prints them (warnings and up, on stderr)
    for logger in [logging.root, *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):  # a library's own handler (transformers'), made in this test
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in previous:
                handler.setStream(streams[previous[id(handler.stream)] % 2])
    importlib.reload(warnings)  # shown as a new interpreter shows them (pytest records them in a test)
    warnings._filters_mutated()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    env = _env(CUDA_VISIBLE_DEVICES="")  # a subprocess's environment
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    reset_accelerate()
    import torch

    torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args, launcher_args=(), target=("-m", "acc_trainer"), cwd=None, timeout=300, env=None, plain=False):
    """`acc-trainer launch LAUNCHER_ARGS -m acc_trainer ARGS` on a free port (`accelerate launch` with PLAIN).
    Both run Accelerate's launch command; `accelerate launch` first imports every other command of Accelerate's
    (with timm and transformers installed, 3.5 s more a launch on this CPU), so the suite launches the other way
    except where it proves that `accelerate launch` itself works."""
    launcher = [str(BIN / "accelerate"), "launch"] if plain else [str(BIN / "acc-trainer"), "launch"]
    cmd = [*launcher, "--main_process_port", str(free_port()), *map(str, launcher_args), *target, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=_env(**(env or {})))


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
    return result


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def weights(folder: Path) -> dict:
    """A run folder's final weights: its adapter (adapter_model.safetensors) where it trained LoRA, else its model."""
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(folder / name)


def distance(a: dict, b: dict) -> float:
    """The largest difference of two state dicts with the same names."""
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def reset_accelerate() -> None:
    """Accelerate's process-wide singletons back to nothing, as in a new process."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def forked(run, *args, processes: int = 2, config: Path | None = None, output: Path | None = None) -> None:
    """`run(*args)` on PROCESSES processes forked from this one (acc_trainer.launch_in_notebook: a gloo group on the
    CPU, on one thread each): for a probe whose subject is what the processes compute, not how they were started.
    No interpreter starts and nothing is imported again (torch, Accelerate and transformers: 2-6 s of CPU a process
    here). How users start their processes (accelerate launch, acc-trainer launch, torchrun, a config file, a
    script) is tested in tests/test_launch.py, test_own_model.py and test_restarts.py. As a launched probe does, the
    processes keep one group for all of `run`'s jobs. CONFIG: an accelerate config file, whose variables (FSDP's, say)
    the processes get as `accelerate launch --config_file CONFIG` gives them. OUTPUT: a file that gets what the
    processes print (stdout and stderr), as a launch's output does."""
    from unittest import mock

    from acc_trainer import launch_in_notebook

    reset_accelerate()
    try:
        with one_thread(), mock.patch.dict(os.environ, _launch_variables(config, processes) if config else {}):
            launch_in_notebook(_one_group, (output, run, *args), num_processes=processes, use_port=str(free_port()))
    finally:
        reset_accelerate()


def _launch_variables(config: Path, processes: int) -> dict:
    """The ACCELERATE_* and FSDP_* variables `accelerate launch --config_file CONFIG` sets, as Accelerate computes them."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config), "--num_processes", str(processes), "probe"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_")) and os.environ.get(k) != v}


def forked_cli(*args, processes: int = 2, cwd=None, config: Path | None = None, output: Path | None = None) -> str | None:
    """`acc-trainer ARGS` on PROCESSES processes forked from this one (see forked), in folder CWD: each ends as the
    command line ends a process of a launch (exit 0 once the run is saved); a process that fails fails the call.
    With OUTPUT: returns what the processes printed there (stdout and stderr as one)."""
    forked(_command_line, [str(a) for a in args], str(cwd or os.getcwd()), processes=processes, config=config,
           output=output)
    return None if output is None else Path(output).read_text()


def _command_line(argv: list[str], cwd: str) -> None:
    from acc_trainer import patches
    from acc_trainer.cli import main

    # The command line ends a launched process with os._exit (patches.leave_without_teardown), before torch's forked
    # worker hands its result to the launcher, which then waits for it: this process returns instead.
    patches.leave_without_teardown = lambda code: None
    os.chdir(cwd)
    main(argv)


def _one_group(output: Path | None, run, *args) -> None:
    """In each forked process: `run(*args)`, every fit() in the one process group (a launched probe's too), what it
    prints into OUTPUT."""
    from accelerate import PartialState

    if output is not None:
        sys.stdout = sys.stderr = open(output, "a", buffering=1)  # noqa: SIM115 - the process's own, to its end
        logging.root.handlers = []  # pytest's capture of log records: a launched process prints them on stderr

    PartialState.destroy_process_group = lambda self, group=None: None  # this process's own copy of the class
    run(*args)
    PartialState().wait_for_everyone()


@contextlib.contextmanager
def one_thread():
    """torch on one thread meanwhile, as the suite's subprocesses run (OMP_NUM_THREADS=1): a run in this
    process then computes bit for bit what the same run in a subprocess computes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def torch_on_one_thread():
    """The test's own torch work on one thread (see one_thread): with two test workers on a 2-core machine,
    two threads each leave OpenMP waiting for a descheduled thread, and a small run takes 5-10x longer."""
    with one_thread():
        yield


def run_here(*args, cwd=None) -> subprocess.CompletedProcess:
    """`acc-trainer ARGS` through acc_trainer.cli.main in this process (on one thread, in CWD, Accelerate's
    state fresh before and after), for module-scoped fixtures: returns what run_cli returns, the exit code
    and what was printed on stdout and stderr."""
    from acc_trainer.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    reset_accelerate()
    try:
        os.chdir(cwd or here)
        with one_thread(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(a) for a in args])
                code = 0
            except SystemExit as e:
                code = 0 if e.code is None else e.code
    finally:
        os.chdir(here)
        reset_accelerate()
    return subprocess.CompletedProcess(["acc-trainer", *map(str, args)], code, out.getvalue(), err.getvalue())


@pytest.fixture
def train_in_process(tmp_path):
    """Runs `acc_trainer.train` in this process, one run after another, as the API user does."""
    from accelerate.state import AcceleratorState, GradientState

    from acc_trainer.config import make_config
    from acc_trainer.training.api import train

    count = 0

    def run(**options):
        nonlocal count
        count += 1
        # Accelerate keeps its state in process-wide singletons; a fresh run starts from a clean one.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        options = {"output_dir": str(tmp_path / f"run{count}"), "progress": "none", **options}
        return train(make_config(options))

    yield run
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def main_in_process(capsys, tmp_path, monkeypatch):
    """`acc-trainer ARGS` through acc_trainer.cli.main in this process: (exit code, stdout, stderr)."""
    from accelerate.state import AcceleratorState, GradientState

    from acc_trainer.cli import main

    monkeypatch.chdir(tmp_path)

    def run(*args):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    yield run
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project folder (tests/user_project.py writes its files), the current folder of the test;
    its modules are forgotten afterwards, as a new process would."""
    import user_project

    user_project.write(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in user_project.MODULES:
        sys.modules.pop(name, None)
