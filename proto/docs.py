"""Render docs/api.md from proto/*.proto: ``python -m proto.docs``.

Each service becomes a table of its RPCs (with the comments written above them in the .proto),
followed by the full proto source for the messages. ``tests/test_proto_generated.py`` fails when
docs/api.md is stale.
"""
from __future__ import annotations

import re
import sys

from proto.generate import ROOT, proto_files

DOC = ROOT / "docs" / "api.md"
_RPC = re.compile(r"rpc\s+(\w+)\s*\(\s*(stream\s+)?([\w.]+)\s*\)\s*returns\s*\(\s*(stream\s+)?"
                  r"([\w.]+)\s*\)")


def _services(text: str) -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    services, current, comment = [], None, []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("service "):
            current = (line.split()[1], [])
            services.append(current)
            comment = []
        elif line.startswith("//"):
            comment.append(line[2:].strip())
        elif current is not None and (m := _RPC.search(line)):
            req = ("stream " if m.group(2) else "") + m.group(3)
            rep = ("stream " if m.group(4) else "") + m.group(5)
            current[1].append((m.group(1), req, rep, " ".join(comment)))
            comment = []
        elif line == "}":
            current, comment = None, []
        elif not line.startswith("//"):
            comment = []
    return services


def render() -> str:
    out = ["# gRPC API reference", "",
           "Generated from `proto/*.proto` by `python -m proto.docs` (`make proto`); do not edit.",
           "All services are in package `kvcache.v1`, serve gRPC health checking and reflection,",
           "and accept `authorization: Bearer <token>` metadata when started with `--token`.", ""]
    sources = []
    for path in proto_files():
        text = path.read_text()
        sources.append((path.name, text))
        for name, rpcs in _services(text):
            out += [f"## {name} (`{path.name}`)", "", "| RPC | request | reply | what it does |",
                    "|---|---|---|---|"]
            out += [f"| `{r}` | `{q}` | `{p}` | {c} |" for r, q, p, c in rpcs]
            out.append("")
    out += ["## Messages", ""]
    for name, text in sources:
        out += [f"### `{name}`", "", "```proto", text.rstrip(), "```", ""]
    return "\n".join(out)


def main() -> int:
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(render())
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
