"""Console backend: one progress line per logged step, a grouped dump of every metric now and then.

A line reads

    step 12/100 [12%] ETA 2m56s | reward/overall 0.63 | response_length/mean 7.2 | timing_s/step 1.42s

with the keys of `CONSOLE_KEYS` that the step has (and their `val/` twins). Every `full_every` steps,
when none of those keys is present, or when the `mmrl` Python logger is at DEBUG level, all metrics
follow, sorted and grouped by their first name component, one group per line.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["CONSOLE_KEYS", "ConsoleLogger", "estimate_eta_s", "format_duration", "format_value"]

# Shown on the progress line in this order; in each tuple the first key present wins, so the reward
# shows up whether or not the reward function reports `overall`.
CONSOLE_KEYS: tuple[tuple[str, ...], ...] = (
    ("reward/overall", "critic/score/mean"),
    ("response_length/mean",),
    ("response_length/clip_ratio",),
    ("actor/pg_loss",),
    ("actor/kl_loss",),
    ("actor/entropy_loss",),
    ("actor/grad_norm",),
    ("critic/vf_loss",),
    ("timing_s/step",),
    ("throughput/tokens_per_s",),
)

_DUMP_WIDTH = 110  # characters per line of the full metric dump


def format_duration(seconds: float) -> str:
    """42s, 3m04s, 2h05m (rounded down to the shown unit)."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_value(key: str, value: float) -> str:
    """Short, readable number: seconds get an `s`, integers no decimals, large numbers thousands
    separators, everything else 4 significant digits."""
    if not math.isfinite(value):
        return str(value)
    if key.startswith("timing_s/") or "/timing_s/" in key:
        return f"{value:.2f}s"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if value == int(value):
        return str(int(value))
    return f"{value:.4g}"


def estimate_eta_s(elapsed_s: float, steps_done: int, steps_left: int) -> float | None:
    """Remaining seconds at the mean pace of this session, `elapsed_s / steps_done * steps_left`.

    None before the first step of the session has finished (no pace yet)."""
    if steps_done <= 0:
        return None
    return elapsed_s / steps_done * max(0, steps_left)


class ConsoleLogger:
    """Progress lines and sample generations written to `stream` (stdout when None).

    `total_steps` is the step the run ends at (None or 0 when unknown: no percentage, no ETA).
    `start_step` is the last step finished before this process started (the resumed step), so the ETA
    uses the pace of this session only; `clock` returns seconds and is injectable for tests; `label`
    (a multi-stage run's `stage 2/3 16k`) prefixes every progress line.
    """

    def __init__(
        self,
        total_steps: int | None,
        start_step: int = 0,
        full_every: int = 10,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_chars: int = 240,
        label: str = "",
    ) -> None:
        self.total_steps = total_steps or None
        self.label = label
        self.start_step = start_step
        self.full_every = full_every
        self.max_chars = max_chars
        self._stream = stream
        self._clock = clock
        self._start_time = clock()
        self._last_step: int | None = None

    def _write(self, text: str) -> None:
        stream = self._stream or sys.stdout  # looked up late so redirected stdout is honoured
        stream.write(text + "\n")
        stream.flush()

    def progress(self, step: int) -> str:
        """`step 12/100 [12%] ETA 2m56s` (after the label, if any), or `step 12` when the total is unknown."""
        prefix = f"{self.label} | " if self.label else ""
        if self.total_steps is None:
            return f"{prefix}step {step}"
        percent = int(100 * step / self.total_steps)
        eta_s = estimate_eta_s(
            self._clock() - self._start_time, step - self.start_step, self.total_steps - step
        )
        eta = "--" if eta_s is None else format_duration(eta_s)
        return f"{prefix}step {step}/{self.total_steps} [{percent}%] ETA {eta}"

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._last_step = step
        shown = []
        for prefix in ("", "val/"):
            for alternatives in CONSOLE_KEYS:
                key = next((prefix + k for k in alternatives if prefix + k in metrics), None)
                if key is not None:
                    shown.append(f"{key} {format_value(key, metrics[key])}")
        self._write(" | ".join([self.progress(step), *shown]))
        periodic = self.full_every > 0 and step % self.full_every == 0
        debug = logging.getLogger("mmrl").isEnabledFor(logging.DEBUG)
        if metrics and (periodic or debug or not shown):
            for line in _grouped_lines(metrics):
                self._write(line)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        plural = "" if len(samples) == 1 else "s"
        self._write(f"validation generations at step {step} ({len(samples)} sample{plural})")
        for index, sample in enumerate(samples, start=1):
            score = sample.get("score")
            score_text = format_value("score", float(score)) if isinstance(score, (int, float)) else score
            ground_truth = _shorten(str(sample.get("ground_truth", "")), self.max_chars)
            self._write(f"  [{index}/{len(samples)}] score {score_text} | ground truth: {ground_truth}")
            self._write(f"      prompt:   {_shorten(str(sample.get('prompt', '')), self.max_chars)}")
            self._write(f"      response: {_shorten(str(sample.get('response', '')), self.max_chars)}")
            trajectory = sample.get("trajectory")
            if trajectory:  # multi-turn: each call, what it returned, how the trajectory ended
                calls = "; ".join(
                    f"{call['name']}({call['arguments']}) -> {call['error'] or ', '.join(call['media']) or 'text'}"
                    for call in trajectory["calls"]
                )
                self._write(
                    f"      tools:    {_shorten(calls or 'none', self.max_chars)} | ended by {trajectory['stop']}"
                )

    def finish(self, failed: bool = False) -> None:
        if self._last_step is not None:
            elapsed = format_duration(self._clock() - self._start_time)
            ended = "stopped by an error" if failed else "finished"
            self._write(f"{ended} at step {self._last_step} after {elapsed}")


def _grouped_lines(metrics: dict[str, float]) -> list[str]:
    """All metrics sorted, one line per first name component, wrapped at `_DUMP_WIDTH` characters."""
    groups: dict[str, list[str]] = {}
    for key in sorted(metrics):
        group, _, rest = key.partition("/")
        groups.setdefault(group, []).append(f"{rest or group} {format_value(key, metrics[key])}")
    lines = []
    for group, items in groups.items():
        indent = f"  {group + '/':<18}"
        line, items_on_line = indent, 0
        for item in items:
            if items_on_line and len(line) + len(item) > _DUMP_WIDTH:
                lines.append(line.rstrip())
                line, items_on_line = " " * len(indent), 0
            line += item + "  "
            items_on_line += 1
        lines.append(line.rstrip())
    return lines


def _shorten(text: str, max_chars: int) -> str:
    """One line (newlines shown as \\n), at most `max_chars`: head ... tail, since a chat prompt's
    question and a response's final answer both sit at the end."""
    text = text.replace("\r", "").replace("\n", "\\n")
    if len(text) <= max_chars:
        return text
    head = max_chars // 3
    tail = max_chars - head - 3
    return f"{text[:head]}...{text[-tail:]}"
