"""``kvcache <command>``: dispatches to the module that owns each role.

Only the chosen command's module is imported, so ``kvcache node`` does not pay for torch or
matplotlib. Each module exposes ``configure(parser)`` and ``run(args) -> int``. Every command
takes ``--log-level`` and ``--log-format`` (``rpc.logs``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "node": ("node.cli", "run a node server (tiered KV block pools, gRPC)"),
    "conductor": ("conductor.cli", "run the global scheduler (gRPC)"),
    "messenger": ("messenger.cli", "run a node's block mover (TCP / RDMA data plane)"),
    "router": ("router.cli", "serve OpenAI completions disaggregated over vLLM engines (HTTP)"),
    "up": ("kvcache.cluster", "start a local cluster (loopback, or --hosts N namespaced hosts)"),
    "down": ("kvcache.cluster_down", "stop a local cluster started by 'kvcache up'"),
    "drain": ("kvcache.drain", "a node leaves: its hottest blocks go to its peers first"),
    "status": ("kvcache.status", "a running cluster at a glance: nodes, conductor, messengers"),
    "bench": ("bench.cli", "benchmarks: hitrate, schedule, live, store, node, transfer, ..."),
    "completion": ("kvcache.completion", "print a shell completion script (bash, zsh, tcsh)"),
    "health": ("kvcache.health", "check a server's gRPC health (exit 0 when SERVING)"),
    "deploy": ("kvcache.deploy", "render the Kubernetes manifests and the compose file"),
}
LOG_FORMATS = ("text", "json")


def _usage() -> str:
    lines = ["usage: kvcache [--version] <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'kvcache <command> --help' for a command's options."]
    return "\n".join(lines)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The options every command takes."""
    parser.add_argument(
        "--log-level",
        default=os.environ.get("KVCACHE_LOG_LEVEL") or "INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="(default: $KVCACHE_LOG_LEVEL, else INFO)",
    )
    parser.add_argument(
        "--log-format",
        default=os.environ.get("KVCACHE_LOG_FORMAT") or "text",
        choices=LOG_FORMATS,
        help="one event per line on stderr, as text or JSON, with role, node id and request id "
        "(default: $KVCACHE_LOG_FORMAT, else text)",
    )


def command_parser(name: str, module: object | None = None) -> argparse.ArgumentParser:
    """The real parser of ``kvcache <name>`` (also how the deployment tests check the command
    lines of the Dockerfile, the compose file and the manifests)."""
    module = module or importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"kvcache {name}", description=COMMANDS[name][1])
    add_common_args(parser)
    module.configure(parser)  # type: ignore[attr-defined]
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        from rpc.build import version

        print(f"kvcache {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kvcache: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    args = command_parser(name, module).parse_args(rest)
    from rpc.logs import configure_logging, set_identity
    from rpc.server import warn_inline_secrets

    configure_logging(args.log_level, args.log_format)
    set_identity(role=name)
    warn_inline_secrets(args)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
