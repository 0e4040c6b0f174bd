"""The committed generated gRPC code must match what `python -m proto.generate` produces now."""

from __future__ import annotations

import filecmp
import pathlib

from proto.generate import ROOT, generate, proto_files


def test_generated_code_is_fresh(tmp_path):
    generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert len(fresh) == 3 * len(proto_files())
    stale = [
        str(rel)
        for rel in fresh
        if not (ROOT / rel).exists() or not filecmp.cmp(tmp_path / rel, ROOT / rel, shallow=False)
    ]
    assert not stale, f"stale generated code: {stale}; run `make proto` and commit the result"


def test_every_proto_is_importable():
    import importlib

    for proto in proto_files():
        importlib.import_module(f"proto.{pathlib.Path(proto).stem}_pb2_grpc")


def test_api_docs_are_fresh():
    from proto.docs import DOC, render

    assert DOC.exists() and DOC.read_text() == render(), (
        "docs/api.md is stale: run `make proto` and commit the result"
    )
