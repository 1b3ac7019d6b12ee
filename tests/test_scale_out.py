"""Beyond one machine: two machines simulated on this one, the SLURM script, FSDP and DeepSpeed configs."""

from __future__ import annotations

import os
import shlex
import subprocess

from safetensors.torch import load_file

from conftest import BIN, CONFIGS, _env, check, free_port, launch, run_cli, summary

JOB = ["--model", "mlp", "--train-size", "1024", "--eval-size", "256", "--batch-size", "64", "--epochs", "2",
       "--max-steps", "24", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"]


def test_two_machines_train_like_one_process(tmp_path):
    """`accelerate launch --num_machines 2 --machine_rank 0|1` on 127.0.0.1, one CPU process each."""
    port = free_port()
    machines = [subprocess.Popen(
        [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_machines", "2", "--num_processes", "2",
         "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
         "-m", "acc_trainer", *JOB, "--output-dir", str(tmp_path / "two")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) for rank in (0, 1)]
    for machine in machines:
        _, stderr = machine.communicate(timeout=300)
        assert machine.returncode == 0, stderr[-3000:]
    check(run_cli(*JOB, "--output-dir", tmp_path / "one"))
    s = summary(tmp_path / "two")
    assert (s["world_size"], s["distributed_type"], s["ranks_agree"]) == (2, "MULTI_CPU", True)
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert max((one[k] - two[k]).abs().max().item() for k in one) <= 1e-5


def slurm_command(tmp_path, *args, **env) -> list[str]:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu-node-07\\ngpu-node-08\\n"\n')
    (fake / "scontrol").chmod(0o755)
    environment = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "ACC_TRAINER_ON_NODE": "1",
                   "ACC_TRAINER_DRY_RUN": "1", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4(IDX:0-3)",
                   "SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_JOB_ID": "123456", **env}
    result = subprocess.run(["bash", str(CONFIGS / "slurm.sbatch"), *map(str, args)], env=environment,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def test_slurm_script_builds_the_launch_of_each_machine(tmp_path):
    out = tmp_path / "my run"
    for rank in ("0", "1"):
        command = slurm_command(tmp_path, "--model", "resnet18", "--output-dir", out, SLURM_NODEID=rank)
        assert command == ["accelerate", "launch", "--multi_gpu", "--num_machines", "2", "--num_processes", "8",
                           "--machine_rank", rank, "--main_process_ip", "gpu-node-07", "--main_process_port",
                           "23456", "--rdzv_backend", "static", "--same_network", "-m", "acc_trainer",
                           "--model", "resnet18", "--output-dir", str(out)]
    # A requeued job continues from its checkpoint; another engine comes from an accelerate config.
    (out / "checkpoints" / "step-00000500").mkdir(parents=True)
    command = slurm_command(tmp_path, "--output-dir", out, SLURM_NODEID="0",
                            ACCELERATE_CONFIG="accelerate_configs/fsdp.yaml")
    assert command[2:4] == ["--config_file", "accelerate_configs/fsdp.yaml"]
    assert command[-2:] == ["--resume", "auto"]


def test_fsdp_on_cpu_is_refused_not_silently_ddp(tmp_path):
    """Accelerate enables FSDP only for GPU process groups; on CPU it would quietly train plain DDP."""
    result = launch(*JOB, "--output-dir", tmp_path / "run", launcher_args=["--config_file", CONFIGS / "fsdp.yaml"])
    assert result.returncode != 0
    assert ("acc-trainer: error (rank 0): FSDP was requested (accelerate config) but Accelerate set up MULTI_CPU on "
            "cpu: it enables FSDP for GPU processes only; use accelerate_configs/cpu_ddp.yaml on a CPU") in result.stderr
    assert not (tmp_path / "run").exists()
