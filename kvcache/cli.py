"""``kvcache <command>``: dispatches to the module that owns each role.

Only the chosen command's module is imported, so ``kvcache node`` does not pay for torch or
matplotlib. Each module exposes ``configure(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "node": ("node.cli", "run a node server (tiered KV block pools, gRPC)"),
    "conductor": ("conductor.cli", "run the global scheduler (gRPC)"),
    "messenger": ("messenger.cli", "run a node's block mover (TCP / RDMA data plane)"),
    "up": ("kvcache.cluster", "start a local cluster on loopback"),
    "down": ("kvcache.cluster_down", "stop a local cluster started by 'kvcache up'"),
    "bench": ("bench.cli", "benchmarks: hitrate, schedule, live, store, node, transfer, ..."),
    "health": ("kvcache.health", "check a server's gRPC health (exit 0 when SERVING)"),
    "deploy": ("kvcache.deploy", "render the Kubernetes manifests and the compose file"),
}


def _usage() -> str:
    lines = ["usage: kvcache <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'kvcache <command> --help' for a command's options."]
    return "\n".join(lines)


def command_parser(name: str) -> argparse.ArgumentParser:
    """The real parser of ``kvcache <name>`` (also how the deployment tests check the command
    lines of the Dockerfile, the compose file and the manifests)."""
    parser = argparse.ArgumentParser(prog=f"kvcache {name}", description=COMMANDS[name][1])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    importlib.import_module(COMMANDS[name][0]).configure(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kvcache: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    args = command_parser(name).parse_args(rest)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
