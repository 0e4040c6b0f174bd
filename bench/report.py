"""Output helpers shared by the benchmark commands: tables, JSON, PNG plots, progress, sizes."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TextIO


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str | Callable[[Any], str] = "{}"

    def render(self, value: Any) -> str:
        if value is None:
            return "-"
        if callable(self.fmt):
            return self.fmt(value)
        return self.fmt.format(value)


def format_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """Right-aligned fixed-width text table."""
    cells = [[c.header for c in columns]]
    cells += [[c.render(row.get(c.key)) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(
    rows: Sequence[dict],
    columns: Sequence[Column],
    title: str | None = None,
    file: TextIO | None = None,
) -> None:
    out = file or sys.stdout
    if title:
        print(title, file=out)
    print(format_table(rows, columns), file=out)


MET = {True: "yes", False: "MISSED", None: ""}  # a figure's target: met, missed, none


def targets_summary(mets: Sequence[bool | None], missed: Sequence[str]) -> str:
    """``3/4 targets met; missed: a, b``, for the last line of a benchmark with targets."""
    met, total = sum(m is True for m in mets), sum(m is not None for m in mets)
    return f"{met}/{total} targets met" + (f"; missed: {', '.join(missed)}" if missed else "")


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.name.lower()
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    return obj


def write_json(path: str, obj: Any) -> None:
    """Dataclasses, enums and numpy scalars become plain JSON; non-finite floats become null."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(obj), f, indent=2)
        f.write("\n")


@dataclass(frozen=True)
class Series:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    style: str = "o-"


@contextlib.contextmanager
def figure(path: str, *args, **kwargs):
    """``plt.subplots(*args, **kwargs)`` on matplotlib's Agg backend (no display needed); the
    figure is laid out and saved to ``path`` when the block ends, and closed either way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)


def plot_lines(
    path: str,
    series: Sequence[Series],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    hlines: Sequence[tuple[float, str]] = (),
    ylim: tuple[float, float] | None = None,
) -> None:
    """One PNG with a line per series (matplotlib's Agg backend: no display needed)."""
    with figure(path, figsize=(7, 4.5), dpi=120) as (fig, ax):
        for s in series:
            ax.plot(list(s.x), list(s.y), s.style, label=s.label)
        for y, label in hlines:
            ax.axhline(y, linestyle="--", color="grey", linewidth=1)
            ax.annotate(
                label,
                (0.01, y),
                xycoords=("axes fraction", "data"),
                textcoords="offset points",
                xytext=(0, 3),
                fontsize=8,
                color="grey",
            )
        if logx:
            ax.set_xscale("log")
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()


def plot_bars(
    path: str, labels: Sequence[str], groups: dict[str, Sequence[float]], *, title: str, ylabel: str
) -> None:
    """Grouped bars: one group per label, one bar per entry of ``groups``."""
    with figure(path, figsize=(7, 4.5), dpi=120) as (fig, ax):
        n = max(1, len(groups))
        width = 0.8 / n
        for i, (name, values) in enumerate(groups.items()):
            xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=name)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()


class Progress:
    """A throttled one-line progress report on stderr (at most every ``interval_s``)."""

    def __init__(
        self,
        total: int,
        label: str,
        *,
        enabled: bool = True,
        interval_s: float = 1.0,
        file: TextIO | None = None,
    ) -> None:
        self.total = max(total, 0)
        self.label = label
        self.enabled = enabled
        self.interval_s = interval_s
        self.done = 0
        self._file = file or sys.stderr
        self._start = time.monotonic()
        self._last = -math.inf
        self._tty = hasattr(self._file, "isatty") and self._file.isatty()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._last >= self.interval_s:
            self._last = now
            self._emit(note)

    def _emit(self, note: str, end: str | None = None) -> None:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        line = (
            f"{self.label}: {pct:5.1f}% ({self.done}/{self.total}) "
            f"{time.monotonic() - self._start:6.1f} s {note}"
        ).rstrip()
        if end is None:
            end = "\r" if self._tty else "\n"
        print(line, end=end, file=self._file, flush=True)

    def finish(self, note: str = "") -> float:
        """Print the final line; returns the elapsed seconds."""
        if self.enabled:
            self._emit(note, end="\n")
        return time.monotonic() - self._start


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)\s*$")
_MULT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """'3M' -> 3_000_000, '512k' -> 512_000, '1.5G', '4096' (decimal suffixes: token counts)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a count; use a number with an optional k/M/G suffix")
    value = float(m.group(1)) * _MULT[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def parse_count_list(text: str) -> list[int]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("empty list; give comma-separated counts like 1M,3M,10M")
    return [parse_count(t) for t in items]


def human_count(n: float) -> str:
    for suffix, mult in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if abs(n) >= mult:
            value = n / mult
            return f"{value:.0f}{suffix}" if value == int(value) else f"{value:.3g}{suffix}"
    return f"{n:g}"


def parse_bytes(text: str) -> int:
    """'1G', '64M', '4MiB', '4096' -> bytes (binary suffixes: these are buffer sizes)."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    if mult != 1:
        s = s[:-1]
    try:
        value = float(s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 1G, 64M, 4096") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number of bytes")
    return int(value)


def human(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"
