"""accelerate_configs/slurm.sbatch: the launch it builds on each machine, and a job that outlives its time limit.

SLURM is played by stand-ins written here: `sbatch` starts the job at once on this machine, `srun` runs the step's
task of each machine here and passes signals on as srun does, `scontrol` names the job's machines and records a
requeue."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from conftest import BIN, CONFIGS, _env, check, free_port, run_here, summary
from safetensors.torch import load_file

SCRIPT = CONFIGS / "slurm.sbatch"
JOB_ID = "4242"
# 24 steps (3 epochs of 8), a checkpoint every 4.
JOB = ["--model", "mlp", "--train-size", "512", "--eval-size", "128", "--batch-size", "64", "--epochs", "3",
       "--max-steps", "24", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--no-plots",
       "--checkpoint-every", "4"]

SRUN = f'''#!{sys.executable}
"""srun's stand-in: the task of each machine of the job runs here (SLURM_NODEID 0, 1, ...), one after another, in a
session of its own (a step of its own). As srun does, it passes USR1 on to every process of the step and turns a
SIGTERM into SIGKILL for them; it exits with the task's exit code."""
import os, signal, subprocess, sys
import psutil

args = sys.argv[1:]
while args[0].startswith("-"):
    args.pop(0)
task = None


def signal_every_process(signum):
    try:
        processes = [psutil.Process(task.pid), *psutil.Process(task.pid).children(recursive=True)]
    except (AttributeError, psutil.NoSuchProcess):
        return
    for process in processes:
        try:
            process.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


signal.signal(signal.SIGUSR1, lambda *_: signal_every_process(signal.SIGUSR1))
signal.signal(signal.SIGTERM, lambda *_: signal_every_process(signal.SIGKILL))
code = 0
for node in range(int(os.environ["SLURM_NNODES"])):
    task = subprocess.Popen(args, env={{**os.environ, "SLURM_NODEID": str(node)}}, start_new_session=True)
    task.wait()
    code = max(code, 128 - task.returncode if task.returncode < 0 else task.returncode)
sys.exit(code)
'''

SBATCH = '''#!/usr/bin/env bash
# sbatch's stand-in: the job starts at once, on this machine; the batch script runs in place of this process.
nodes=1
while [[ "$1" == -* ]]; do
    case "$1" in
        --nodes) nodes=$2; shift 2 ;;
        --nodes=*) nodes=${1#--nodes=}; shift ;;
        --time | --cpus-per-task | --gpus-per-node | --signal) shift 2 ;;  # the resources are this machine's
        *) shift ;;
    esac
done
export SLURM_JOB_ID=${SLURM_JOB_ID:-%s} SLURM_NNODES=$nodes SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-localhost}
exec bash "$@"
''' % JOB_ID

SCONTROL = '''#!/usr/bin/env bash
# scontrol's stand-in: records every call; `show hostnames A,B` names A and B.
echo "$*" >> "%s"
[[ "$1 $2" == "show hostnames" ]] && printf '%%s\\n' ${3//,/ }
exit 0
'''

# In the trainer's main process (not the launcher's, not the others'): the HOLD_AT-th backward pass waits (at most
# 60 s) for a SIGTERM, after writing HOLD_FILE, so that the test signals the job while it trains, whatever the speed
# of this machine. The other processes wait for it in their own backward's all-reduce; one that held too could get
# its SIGTERM before reaching its HOLD_AT-th pass and then hold for a signal that had come already, past the
# launcher's 30 s grace.
HOLD = '''import os
import sys
if (os.environ.get("HOLD_AT") and "--output-dir" in sys.orig_argv and "launch" not in sys.orig_argv
        and os.environ.get("RANK", "0") == "0"):
    import signal
    import time
    from pathlib import Path

    from accelerate import Accelerator

    backward, count = Accelerator.backward, [0]

    def held_backward(self, loss, **kwargs):
        count[0] += 1
        if count[0] == int(os.environ["HOLD_AT"]):
            told, trainers = [], signal.getsignal(signal.SIGTERM)

            def note(signum, frame):
                told.append(signum)
                if callable(trainers):
                    trainers(signum, frame)

            signal.signal(signal.SIGTERM, note)
            Path(os.environ["HOLD_FILE"]).touch()
            deadline = time.monotonic() + 60
            while not told and time.monotonic() < deadline:
                time.sleep(0.02)
        return backward(self, loss, **kwargs)

    Accelerator.backward = held_backward
'''


def stand_ins(tmp_path: Path, **more: str) -> Path:
    """A folder of SLURM's stand-ins (and MORE, name -> text) for the front of PATH."""
    folder = tmp_path / "slurm-bin"
    folder.mkdir(exist_ok=True)
    files = {"srun": SRUN, "sbatch": SBATCH, "scontrol": SCONTROL % (tmp_path / "scontrol.log"), **more}
    for name, text in files.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def slurm_command(tmp_path, *args, nodes=2, **env) -> list[list[str]]:
    """The launch command of each machine that `sbatch --nodes NODES slurm.sbatch ARGS` runs (ACC_TRAINER_DRY_RUN),
    on machines whose tools are only bash and grep: no nvidia-smi unless ENV's PATH gives one."""
    folder = stand_ins(tmp_path)
    for tool in ("bash", "grep"):
        (folder / tool).unlink(missing_ok=True)
        (folder / tool).symlink_to(shutil.which(tool))
    (folder / "acc-trainer").unlink(missing_ok=True)
    (folder / "acc-trainer").symlink_to(BIN / "acc-trainer")
    result = sbatch(folder, nodes, *args, **{"PATH": str(folder), "ACC_TRAINER_DRY_RUN": "1",
                                             "SLURM_JOB_NODELIST": "gpu-node-07,gpu-node-08",
                                             "SLURM_GPUS_ON_NODE": "4(IDX:0-3)", **env})
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines() if not line.startswith("slurm.sbatch:")]


def sbatch(folder: Path, nodes: int, *args, **env) -> subprocess.CompletedProcess:
    """`sbatch --nodes NODES slurm.sbatch ARGS` through the stand-in in FOLDER, in this environment and ENV (a
    variable None: left out), without SLURM's and Accelerate's own variables."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELERATE_"))}
    environment.update(env)
    environment = {k: v for k, v in environment.items() if v is not None}
    return subprocess.run([str(folder / "sbatch"), "--nodes", str(nodes), str(SCRIPT), *map(str, args)],
                          env=environment, capture_output=True, text=True, timeout=60)


def test_slurm_script_builds_the_launch_of_each_machine(tmp_path):
    out = tmp_path / "my run"
    # The first attempt and every requeued one: the same command, with --resume auto.
    commands = slurm_command(tmp_path, "--model", "resnet18", "--output-dir", out)
    assert commands == [["acc-trainer", "launch", "--multi_gpu", "--num_machines", "2", "--num_processes", "8",
                         "--machine_rank", rank, "--main_process_ip", "gpu-node-07", "--main_process_port",
                         str(20000 + int(JOB_ID)), "--rdzv_backend", "static", "--same_network", "-m", "acc_trainer",
                         "--model", "resnet18", "--output-dir", str(out), "--resume", "auto"] for rank in ("0", "1")]
    # Another engine comes from an accelerate config.
    fsdp = slurm_command(tmp_path, "--output-dir", out, ACCELERATE_CONFIG="accelerate_configs/fsdp.yaml")[0]
    assert fsdp[2:6] == ["--config_file", "accelerate_configs/fsdp.yaml", "--deepspeed_multinode_launcher", "standard"]
    assert fsdp[-2:] == ["--resume", "auto"]


def test_slurm_script_resumes_however_the_output_folder_is_given(tmp_path):
    out = tmp_path / "run"
    assert slurm_command(tmp_path, f"--output-dir={out}", nodes=1)[0][-3:] == [f"--output-dir={out}", "--resume", "auto"]
    config = tmp_path / "job.yaml"
    config.write_text(f"model: mlp\noutput_dir: {out}\ncheckpoint_every: 500\n")
    assert slurm_command(tmp_path, "--config", config, nodes=1)[0][-4:] == ["--config", str(config), "--resume", "auto"]
    assert slurm_command(tmp_path, f"--config={config}", nodes=1)[0][-2:] == ["--resume", "auto"]
    # A --resume of the user's own is left as it is, on the command line or in the config.
    for given in (["--resume", "auto"], [f"--resume={out}/checkpoints/step-00000500"]):
        assert slurm_command(tmp_path, "--output-dir", out, *given, nodes=1)[0][-len(given):] == given
    config.write_text(f"output_dir: {out}\nresume: {out}/checkpoints/step-00000500\n")
    assert slurm_command(tmp_path, "--config", config, nodes=1)[0][-2:] == ["--config", str(config)]


def test_slurm_script_launches_deepspeed_with_the_standard_launcher(tmp_path):
    """With Accelerate's default (pdsh) the first machine would start every machine's processes over ssh; with
    `standard` each machine's launch starts its own, through torch's launcher."""
    commands = slurm_command(tmp_path, "--output-dir", tmp_path / "run",
                             ACCELERATE_CONFIG=str(CONFIGS / "deepspeed.yaml"))
    # What Accelerate 1.15 makes of machine 1's command, without starting anything: its launch command decides in
    # these two functions (private ones: no public call answers which launcher a command gets).
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(commands[1][2:]))
    args.deepspeed_fields_from_accelerate_config = ""  # set by Accelerate's launch command before this call
    cmd, _ = prepare_deepspeed_cmd_env(args)
    assert (args.use_deepspeed, cmd) == (True, None)  # None: no `deepspeed --launcher pdsh` command
    assert (args.nnodes, args.node_rank, args.nproc_per_node, args.master_addr) == ("2", 1, "4", "gpu-node-07")


def test_slurm_script_on_machines_without_gpus(tmp_path):
    """No SLURM_GPUS_ON_NODE and no nvidia-smi: CPU processes, 1 per machine unless ACC_TRAINER_CPU_PROCESSES says."""
    out = tmp_path / "run"
    commands = slurm_command(tmp_path, "--output-dir", out, SLURM_GPUS_ON_NODE=None)
    assert [c[2:5] for c in commands] == [["--multi_gpu", "--num_machines", "2"]] * 2
    assert [c[5:7] for c in commands] == [["--num_processes", "2"]] * 2
    commands = slurm_command(tmp_path, "--output-dir", out, SLURM_GPUS_ON_NODE=None, ACC_TRAINER_CPU_PROCESSES="3")
    assert [c[5:7] for c in commands] == [["--num_processes", "6"]] * 2
    # One process in all: the trainer itself (Accelerate's launcher takes --multi_gpu for 2 processes or more).
    assert slurm_command(tmp_path, "--output-dir", out, nodes=1, SLURM_GPUS_ON_NODE=None) == [
        ["acc-trainer", "--output-dir", str(out), "--resume", "auto"]]
    # A machine whose nvidia-smi finds no GPU is one without GPUs; one that finds two starts two processes.
    folder = tmp_path / "smi"
    folder.mkdir()
    for lines, processes in (("echo 'No devices were found'; exit 6", "2"),
                             ("echo 'GPU 0: H100 (UUID: a)'; echo 'GPU 1: H100 (UUID: b)'", "4")):
        (folder / "nvidia-smi").write_text(f"#!/usr/bin/env bash\n{lines}\n")
        (folder / "nvidia-smi").chmod(0o755)
        commands = slurm_command(tmp_path, "--output-dir", out, SLURM_GPUS_ON_NODE=None,
                                 PATH=f"{tmp_path / 'slurm-bin'}:{folder}")
        assert commands[0][5:7] == ["--num_processes", processes]


def test_slurm_script_says_what_it_cannot_work_out(tmp_path):
    """One line on stderr and exit 2, before anything starts."""
    slurm_command(tmp_path, "--output-dir", tmp_path / "run")  # writes the stand-ins
    folder = tmp_path / "slurm-bin"
    base = {"PATH": str(folder), "ACC_TRAINER_DRY_RUN": "1", "SLURM_JOB_NODELIST": "gpu-node-07"}
    broken_smi = tmp_path / "broken"
    broken_smi.mkdir()
    (broken_smi / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'NVIDIA-SMI has failed because it could not "
                                           "communicate with the NVIDIA driver.'\nexit 9\n")
    (broken_smi / "nvidia-smi").chmod(0o755)
    expected = {
        "no output folder": ({}, ["--model", "mlp"], "give --output-dir (a folder every machine sees): a requeued "
                                                     "attempt continues from its checkpoints"),
        "a config that is not there": ({"ACCELERATE_CONFIG": "nowhere.yaml"}, ["--output-dir", "run"],
                                       f"ACCELERATE_CONFIG=nowhere.yaml: no such file (a path from {tmp_path})"),
        "a GPU count SLURM did not write": ({"SLURM_GPUS_ON_NODE": "gpu:4"}, ["--output-dir", "run"],
                                            "SLURM_GPUS_ON_NODE=gpu:4 on "),
        "a broken nvidia-smi": ({"PATH": f"{folder}:{broken_smi}"}, ["--output-dir", "run"],
                                "nvidia-smi failed on "),
        "a number of CPU processes that is not one": ({"ACC_TRAINER_CPU_PROCESSES": "all"}, ["--output-dir", "run"],
                                                      "ACC_TRAINER_CPU_PROCESSES=all is not a number of processes"),
    }
    for case, (env, args, message) in expected.items():
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELERATE_"))}
        result = subprocess.run([str(folder / "sbatch"), "--nodes", "1", str(SCRIPT), *args], capture_output=True,
                                text=True, timeout=60, cwd=tmp_path, env={**environment, **base, **env})
        assert result.returncode == 2, (case, result.stderr)
        assert result.stderr.startswith(f"slurm.sbatch: error: {message}") and result.stderr.count("\n") == 1, \
            (case, result.stderr)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", str(SCRIPT), "--output-dir", "run"], capture_output=True, text=True,
                            env=environment, timeout=60)  # not under sbatch
    assert (result.returncode, result.stderr) == (2, "slurm.sbatch: error: SLURM_JOB_ID, SLURM_NNODES or "
                                                     "SLURM_JOB_NODELIST is not set: submit this script with sbatch\n")


def live_job(tmp_path: Path, **more) -> dict:
    """The environment of a job on this machine, a machine whose nvidia-smi finds no GPU, with the HOLD hook."""
    folder = stand_ins(tmp_path, **{"nvidia-smi": "#!/usr/bin/env bash\necho 'No devices were found'\nexit 6\n"})
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HOLD)
    env = _env(PATH=f"{folder}:{BIN}:{os.environ['PATH']}", PYTHONPATH=str(tmp_path / "site"),
               MAIN_PROCESS_PORT=str(free_port()), HOLD_FILE=str(tmp_path / "held"), **more)
    return {k: v for k, v in env.items() if not k.startswith("SLURM_")}


def attempt(tmp_path: Path, env: dict, restarts: int, hold_at: int | None = None, signal_it=None):
    """One attempt of `sbatch --nodes 1 slurm.sbatch JOB --output-dir tmp_path/run` (SLURM_RESTART_COUNT=RESTARTS),
    signalled by SIGNAL_IT(the batch shell's pid) once held in its HOLD_AT-th step: (exit code, stdout, stderr)."""
    log, held = tmp_path / f"attempt-{restarts}", Path(env["HOLD_FILE"])
    more = {"SLURM_RESTART_COUNT": str(restarts), **({"HOLD_AT": str(hold_at)} if hold_at else {})}
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        job = subprocess.Popen([str(tmp_path / "slurm-bin" / "sbatch"), "--nodes", "1", str(SCRIPT), *JOB,
                                "--output-dir", str(tmp_path / "run")],
                               stdout=out, stderr=err, env={**env, **more}, start_new_session=True)
    try:
        if hold_at:
            deadline = time.monotonic() + 120
            while not held.exists():
                assert time.monotonic() < deadline and job.poll() is None, Path(f"{log}.err").read_text()
                time.sleep(0.05)
            held.unlink()
            signal_it(job.pid)
        job.wait(timeout=180)
    finally:
        if job.poll() is None:  # the trainer's processes run in sessions of their own
            for process in psutil.Process(job.pid).children(recursive=True):
                process.kill()
            job.kill()
    return job.returncode, Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text()


def test_a_job_at_its_time_limit_is_requeued_and_ends_as_if_uninterrupted(tmp_path):
    """Three attempts of one job on one machine (1 CPU process): the first gets SLURM's USR1 before its time limit
    in step 6, saves a checkpoint, stops and requeues itself; the second is preempted in step 14 (SIGTERM to its
    batch step, which srun turns into SIGKILL); the third continues from the step-12 checkpoint to the end. The
    final weights are the uninterrupted run's, bit for bit."""
    env, run = live_job(tmp_path), tmp_path / "run"

    # SLURM's --signal=B:USR1@120 signals the batch shell alone.
    code, out, err = attempt(tmp_path, env, 0, 6, lambda pid: os.kill(pid, signal.SIGUSR1))
    assert code == 143, err[-3000:]  # the batch script's exit code, as SLURM records it
    assert err.startswith("acc-trainer: stopped by SIGTERM at step 6; checkpoint saved in"), err[-3000:]
    assert out.splitlines()[-2:] == [
        "slurm.sbatch: USR1 (the time limit is near): stopping the run at a checkpoint, then requeueing the job",
        f"slurm.sbatch: requeued job {JOB_ID}: its next attempt continues from the checkpoint"], out
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["show hostnames localhost", f"requeue {JOB_ID}"]
    assert not (run / "summary.json").exists()

    # A preemption signals every process of the batch step: the batch shell and srun.
    code, out, err = attempt(tmp_path, env, 1, 8, lambda pid: os.killpg(pid, signal.SIGTERM))
    assert code == 137, err[-3000:]  # srun's SIGKILL: no checkpoint at the signal, and no requeue by the script
    assert f"resuming at step 6 from {run / 'checkpoints' / 'step-00000006'}" in out, out
    assert (tmp_path / "scontrol.log").read_text().count("requeue") == 1

    code, out, err = attempt(tmp_path, env, 2)
    assert code == 0, err[-3000:]
    assert f"job {JOB_ID}, attempt 3" in out and "resuming at step 12 from" in out, out
    assert summary(run)["resumed_from"] == str(run / "checkpoints" / "step-00000012")

    check(run_here(*JOB, "--output-dir", tmp_path / "uninterrupted"))  # one process: this one, on one thread
    final, reference = load_file(run / "model.safetensors"), load_file(tmp_path / "uninterrupted" / "model.safetensors")
    assert all(torch.equal(final[k], reference[k]) for k in reference)


def test_a_job_of_several_processes_stops_through_its_launcher(tmp_path):
    """2 CPU processes (ACC_TRAINER_CPU_PROCESSES=2) under `acc-trainer launch`: srun passes USR1 to every process
    of the step, which the launcher and the trainer's processes ignore; the launcher gets SIGTERM and passes it on,
    the processes agree on the step to stop at (the epoch's end, step 8), save a checkpoint and exit 143."""
    env, run = live_job(tmp_path, ACC_TRAINER_CPU_PROCESSES="2"), tmp_path / "run"
    code, out, err = attempt(tmp_path, env, 0, 6, lambda pid: os.kill(pid, signal.SIGUSR1))
    assert code == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"acc-trainer: stopped by SIGTERM at step 8; checkpoint saved in {run}/"
                                            f"checkpoints/step-00000008; continue with --resume auto --output-dir {run}")
    assert "2 process(es)" in out and f"requeued job {JOB_ID}" in out, out
    assert (tmp_path / "scontrol.log").read_text().splitlines()[-1] == f"requeue {JOB_ID}"
