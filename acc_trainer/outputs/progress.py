"""What the main process shows while training: rich bars on a terminal, plain lines elsewhere.

Other processes get a `Progress` that shows nothing, so the loop never asks which rank it is on.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table


def make_console() -> Console:
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # a log file: no reason to wrap tables and paths at 80 columns
        console.width = 200
    return console


REFRESH_PER_SECOND = 4


class Progress:
    """Shows epoch and step progress with the latest loss, LR and samples/s.

    A step costs the loop one addition: rich draws the bars from the counts on its own thread, a few times a
    second (a drawing takes 1.5-2 ms), and a plain line is written as it is (rich's print of a line takes
    50-200 us). Calling into rich every step and printing through it cost the regression's loop 10-14 us a
    step; now 2."""

    def __init__(self, mode: str, enabled: bool, total_steps: int, epochs: int, steps_per_epoch: int):
        self.console = make_console()
        self.main = enabled  # the main process, which prints
        self.enabled = enabled and mode != "none"
        self.live = self.enabled and (mode == "rich" or (mode == "auto" and self.console.is_terminal))
        self.total_steps, self.epochs, self.steps_per_epoch = total_steps, epochs, steps_per_epoch
        self.steps = 0  # of the run, done
        self.epoch_first_step = 0  # the run's step when this epoch began
        self.stats = ""
        self._bars = _Bars(self, total_steps, _least(steps_per_epoch, total_steps)) if self.live else None

    def __enter__(self) -> "Progress":
        if self._bars is not None:
            self._bars.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bars is not None:
            self._bars.stop()

    def print(self, *args, **kwargs) -> None:
        if self.enabled:
            self.console.print(*args, **kwargs)

    def result(self, line: str) -> None:
        """The run's final result: printed by the main process with --progress none too (it hides the progress)."""
        if self.main:
            self.console.print(line)

    def new_epoch(self, epoch: int, done: int = 0, first_step: int | None = None) -> None:
        """Start epoch `epoch` (0-based) with `done` of its steps already made (a resumed run); `first_step`: the
        run's step when the epoch began (a stream's epochs may differ in length)."""
        first_step = epoch * self.steps_per_epoch if first_step is None else first_step
        self.steps, self.epoch_first_step = first_step + done, first_step
        if self._bars is not None:
            remaining = self.total_steps - first_step if self.total_steps is not None else None
            self._bars.reset(self._bars.epoch, total=_least(self.steps_per_epoch, remaining), completed=done,
                             description=f"epoch {epoch + 1}")

    def learnt(self, total_steps: int, steps_per_epoch: int, epochs: int) -> None:
        """A stream's first epoch has ended: the run's length is known."""
        self.total_steps, self.steps_per_epoch, self.epochs = total_steps, steps_per_epoch, epochs
        if self._bars is not None:
            self._bars.update(self._bars.run, total=total_steps)

    def step(self) -> None:
        self.steps += 1

    def log(self, step: int, epoch: int, loss: float, lr: float, samples_per_s: float, reward: float | None = None) -> None:
        self.stats = f"loss {loss:.4f}  " + (f"reward {reward:.4f}  " if reward is not None else "") + \
            f"lr {lr:.3g}  {samples_per_s:,.0f} samples/s"
        if self.enabled and self._bars is None:
            print(f"epoch {epoch + 1}/{self.epochs or '?'}  step {step}/{self.total_steps or '?'}  {self.stats}",
                  file=self.console.file, flush=True)


class _Bars(RichProgress):
    """rich's bars of the run and of its epoch, brought up to the loop's counts whenever rich draws them."""

    def __init__(self, progress: Progress, total_steps: int | None, epoch_steps: int | None):
        self.progress = progress
        super().__init__(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         TimeRemainingColumn(), TextColumn("{task.fields[stats]}"), console=progress.console,
                         refresh_per_second=REFRESH_PER_SECOND)
        self.run = self.add_task("steps", total=total_steps, stats="")
        self.epoch = self.add_task("epoch 1", total=epoch_steps, stats="")

    def get_renderables(self):
        if self.task_ids:  # rich draws once in its constructor, before the tasks exist
            p = self.progress
            steps = p.steps  # read once: the loop goes on meanwhile
            self.update(self.run, completed=steps, stats=p.stats)
            self.update(self.epoch, completed=steps - p.epoch_first_step)
        yield from super().get_renderables()


def _least(*sizes: int | None) -> int | None:
    """The smallest of the sizes that are known (None when none is: rich then shows no total)."""
    known = [s for s in sizes if s is not None]
    return min(known) if known else None


PERCENT_METRICS = ("accuracy", "top5")


def format_metric(name: str, value: float) -> str:
    return f"{name} {value:.2%}" if name in PERCENT_METRICS else f"{name} {value:.4g}"


def summary_table(summary: dict, plots: list) -> Table:
    """The end-of-run table: results, speed, topology, and where the files are."""
    table = Table(title="acc_trainer: run summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    final = summary["eval"]
    rows = [("run", f"{summary['model']} on {summary['dataset']}, {summary['steps']} steps, {summary['epochs']} epoch(s)")]
    if final:
        results = [format_metric(k, v) for k, v in final.items() if k != "loss"]
        results += [f"loss {final['loss']:.4f}"] if "loss" in final else []
        rows.append(("final evaluation", ", ".join(results) + f" on {summary['eval_samples']} samples"))
        best = summary.get("best")  # by the run's own measure (summary.py)
        if best:
            rows.append(("best evaluation", f"{format_metric(best['metric'], best['value'])} at step {best['step']}"))
    else:
        rows.append(("evaluation", "none (no evaluation set)"))
    rows.append(("loss", summary.get("loss_function") or "-"))
    speed = f"{summary['samples_per_s']:,.0f} samples/s" if summary["samples_per_s"] else "-"
    rows.append(("time", f"{summary['wall_time_s']:.1f} s wall, {summary['train_time_s']:.1f} s training, {speed}"))
    if summary.get("data_time_share") is not None:
        share = summary["data_time_share"]
        rows.append(("step time", f"{share:.0%} waiting for data, {1 - share:.0%} compute"))
    rows.append(("topology", f"{summary['world_size']} process(es), {engine_name(summary['distributed_type'])} on "
                             f"{summary['device']}, precision {summary['mixed_precision']}"))
    if summary.get("skipped_steps"):
        rows.append(("skipped steps", f"{summary['skipped_steps']} (NaN/inf loss)"))
    out = summary["output_dir"]
    rows.append(("run folder", out))
    if summary.get("lora"):
        rows.append(("weights", f"LoRA adapter {out}/adapter_model.safetensors ({summary['parameters']['trainable']:,} of "
                                f"{summary['parameters']['total']:,} parameters; PeftModel.from_pretrained(base, run folder))"))
    else:
        rows.append(("weights", f"{out}/model.safetensors"))
    if plots:
        rows.append(("plots", f"{out}/plots/ ({', '.join(p.name for p in plots)})"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def engine_name(distributed_type: str) -> str:
    """Accelerate's distributed type as a reader says it (its "NO": one process, nothing distributed)."""
    return {"NO": "undistributed", "MULTI_CPU": "DDP over gloo", "MULTI_GPU": "DDP", "DEEPSPEED": "DeepSpeed"}.get(
        distributed_type, distributed_type)
