"""Whether a pull from the pool pays: a request waits for the pages another node holds only when
that wait is predicted shorter than computing their tokens here. A pull costs a fixed part
(the Locate, the messenger's round trips, vLLM's extra scheduler steps for an asynchronous
load) that a small model computes faster than it waits (measured: a remote hit of 1000 tokens is
2.0x a recompute on a 2-layer model, 0.12x on a 125M one), so a cache that always pulled would
make such engines slower than no cache.

Both sides are measured in the engine, as it runs:
- computing: the scheduler's steps while the engine stays busy (a running request continues in
  the next step, so the engine never idled between them), summed in runs of ``CHUNK`` steps;
  the runs' seconds are fitted as ``a * steps + b * tokens`` (``b``: the seconds a token adds to
  a step). With vLLM's asynchronous scheduling (``lag`` 1) a step is scheduled while the one
  before it runs, so the time between two schedulings is the step before's;
- pulling: the time from a pull's submission to vLLM hearing it is done, per pull, fitted as
  ``c + e * pages``.

Until both are measured every pull is made (that is how they get measured), and one refused pull
in ``EXPLORE`` is made anyway, so the pull's side follows a pool that got faster.
"""

from __future__ import annotations

import math
import threading
from collections import deque

import numpy as np

CHUNK = 8  # busy steps per computing sample
WINDOW = 64  # samples kept per side
EXPLORE = 16  # one pull in this many the gate refuses is made anyway


def fit(xs: list[tuple[float, float]], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares ``(p, q)`` with ``y ~ p * x0 + q * x1``, both >= 0; None when the samples
    cannot tell them apart (then callers use a bound)."""
    if len(ys) < 2:
        return None
    a = np.asarray(xs, dtype=np.float64)
    if np.linalg.matrix_rank(a) < 2:
        return None
    (p, q), *_ = np.linalg.lstsq(a, np.asarray(ys, dtype=np.float64), rcond=None)
    if p < 0 or q < 0:
        return None
    return float(p), float(q)


class PullGate:
    """Thread-safe: the scheduler's thread feeds steps and decides, vLLM's output path reports
    finished pulls (the same thread in vLLM today; a lock keeps it honest)."""

    def __init__(self, max_cost: float, lag: int = 0) -> None:
        if not max_cost > 0:
            raise ValueError(f"pull_max_cost must be > 0 (inf: always pull), got {max_cost!r}")
        self.max_cost = max_cost
        self.lag = lag
        self._lock = threading.Lock()
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)  # steps, tokens, s
        self._pulls: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # pages, seconds
        self._run = [0, 0, 0.0]  # the busy run being summed: steps, tokens, seconds
        self._busy: deque[tuple[float, int]] = deque(maxlen=lag + 1)  # this busy period's steps
        self._refused = 0

    def step(self, now: float, tokens: int, continued: bool) -> None:
        """The scheduler made a step of ``tokens`` scheduled tokens at ``now``; ``continued``:
        a request that ran in an earlier step runs in this one (the engine did not idle)."""
        with self._lock:
            busy = self._busy
            if not continued:
                self._close_run()
                busy.clear()
            elif busy:
                # the time since the last scheduling ran the step ``lag`` before that one
                if len(busy) == busy.maxlen:
                    run = self._run
                    run[0] += 1
                    run[1] += busy[0][1]
                    run[2] += now - busy[-1][0]
                    if run[0] >= CHUNK:
                        self._close_run()
            busy.append((now, tokens))

    def _close_run(self) -> None:
        steps, tokens, seconds = self._run
        if steps:
            self._steps.append((int(steps), int(tokens), float(seconds)))
        self._run = [0, 0, 0.0]

    def pulled(self, pages: int, seconds: float) -> None:
        """A pull of ``pages`` pages kept its request waiting ``seconds`` (failed ones too:
        their wait was paid)."""
        with self._lock:
            self._pulls.append((pages, seconds))

    def compute_s(self, tokens: int) -> float | None:
        """Seconds ``tokens`` more tokens add to the engine's steps; None: not measured yet."""
        with self._lock:
            samples = list(self._steps)
            if self._run[0]:  # the run still going (or the last request's, until the next step)
                samples.append((int(self._run[0]), int(self._run[1]), float(self._run[2])))
        if not samples:
            return None
        got = fit([(s, t) for s, t, _ in samples], [sec for _, _, sec in samples])
        if got is not None and got[1] > 0:
            return got[1] * tokens
        # cannot split a step's fixed cost from its tokens': charge it all to the tokens (an
        # upper bound on computing, so the gate errs toward the pull it cannot judge)
        total_t = sum(t for _, t, _ in samples)
        return sum(sec for *_, sec in samples) / total_t * tokens if total_t else None

    def pull_s(self, pages: int) -> float | None:
        """Seconds a pull of ``pages`` pages is predicted to keep its request waiting."""
        with self._lock:
            samples = list(self._pulls)
        if not samples:
            return None
        got = fit([(1.0, p) for p, _ in samples], [s for _, s in samples])
        if got is None:  # one size seen: its mean
            return sum(s for _, s in samples) / len(samples)
        return got[0] + got[1] * pages

    def pays(self, pages: int, tokens: int) -> bool:
        """A pull of ``pages`` pages holding ``tokens`` tokens is predicted no slower than
        ``max_cost`` times computing them (or either side is not measured yet)."""
        if math.isinf(self.max_cost):
            return True
        compute, pull = self.compute_s(tokens), self.pull_s(pages)
        return compute is None or pull is None or pull <= self.max_cost * compute

    def worth(self, pages: int, tokens: int) -> bool:
        """Look for (and pull) ``pages`` pages holding ``tokens`` tokens this engine would
        otherwise compute? ``pays``, or the one refusal in ``EXPLORE`` made anyway."""
        return self.pays(pages, tokens) or self.explore()

    def explore(self) -> bool:
        """A pull that does not pay: made anyway once in ``EXPLORE`` (so the pull's side is
        measured again)."""
        with self._lock:
            self._refused += 1
            return self._refused % EXPLORE == 0
