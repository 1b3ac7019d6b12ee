"""What the main process shows while training: rich bars on a terminal, plain lines elsewhere.

Other processes get a `Progress` that shows nothing, so the loop never asks which rank it is on.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class Progress:
    """Shows epoch and step progress with the latest loss, LR and samples/s."""

    def __init__(self, mode: str, enabled: bool, total_steps: int, epochs: int, steps_per_epoch: int):
        self.console = Console(highlight=False, soft_wrap=True)
        self.enabled = enabled and mode != "none"
        self.live = self.enabled and (mode == "rich" or (mode == "auto" and self.console.is_terminal))
        self.total_steps, self.epochs, self.steps_per_epoch = total_steps, epochs, steps_per_epoch
        self._bars = None
        if self.live:
            self._bars = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                console=self.console,
            )
            self._run = self._bars.add_task("steps", total=total_steps, stats="")
            self._epoch = self._bars.add_task("epoch 1", total=min(steps_per_epoch, total_steps), stats="")

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

    def new_epoch(self, epoch: int, done: int = 0) -> None:
        """Start epoch `epoch` (0-based) with `done` of its steps already made (a resumed run)."""
        if self._bars is not None:
            remaining = self.total_steps - epoch * self.steps_per_epoch
            self._bars.reset(self._epoch, total=min(self.steps_per_epoch, remaining), completed=done,
                             description=f"epoch {epoch + 1}")
            self._bars.update(self._run, completed=epoch * self.steps_per_epoch + done)

    def step(self) -> None:
        if self._bars is not None:
            self._bars.advance(self._run)
            self._bars.advance(self._epoch)

    def log(self, step: int, epoch: int, loss: float, lr: float, samples_per_s: float) -> None:
        stats = f"loss {loss:.4f}  lr {lr:.3g}  {samples_per_s:,.0f} samples/s"
        if self._bars is not None:
            self._bars.update(self._run, stats=stats)
        elif self.enabled:
            self.console.print(f"epoch {epoch + 1}/{self.epochs}  step {step}/{self.total_steps}  {stats}")
