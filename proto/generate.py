"""Regenerate the Python gRPC code from proto/*.proto: ``python -m proto.generate``.

The generated ``*_pb2.py`` / ``*_pb2_grpc.py`` files are committed so that a fresh clone needs no
code generation; ``tests/test_proto_generated.py`` fails when they are stale.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def proto_files() -> list[pathlib.Path]:
    return sorted((ROOT / "proto").glob("*.proto"))


def generate(out_dir: pathlib.Path = ROOT) -> None:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    args = parser.parse_args()
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
