"""Factories shared by the kvstore tests: a tiny layout, stores, deterministic pages, a clock."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvstore import KVLayout, StoreConfig, TieredStore

REPO_ROOT = Path(__file__).resolve().parent.parent

# 2 layers x (K|V) x 4 tokens x 2 heads x 4 dims x fp16: 128-byte layers, 256-byte pages.
LAYOUT = KVLayout(
    model="test-model", num_layers=2, kv_heads=2, head_dim=4, dtype="float16", block_tokens=4
)


class FakeClock:
    """An injected monotonic clock that moves only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_store(tmp_path: Path | None = None, layout: KVLayout = LAYOUT, **config) -> TieredStore:
    """A store over ``layout``; an SSD tier (``ssd_pages``) lives under ``tmp_path``."""
    if config.get("ssd_pages") and "ssd_dir" not in config and not config.get("metadata_only"):
        assert tmp_path is not None, "an SSD tier needs tmp_path"
        config["ssd_dir"] = str(tmp_path / "ssd")
    return TieredStore(layout, StoreConfig(**config))


def key(i: int) -> bytes:
    """A distinct 16-byte block key per integer (tests of the index need not hash tokens)."""
    return i.to_bytes(16, "little")


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def page(seed: int, layout: KVLayout = LAYOUT) -> np.ndarray:
    """A page of pseudo-random bytes determined by ``seed``, as the layout's dtype."""
    raw = np.random.default_rng(seed).integers(0, 256, layout.page_bytes, dtype=np.uint8)
    return raw.view(layout.numpy_dtype)


def page_bytes(seed: int, layout: KVLayout = LAYOUT) -> bytes:
    return page(seed, layout).tobytes()


def tiers_of(store: TieredStore) -> dict[bytes, str]:
    """Every stored key -> tier name, from the store's own snapshot."""
    _, entries = store.snapshot()
    return {k: t.name for k, t in entries}


def run_python(
    code: str, *args: str, env: dict | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that imports this checkout; fail loudly on error."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO_ROOT,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stderr}"
    return proc


@contextmanager
def small_tmpfs(mnt: Path, size: str = "1m", ballast: int = 512 << 10) -> Iterator[Path]:
    """A tiny tmpfs at ``mnt`` (root only, else the test is skipped) holding a ``ballast`` file:
    unlink it to give space back to whatever filled the rest."""
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {proc.stderr.decode().strip()}")
    try:
        (mnt / "ballast").write_bytes(b"\0" * ballast)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
