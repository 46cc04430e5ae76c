"""The `jobs wait` progress line: step/total, percent, ETA and the latest loss (or reward)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tunehouse.types import JobEvent, MetricRow, StreamEnd, StreamItem

BAR_WIDTH = 24


def format_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "--:--"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def progress_line(step: int, total: int | None, eta: float | None, label: str, value: float | None) -> str:
    shown = f"{label} {value:.4f}" if value is not None else ""
    if not total:
        return f"step {step}  {shown}".rstrip()
    done = min(1.0, step / total)
    filled = int(BAR_WIDTH * done)
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    return f"[{bar}] {step}/{total} {done:4.0%}  ETA {format_eta(eta)}  {shown}".rstrip()


class ProgressPrinter:
    """Feed it stream items; it redraws one line on a terminal, or prints a line per 10% elsewhere."""

    def __init__(self, total_steps: int | None, out: TextIO = sys.stderr) -> None:
        self.total = total_steps
        self.out = out
        self.tty = out.isatty()
        self.first: tuple[float, int] | None = None
        self.last_decile = -1

    def __call__(self, item: StreamItem) -> None:
        if isinstance(item, JobEvent):
            total = (item.data or {}).get("total_steps")
            if isinstance(total, int):
                self.total = total
            if item.level in ("warn", "error") or item.type == "message":
                self._message(item.message)
        elif isinstance(item, MetricRow):
            self._metric(item)
        elif isinstance(item, StreamEnd) and self.tty:
            self.out.write("\n")

    def _message(self, text: str) -> None:
        if self.tty:
            self.out.write("\r\033[K")
        self.out.write(text + "\n")
        self.out.flush()

    def _metric(self, row: MetricRow) -> None:
        total = row.value("total_steps")
        if total:
            self.total = int(total)
        now = time.monotonic()
        if self.first is None:
            self.first = (now, row.step)
        started, first_step = self.first
        rate = (row.step - first_step) / (now - started) if now > started and row.step > first_step else None
        eta = (self.total - row.step) / rate if rate and self.total else None
        label, value = (
            ("reward", row.value("reward"))
            if row.value("reward") is not None
            else ("loss", row.value("loss"))
        )
        line = progress_line(row.step, self.total, eta, label, value)
        if self.tty:
            self.out.write("\r\033[K" + line)
        else:
            decile = int(10 * row.step / self.total) if self.total else row.step
            if decile == self.last_decile:
                return
            self.last_decile = decile
            self.out.write(line + "\n")
        self.out.flush()
