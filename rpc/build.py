"""What this build is: the ``kvcache --version`` line and the labels of ``kvcache_build_info``."""

from __future__ import annotations

import platform
from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def version() -> str:
    return _version("kvcache")


def build_labels() -> dict[str, str]:
    return {
        "version": version(),
        "python": platform.python_version(),
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
    }
