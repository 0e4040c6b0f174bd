"""Regenerate the Python gRPC code from proto/*.proto: ``python -m proto.generate``.

The generated ``*_pb2.py`` / ``*_pb2_grpc.py`` files are committed so that a fresh clone needs no
code generation; ``tests/test_proto_generated.py`` fails when they are stale.

The generator is pinned (``GENERATOR``) and runs in its own small environment, not the project's:
generated code refuses a protobuf runtime older than the one its protoc bundled, so stubs from
grpcio-tools 1.71.2 (protobuf 5.29) load on protobuf 5.29 through 7.x, which spans what vLLM
(>= 5.29.6), LMCache (< 7) and SGLang install; a newer generator would lock out LMCache's 6.x.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import venv

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATOR = "grpcio-tools==1.71.2"
# Inside the project's venv, so `make clean` removes it and it is rebuilt with the project.
GENERATOR_ENV = ROOT / ".venv" / "protoc-1.71.2"


def proto_files() -> list[pathlib.Path]:
    return sorted((ROOT / "proto").glob("*.proto"))


def generator_python() -> pathlib.Path:
    """The interpreter of the pinned generator environment, made on first use (one pip install)."""
    python = GENERATOR_ENV / "bin" / "python"
    ready = GENERATOR_ENV / ".installed"
    if not ready.exists():
        venv.create(GENERATOR_ENV, clear=True, with_pip=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", GENERATOR],
            check=True,
        )
        ready.touch()
    return python


def _protoc(out_dir: pathlib.Path) -> None:
    """Run protoc in this interpreter (the generator environment's)."""
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def generate(out_dir: pathlib.Path = ROOT) -> None:
    """Write the stubs for every proto/*.proto under out_dir, with the pinned generator."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # -I: the generator env must not pick up the project's site-packages through PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [str(generator_python()), str(pathlib.Path(__file__).resolve()), "--protoc", str(out_dir)],
        check=True,
        cwd=ROOT,
        env=env,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    parser.add_argument("--protoc", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.protoc is not None:
        _protoc(args.protoc)
    else:
        generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
