"""The guarantee rows of `acc-trainer check` (check.py): each guarantee judged from the short runs (their weights,
samples and summaries), with the likely cause and fix of a failure; and what every row shares: its results (PASS, FAIL,
SKIPPED), its form (row), the weights' difference and the printed table.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"


def max_difference(a: dict, b: dict) -> float:
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()),
               default=0.0)


def rows_for(base, nudged, again, accum, resumed, two, synced, has_bn, cfg, half, world, folder: Path) -> list[dict]:
    """The table's rows: topology and accumulation against the 1-process run, the samples, the
    evaluation counts, the resume, determinism and BatchNorm."""
    return [*_equivalence_rows(base, nudged, accum, two, has_bn, cfg, world), _samples_row(base, two, world),
            _evaluation_row(base, two, world), _resume_row(base, resumed, half), _determinism_row(base, again),
            _unused_row(base, world, folder, half),
            *_batchnorm_rows(base, two, synced, has_bn, cfg, world)]


def _equivalence_rows(base, nudged, accum, two, has_bn, cfg, world) -> list[dict]:
    """N processes and --grad-accum 2 against 1 process, within what a 1-ulp nudge of the start moves."""
    rows = []
    chaos = max_difference(base["weights"], nudged["weights"]) if not nudged["error"] else math.inf
    tolerance = max(1e-5, 10 * chaos)
    chaotic = f"; a 1-ulp nudge of the initial weights moves it {chaos:.1e}"

    def compare(name: str, job: dict | None, cause: str, fix: str) -> None:
        if job is None:
            rows.append(row(name, SKIPPED, "not applicable", ""))
        elif job["error"]:
            rows.append(row(name, FAIL, job["error"], cause, fix))
        else:
            d = max_difference(base["weights"], job["weights"])
            result = PASS if d <= tolerance else FAIL
            rows.append(row(name, result, f"max parameter difference {d:.1e} (tolerance {tolerance:.0e}{chaotic})",
                            cause if result == FAIL else "", fix if result == FAIL else ""))

    draws = base.get("draws", False)
    compare(f"{world} processes vs 1", two, *_topology_cause(base, two, draws, has_bn and not cfg.sync_bn))
    compare("--grad-accum 2 vs 1 process", accum, *_topology_cause(base, accum, draws, has_bn))
    return rows


def _topology_cause(base: dict, other: dict | None, draws: bool, batchnorm: bool) -> tuple[str, str]:
    """Why another topology ends elsewhere than 1 process: the first cause the runs show, in this order:
    BatchNorm, random numbers drawn in forward, other samples, a loss averaged over each micro-batch's
    positions; else what was ruled out."""
    if batchnorm:
        return ("BatchNorm normalises each process's (or micro-batch's) share of the batch separately",
                "--sync-bn for processes; larger micro-batches, or a model without BatchNorm, for accumulation")
    if draws:
        return ("the model draws random numbers in forward (dropout, torch.rand without a generator): each process "
                "draws its own masks, so the runs see the same samples and the same expected gradient but not the same "
                "masks", "turn dropout off to check the rest; draw from a torch.Generator seeded per sample to match")
    if other is not None and not other["error"] and _all_samples(base) != _all_samples(other):
        return ("the samples differ between the runs (see the samples row)", "make each sample a function of (seed, "
                "index) only")
    if base["summary"].get("loss_per") == "position":
        return ("the loss is a mean over each micro-batch's positions (tokens, pixels, labels of -100 left out), whose "
                "number differs between micro-batches: each micro-batch weighs the same, not each position",
                "return (sum, count) from the loss, or leave the loss to the model (its own token loss is counted per "
                "token)")
    return ("not BatchNorm, not random numbers, the samples are the same: the loss or the model depends on how the batch "
            "is split (a mean over a varying number of items such as boxes or tokens, statistics over the batch)",
            "return (sum, count) from the loss for items; compute per-sample values otherwise")


def _all_samples(job: dict) -> list:
    return sorted(sample for call in job["samples"] for sample in call)


def _unused_row(base: dict, world: int, folder: Path, half: int) -> dict:
    """Parameters the first samples leave without a gradient, measured over the run: those still unchanged
    between the half-way checkpoint and the end never trained (a layer the forward never calls); those that
    changed are used by some batches only (a conditional branch), which trains."""
    from safetensors.torch import load_file

    name = "every parameter gets a gradient"
    unused = base["summary"].get("unused_parameters") or []
    if not unused:
        return row(name, PASS, "all parameters used by the first samples' backward pass", "")
    # A compiled model's checkpoint names its weights through the compile wrapper (`_orig_mod.`).
    halfway = {k.removeprefix("_orig_mod."): v for k, v in
               load_file(folder / "base" / "checkpoints" / f"step-{half:08d}" / "model.safetensors").items()}
    final = base["weights"]
    unknown = [n for n in unused if n not in halfway or n not in final]  # tied weights are stored once
    still = [n for n in unused if n not in unknown and torch.equal(halfway[n], final[n])]
    ddp = f"; {world} processes train with DDP's find_unused_parameters"
    if unknown and not still:
        return row(name, SKIPPED, f"{len(unused)} without a gradient from the first samples ({_names(unused)}); "
                                  f"{_names(unknown)} could not be compared (not in the saved files by that name){ddp}", "")
    if not still:
        return row(name, PASS, f"{len(unused)} without a gradient from the first samples ({_names(unused)}) but "
                               f"trained later (used by some batches only){ddp}", "")
    return row(name, FAIL, f"{len(still)} never trained ({_names(still)}): no gradient from the first samples and "
                           f"unchanged from step {half} to step {base['summary']['steps']}{ddp}",
               "a layer the forward never calls",
               "remove it, or freeze it (requires_grad=False), to train without find_unused_parameters")


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _samples_row(base, two, world) -> dict:
    name = "same start, same samples at every step"
    if two["error"]:
        return row(name, FAIL, two["error"], "the processes do not build the same data or model",
                   "build them from the seed only")
    different = [i for i, (a, b) in enumerate(zip(base["samples"], two["samples"])) if a != b]
    if different:
        return row(name, FAIL, f"{len(different)} of {len(base['samples'])} steps saw other samples on {world} "
                               f"processes than on 1 (first: step {different[0] + 1})",
                   "the data depends on the process: a random transform drawing from each process's generator, or a "
                   "dataset that reads other files per process", "make each sample a function of (seed, index) only")
    differed = any("initial weights differed" in note for note in two["summary"].get("notes") or [])
    return row(name, PASS, f"{len(base['samples'])} steps, identical samples" +
               ("; initial weights differed, process 0's were used" if differed else ""), "")


def _evaluation_row(base, two, world) -> dict:
    name = "evaluation counts every sample once"
    expected = base["summary"]["eval_samples"] if base["summary"]["eval"] else None
    if expected is None:
        return row(name, SKIPPED, "no evaluation set", "")
    if two["error"]:
        return row(name, FAIL, two["error"], "", "")
    counts = (base["summary"]["eval_samples"], two["summary"]["eval_samples"])
    ok = counts[0] == counts[1] == expected
    return row(name, PASS if ok else FAIL, f"{counts[0]} samples on 1 process, {counts[1]} on {world}",
               "" if ok else "padding counted")


def _resume_row(base, resumed, half) -> dict:
    name = f"stopped at step {half} and resumed"
    if resumed["error"]:
        return row(name, FAIL, resumed["error"], "", "")
    d = max_difference(base["weights"], resumed["weights"])
    if d == 0:
        return row(name, PASS, "bit-identical", "")
    return row(name, FAIL, f"max parameter difference {d:.1e}", *RESUME_CAUSE)


RESUME_CAUSE = ("random numbers drawn where a checkpoint cannot restore them: in a dataset's __getitem__ (the loader "
                "reads a batch ahead of the step a checkpoint records), from a generator of the dataset's own, or from "
                "NumPy/Python state seeded at import", "draw from torch's generator, or from one seeded per sample")


def _determinism_row(base, again) -> dict:
    d = max_difference(base["weights"], again["weights"])
    if d == 0:
        return row("the same run twice", PASS, "bit-identical", "")
    layer = max(base["weights"], key=lambda k: (base["weights"][k].double() - again["weights"][k].double())
                .abs().max().item())
    return row("the same run twice", FAIL, f"max parameter difference {d:.1e}, largest in {layer}",
               "a non-deterministic operation (atomic adds on GPUs, an unseeded random source)",
               "torch.use_deterministic_algorithms(True) names the operation")


def _batchnorm_rows(base, two, synced, has_bn, cfg, world) -> list[dict]:
    name = "BatchNorm across processes"
    if not has_bn:
        return [row(name, SKIPPED, "the model has no BatchNorm", "")]
    if cfg.sync_bn:
        return [row(name, PASS, "--sync-bn: statistics over all processes", "")]
    if not two["error"] and synced and not synced["error"]:
        d, ds = max_difference(base["weights"], two["weights"]), max_difference(base["weights"], synced["weights"])
        return [row(name, FAIL, f"{world} processes vs 1: {d:.1e} without --sync-bn, {ds:.1e} with it",
                    "each process normalises with its own share of the batch", "add --sync-bn")]
    return []


def row(check_name: str, result: str, measured: str, cause: str, fix: str = "") -> dict:
    return {"check": check_name, "result": result, "measured": measured, "cause": cause, "fix": fix}


def table(rows: list[dict]):
    from rich.table import Table

    out = Table(title="acc_trainer check", title_justify="left")
    for column in ("check", "result", "measured", "likely cause and fix"):
        out.add_column(column, overflow="fold")
    colours = {PASS: "green", FAIL: "bold red", SKIPPED: "yellow"}
    for r in rows:
        advice = "; ".join(x for x in (r["cause"], f"fix: {r['fix']}" if r["fix"] else "") if x)
        out.add_row(r["check"], f"[{colours[r['result']]}]{r['result']}[/]", r["measured"], advice)
    return out
