"""A run trained again from its own config.yaml: `acc-trainer rerun RUN_DIR [options]`.

The same as `acc-trainer --config RUN_DIR/config.yaml [options]` (config.yaml leaves out the run's folder and
whether it resumed: runfiles.NOT_RECORDED), into a new folder; the main process then says whether the new weights
are the run's, bit for bit, or how far and why they differ (options changed, another number of processes or
library versions). A run that fit() trained on objects is refused in one line naming them (runfiles.OBJECTS_NOTE):
its script runs it again.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError, TrainConfig, load_yaml
from ..outputs.checkpoints import damage, unverified
from ..outputs.runfiles import NOT_RECORDED, given_as_objects
from .inference import say_note, weights_name


def rerun_config(argv: list[str]) -> tuple[Path, TrainConfig]:
    """(RUN_DIR, the options to train: its config.yaml with the options given over it)."""
    from ..flags import Parser, add_training_options, config_from

    parser = Parser(prog="acc-trainer rerun", description="Train a run again from its config.yaml, into a new folder "
                    "(runs/<time>-<model>-<dataset>, or --output-dir), and compare the weights with the run's.")
    parser.add_argument("run", type=Path, metavar="RUN_DIR", help="the folder of a run (finished or stopped)")
    add_training_options(parser, "every option of acc-trainer --help, over the run's config.yaml (none: the run as "
                                 "it was)")
    args = parser.parse_args(argv)
    if not (args.run / "config.yaml").is_file():
        raise ConfigError(f"{args.run} holds no config.yaml: not the folder of an acc_trainer run")
    if "config" in args:
        raise ConfigError("acc-trainer rerun trains the run's own config.yaml; give the options to change as flags")
    accept = getattr(args, "accept_unverified", False)
    say_note(unverified(f"run folder {args.run} (config.yaml)", damage(args.run, ["config.yaml"]), accept))
    objects = given_as_objects(args.run)
    if objects:
        raise ConfigError(f"{args.run} was trained by fit() on objects its config.yaml cannot build again ({objects}); "
                          f"run the script that called fit() again: fit(..., config=acc_trainer.parse_config(['--config', "
                          f"'{args.run / 'config.yaml'}'])) takes the run's options")
    args.config = args.run / "config.yaml"
    for name in NOT_RECORDED:  # as if not in the file: one written before they were left out names the run's folder
        if name not in args:
            setattr(args, name, None)
    cfg = config_from(args)
    weights = args.run / weights_name(cfg)  # compared with the new run's: verified too (a stopped run has none)
    if weights.is_file():
        say_note(unverified(f"the weights {weights}", damage(args.run, [weights.name]), accept, "are"))
    return args.run, cfg


def report_weights(run: Path, cfg: TrainConfig, summary: dict) -> None:
    """On the main process: one line saying whether the weights just trained are `run`'s, bit for bit."""
    from accelerate import PartialState

    if not PartialState().is_main_process:
        return
    name = weights_name(cfg)
    mine, theirs = Path(summary["output_dir"]) / name, run / name
    if not theirs.is_file():
        print(f"acc-trainer rerun: {run} holds no {name} (it did not finish): nothing to compare {mine} with")
        return
    differing, total, largest = _compare(mine, theirs)
    if not differing:
        print(f"acc-trainer rerun: {mine} is bit-identical to {theirs} ({total} tensors)")
        return
    why = _what_changed(run, cfg, summary)
    print(f"acc-trainer rerun: {mine} differs from {theirs} in {differing} of {total} tensors (by at most {largest:.2g})"
          + (f"; changed: {why}" if why else ""))


def _compare(mine: Path, theirs: Path) -> tuple[int, int, float]:
    """(how many tensors differ in a bit, how many there are, the largest difference), tensor by tensor."""
    import torch
    from safetensors import safe_open

    with safe_open(str(mine), "pt") as a, safe_open(str(theirs), "pt") as b:
        names = set(a.keys()) | set(b.keys())
        differing, largest = 0, 0.0
        for key in names:
            if key not in a.keys() or key not in b.keys():
                differing, largest = differing + 1, float("inf")
                continue
            x, y = a.get_tensor(key), b.get_tensor(key)
            if x.shape != y.shape or x.dtype != y.dtype:
                differing, largest = differing + 1, float("inf")
            elif not torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)):  # bits, NaNs too
                differing += 1
                largest = max(largest, float((x.double() - y.double()).abs().max()))
    return differing, len(names), largest


def _what_changed(run: Path, cfg: TrainConfig, summary: dict) -> str:
    """The options given over the run's (but where it wrote), and the processes and library versions, when they
    changed: what makes the weights of a re-run differ."""
    from ..outputs.checkpoints import MAY_CHANGE

    before = load_yaml(run / "config.yaml")
    changes = [f"--{k.replace('_', '-')} {v} (was {before.get(k)})" for k, v in cfg.to_dict().items()
               if k not in MAY_CHANGE and k not in NOT_RECORDED and before.get(k, v) != v]
    made = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    if made.get("world_size") not in (None, summary["world_size"]):
        changes.append(f"{summary['world_size']} process{'es' * (summary['world_size'] > 1)} (was {made['world_size']})")
    versions = {k: v for k, v in summary["versions"].items() if made.get("versions", {}).get(k, v) != v}
    changes += [f"{k} {v} (was {made['versions'][k]})" for k, v in versions.items()]
    return ", ".join(changes)
