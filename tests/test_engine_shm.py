"""An engine killed like a crash leaves no shared memory: ``EngineProcess.kill`` and
``Serving.stop`` remove the /dev/shm segments its process group held (vLLM's ``psm_*``, hundreds
of MB each), never a segment another live process still holds (the node's slab, which the
engine's connector maps too).

The engine here is a real process group built like vLLM's server: a leader in its own session
and a child (its "engine core"), each making a ``multiprocessing.shared_memory`` segment that
lives as long as they do, and mapping a segment a separate process owns.
"""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing import shared_memory

import pytest

from kvcache.engines import EngineProcess, EngineSpec, Serving, ServingConfig

from helpers import wait_until

ENGINE = r"""
import os, sys, time
from multiprocessing import resource_tracker, shared_memory

def segment(name):
    shm = shared_memory.SharedMemory(name=name, create=True, size=1 << 20)
    resource_tracker.unregister(shm._name, "shared_memory")  # as if the tracker died with us
    shm.buf[0] = 1
    return shm

tag, node = sys.argv[1], sys.argv[2]
held = [segment(f"psm_{tag}_leader"), shared_memory.SharedMemory(name=node)]
resource_tracker.unregister("/" + node, "shared_memory")
if len(sys.argv) > 3:  # a helper that leaves a semaphore to the tracker, and exits
    helper = os.fork()
    if helper == 0:
        import multiprocessing
        lock = multiprocessing.get_context("spawn").Lock()  # sem.mp-*, registered
        with open(sys.argv[3], "w") as f:
            f.write(lock._semlock.name)
        os._exit(0)  # mapped by nobody now; the tracker unlinks it when the others are gone
    os.waitpid(helper, 0)
if os.fork() == 0:
    held.append(segment(f"psm_{tag}_core"))
    print("core", flush=True)
    time.sleep(600)
    os._exit(0)
time.sleep(600)
"""


@pytest.fixture
def node_segment():
    """A segment a live process other than the engine owns (the node's slab)."""
    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    yield shm.name
    shm.close()
    shm.unlink()


def _engine(tmp_path, tag: str, node: str, *extra: str) -> EngineProcess:
    log = tmp_path / f"{tag}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE, tag, node, *extra],
            stdout=subprocess.PIPE,
            stderr=out,
            start_new_session=True,
        )
    assert proc.stdout is not None and proc.stdout.readline() == b"core\n", log.read_text()
    spec = EngineSpec(node="n0", model="m", served_model_name="m", kv_role="both")
    engine = EngineProcess(spec, "http://127.0.0.1:9", proc, str(log))
    wait_until(lambda: len(engine.shm()[1]) == 3, 30, "the engine's three segments")
    return engine


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_a_killed_engine_leaves_no_shared_memory_but_the_nodes_stays(tmp_path, node_segment):
    tag = f"kvt{os.getpid()}a"
    engine = _engine(tmp_path, tag, node_segment)
    removed = engine.kill()
    assert sorted(removed) == [f"psm_{tag}_core", f"psm_{tag}_leader"]
    assert not _exists(f"psm_{tag}_core") and not _exists(f"psm_{tag}_leader")
    assert _exists(node_segment)  # still held by this process: not the engine's to remove
    assert engine.proc.returncode is not None


def test_a_killed_engine_leaves_no_semaphore_its_resource_tracker_would_unlink(
    tmp_path, node_segment
):
    """vLLM's processes register semaphores with multiprocessing's resource tracker (a process
    of the engine's group); one mapped by nobody is not among the segments read, and only the
    tracker knows it: ``kill`` spares the tracker, which unlinks it once the others died."""
    tag = f"kvt{os.getpid()}s"
    named = tmp_path / "semaphore"
    engine = _engine(tmp_path, tag, node_segment, str(named))
    sem = "sem." + named.read_text().lstrip("/")
    assert _exists(sem)
    engine.kill()
    wait_until(lambda: not _exists(sem), 30, "the tracker to unlink the semaphore")
    assert not _exists(f"psm_{tag}_core") and not _exists(f"psm_{tag}_leader")
    wait_until(lambda: not engine.shm()[0], 30, "every process of the engine to be gone")


def test_stopping_engines_that_need_sigkill_removes_their_shared_memory(tmp_path, node_segment):
    """The fake engine ignores nothing but takes no SIGTERM handler either: SIGTERM kills it
    without cleanup, like a hard crash; its segments go all the same."""
    tag = f"kvt{os.getpid()}b"
    serving = Serving(ServingConfig(engines=()), "127.0.0.1")
    serving.engines.append(_engine(tmp_path, tag, node_segment))
    serving.stop(timeout_s=5)
    assert not _exists(f"psm_{tag}_core") and not _exists(f"psm_{tag}_leader")
    assert _exists(node_segment)


def test_an_engine_that_crashed_before_the_stop_leaves_nothing(tmp_path, node_segment):
    """Segments seen while the engine ran are removed at stop, though its group is gone."""
    tag = f"kvt{os.getpid()}c"
    serving = Serving(ServingConfig(engines=()), "127.0.0.1")
    engine = _engine(tmp_path, tag, node_segment)
    serving.engines.append(engine)
    engine.signal(9)  # a crash nobody saw coming: no reading of its segments now
    engine.proc.wait(10)
    serving.stop(timeout_s=5)
    assert not _exists(f"psm_{tag}_core") and not _exists(f"psm_{tag}_leader")
    assert _exists(node_segment)
