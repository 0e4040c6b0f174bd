"""Run independent simulation configurations in forked worker processes.

The workers are forked, so the inputs (a trace, its precomputed keys, a closure) are inherited,
never pickled; only each configuration's result travels back. Progress (request counts) streams
back through the same queue, so the parent keeps one progress line for all workers.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

Step = Callable[[int], None]


def _worker(fn, items, tasks, results) -> None:
    def progress(n: int) -> None:
        results.put(("progress", n, None))

    while True:
        index = tasks.get()
        if index is None:
            return
        try:
            results.put(("done", index, fn(items[index], progress)))
        except BaseException:  # noqa: BLE001 -- shipped to the parent, which raises it
            results.put(("error", index, traceback.format_exc()))
            return


def fork_map(
    fn: Callable[[T, Step], R], items: Sequence[T], jobs: int, progress: Step | None = None
) -> list[R]:
    """``[fn(item, step) for item in items]``, over up to ``jobs`` forked processes.

    ``fn`` reports work done with ``step(n)``; it reaches ``progress`` in the parent. With
    ``jobs <= 1`` (or one item) everything runs in this process. A failure in a worker raises
    ``RuntimeError`` carrying the worker's traceback.
    """
    items = list(items)
    step = progress if progress is not None else (lambda n: None)
    if jobs <= 1 or len(items) <= 1:
        return [fn(item, step) for item in items]
    ctx = mp.get_context("fork")
    tasks, results = ctx.Queue(), ctx.Queue()
    for i in range(len(items)):
        tasks.put(i)
    workers = [
        ctx.Process(target=_worker, args=(fn, items, tasks, results), daemon=True)
        for _ in range(min(jobs, len(items)))
    ]
    for _ in workers:
        tasks.put(None)
    for w in workers:
        w.start()
    out: list = [None] * len(items)
    pending = len(items)
    try:
        while pending:
            try:
                kind, index, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"a worker process died (exit code {dead[0].exitcode})"
                    ) from None
                continue
            if kind == "progress":
                step(index)
            elif kind == "done":
                out[index] = payload
                pending -= 1
            else:
                raise RuntimeError(f"configuration #{index} failed in a worker:\n{payload}")
    finally:
        for w in workers:
            w.join(timeout=5.0)
            if w.is_alive():
                w.terminate()
                w.join()
    return out
