"""What each process of `acc-trainer bench-lm`'s loops against TRL measures (trl_bench.py): the `Counter` of tokens and
step times every loop process writes to its step log, and `logged_window`, a run's speed read from those logs."""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

STEPS_LOG = "bench-steps-rank{rank}.jsonl"

class Counter:
    """The tokens of each training forward of `model`, and the clock at each optimizer step, written by each process
    to `folder`/bench-steps-rank<R>.jsonl. The counts stay tensors until the end (no device sync per step); on a GPU
    the clock syncs at the two steps that bound the timing. For GRPO also what each loop's wrappers (`timed`) report:
    the completions generated (their tokens, their prompts) and the seconds spent sampling and in the rollout."""

    def __init__(self, model, mode: str, warmup: int, steps: int):
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.mode, self.bounds = mode, (warmup, steps)
        self.forwards: list = []  # (tokens, samples) of the forwards since the last step
        self.generation = {"generated": 0, "completions": 0, "generation_s": 0.0, "rollout_s": 0.0, "prompts": []}
        self.records: list[dict] = []
        self.setup: dict | None = None
        self.cuda = torch.cuda.is_available()
        model.register_forward_pre_hook(self._forward, with_kwargs=True)
        self._handle = register_optimizer_step_post_hook(self._step)

    def _forward(self, module, args, kwargs) -> None:
        import torch

        if not (module.training and torch.is_grad_enabled()):  # evaluation, or a reference model's forward
            return
        if self.setup is None:  # what both loops must share, read where it acts
            device = next(module.parameters()).device.type
            self.setup = {"autocast": torch.is_autocast_enabled(device) and str(torch.get_autocast_dtype(device)),
                          "gradient_checkpointing": bool(getattr(module, "is_gradient_checkpointing", False)),
                          "dropout": any(m.p > 0 for m in module.modules() if isinstance(m, torch.nn.Dropout)),
                          "threads": torch.get_num_threads()}
        if self.mode == "sft":
            labels = kwargs["labels"]
            self.forwards.append(((labels[:, 1:] != -100).sum(), labels.shape[0]))
        elif self.mode == "grpo":  # the completion tokens the loss counts; the prompts' are context
            if kwargs.get("labels") is not None:  # TRL: the completion tokens labelled, -100 elsewhere
                labels = kwargs["labels"]
                self.forwards.append(((labels != -100).sum(), labels.shape[0]))
            else:  # acc_trainer: the logits of the completion (+ 1) kept, its tokens the mask's there
                mask = kwargs["attention_mask"][:, 1 - kwargs["logits_to_keep"]:]
                self.forwards.append((mask.sum(), mask.shape[0]))
        else:  # chosen and rejected rows together (or one forward each): pairs are half the rows
            mask = kwargs["attention_mask"]
            self.forwards.append((mask.sum(), mask.shape[0] / 2))

    def _step(self, optimizer, args, kwargs) -> None:
        import torch

        if self.cuda and len(self.records) + 1 in self.bounds:
            torch.cuda.synchronize()
        if not self.records:
            group = optimizer.param_groups[0]
            self.setup = {**(self.setup or {}), "optimizer": type(optimizer).__name__, "lr": group["lr"],
                          "weight_decay": group["weight_decay"], "betas": list(group["betas"]),
                          "implementation": "fused" if group.get("fused") else "foreach" if group.get("foreach")
                          else "for-loop"}
        self.records.append({"step": len(self.records) + 1, "time": time.perf_counter(), "cpu": time.process_time(),
                             "forwards": self.forwards, **(self.generation if self.mode == "grpo" else {})})
        self.forwards = []
        self.generation = {"generated": 0, "completions": 0, "generation_s": 0.0, "rollout_s": 0.0, "prompts": []}

    def generated(self, lengths: list[int], prompts: list, seconds: float) -> None:
        """One sampling call's completions: each one's tokens (up to and with its end) and prompt's token ids."""
        g = self.generation
        g["generated"] += sum(lengths)
        g["completions"] += len(lengths)
        g["generation_s"] += seconds
        g["prompts"] += [" ".join(map(str, p)) for p in prompts]

    def rolled_out(self, seconds: float) -> None:
        self.generation["rollout_s"] += seconds

    def timed(self, owner, name: str, report) -> None:
        """Replaces owner.name (a function of a module or a class) with one that reports to this counter:
        report(seconds, result, *args, **kwargs), the seconds taken between device syncs on a GPU."""
        import torch

        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if self.cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            result = original(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            report(time.perf_counter() - started, result, *args, **kwargs)
            return result

        setattr(owner, name, wrapper)

    def write(self, folder: Path, rank: int) -> None:
        self._handle.remove()
        grpo = ("generated", "completions", "generation_s", "rollout_s")
        lines = [json.dumps({"step": r["step"], "time": r["time"], "cpu": r["cpu"],
                             "tokens": int(sum(int(t) for t, _ in r["forwards"])),
                             "samples": sum(s for _, s in r["forwards"]),
                             **({k: r[k] for k in grpo} | {"prompts": sorted(r["prompts"])} if "prompts" in r else {})})
                 for r in self.records]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STEPS_LOG.format(rank=rank)).write_text("\n".join([json.dumps({"setup": self.setup}), *lines]) + "\n")


def logged_window(folder: Path, warmup: int, steps: int) -> dict:
    """A run's speed from its processes' step logs: the tokens (and samples) of every process in steps warmup+1 ..
    steps, over rank 0's seconds from the end of step `warmup` to the end of step `steps`, and over the CPU seconds
    every process spent in them (`time.process_time`: the work, not the waits for a core another job holds); the
    warm-up's seconds from the end of step 1."""
    logs = sorted(folder.glob(STEPS_LOG.format(rank="*")), key=lambda p: int(p.stem.rpartition("rank")[2]))
    per_rank = [[json.loads(line) for line in p.read_text().splitlines()] for p in logs]
    setup = per_rank[0][0]["setup"]
    per_rank = [records[1:] for records in per_rank]
    for records in per_rank:
        if [r["step"] for r in records] != list(range(1, len(records) + 1)) or len(records) != steps:
            raise RuntimeError(f"{folder}: the step log has {len(records)} steps, not {steps}")
    clock = {r["step"]: r["time"] for r in per_rank[0]}
    timed = [r for records in per_rank for r in records if warmup < r["step"] <= steps]
    seconds = clock[steps] - clock[warmup]
    trained, generated = sum(r["tokens"] for r in timed), sum(r.get("generated", 0) for r in timed)
    tokens, samples = trained + generated, sum(r["samples"] for r in timed)
    cpu = sum(records[steps - 1]["cpu"] - records[warmup - 1]["cpu"] for records in per_rank)
    out = {"tokens": tokens, "samples": samples, "time_s": seconds, "tokens_per_s": tokens / seconds,
           "cpu_s": cpu, "tokens_per_cpu_s": tokens / cpu,
           "samples_per_s": samples / seconds, "warmup_s": clock[warmup] - clock[1], "world_size": len(per_rank),
           "setup": setup}
    if "prompts" in per_rank[0][0]:  # GRPO: what was generated, and each process's share of its seconds doing it
        def share(name: str) -> float:
            return statistics.mean(sum(r[name] for r in records[warmup:steps])
                                   / (records[steps - 1]["time"] - records[warmup - 1]["time"]) for records in per_rank)

        out.update({"trained_tokens": trained, "generated_tokens": generated,
                    "completions": sum(r["completions"] for r in timed),
                    "trained_tokens_per_s": trained / seconds, "generated_tokens_per_s": generated / seconds,
                    "generation_share": share("generation_s"), "rollout_share": share("rollout_s"),
                    "generation_s_per_step": statistics.mean(sum(r["generation_s"] for r in records[warmup:steps])
                                                             for records in per_rank) / (steps - warmup),
                    # every process's prompts of each step (one of each completion), as a digest to compare loops by
                    "prompts_by_step": [hashlib.sha1(json.dumps(sorted(p for records in per_rank
                                                                       for p in records[i]["prompts"])).encode())
                                        .hexdigest()[:16] for i in range(steps)],
                    "completions_by_step": [sum(records[i]["completions"] for records in per_rank)
                                            for i in range(steps)]})
    return out


