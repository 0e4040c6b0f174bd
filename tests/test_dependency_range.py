"""The lower ends of our pins are real: the code runs on the oldest versions pyproject claims.

- protobuf >= 5.29.6, < 8 (the range the engines install): a real node server and client round
  trip under the lowest protobuf we claim (with the oldest grpcio we claim), under LMCache's
  protobuf 6, and under this environment's protobuf 7, the one vLLM resolves to.
- transformers >= 4.56 (the [hf] extra): the Hugging Face adapter's tests under 4.56.0.

The other versions are pip-installed once into overlay directories under .venv, put first on
PYTHONPATH so that they shadow the environment's packages for the script and the processes it
starts.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import leftovers

ROOT = pathlib.Path(__file__).resolve().parent.parent
OVERLAYS = ROOT / ".venv" / "dependency-overlays"
SCRIPT = pathlib.Path(__file__).with_name("protobuf_roundtrip.py")

# name -> the requirements installed over the environment's
RANGE = {
    "lowest": ["protobuf==5.29.6", "grpcio==1.71.2", "grpcio-health-checking==1.71.2",
               "grpcio-reflection==1.71.2"],
    # LMCache 0.5.6 needs protobuf < 7; vLLM excludes 6.30-6.33.4.
    "lmcache": ["protobuf==6.33.6", "grpcio-health-checking>=1.71.2", "grpcio-reflection>=1.71.2"],
}  # fmt: skip
# --no-deps: exactly these, over the environment's (its numpy, torch, safetensors, ...)
OLDEST_TRANSFORMERS = ["transformers==4.56.0", "huggingface-hub==0.36.2", "tokenizers==0.22.2"]


def overlay(name: str, requirements: list[str], *pip_args: str) -> pathlib.Path:
    path = OVERLAYS / name
    stamp = path / ".installed"
    if not stamp.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "--no-warn-conflicts", "--upgrade", *pip_args, "--target", str(path), *requirements],
            check=True,
        )  # fmt: skip
        stamp.write_text("\n".join(requirements))
    return path


def roundtrip(tmp_path: pathlib.Path, pythonpath: list[pathlib.Path]) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in [*pythonpath, ROOT])}
    r = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr
    return r.stdout.splitlines()[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RANGE))
def test_round_trip_under_other_protobufs(tmp_path, name):
    versions = roundtrip(tmp_path, [overlay(name, RANGE[name])])
    wanted = next(r for r in RANGE[name] if r.startswith("protobuf==")).split("==")[1]
    assert versions.startswith(f"protobuf {wanted} "), versions


def test_round_trip_under_this_environments_protobuf(tmp_path):
    import google.protobuf

    assert int(google.protobuf.__version__.split(".")[0]) == 7  # the highest major we claim
    roundtrip(tmp_path, [])


def test_stubs_come_from_the_pinned_generator():
    """Stubs from a newer protoc would refuse every protobuf older than it (LMCache's 6.x)."""
    for stub in (ROOT / "proto").glob("*_pb2.py"):
        assert "# Protobuf Python Version: 5.29.0" in stub.read_text(), stub


@pytest.mark.slow
def test_hf_adapter_under_the_oldest_transformers_claimed():
    path = overlay("transformers-4.56", OLDEST_TRANSFORMERS, "--no-deps")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(ROOT)])}
    # A run of its own (tests/leftovers.py): this run's helpers are not its leftovers.
    env.pop(leftovers.SESSION_ENV, None)
    env.pop(leftovers.SESSION_ENV + "_WORKER", None)
    r = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert r.stdout.strip() == "4.56.0"
    r = subprocess.run(
        # The tests that run the model through the adapter (what a transformers version changes);
        # the node-failure ones are the same code under any version.
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_torch_hf.py",
         "-k", "logits or greedy or loaded_kv or layer_that_fails"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
