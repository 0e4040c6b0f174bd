"""``kvcache bench <command>``: the benchmark commands.

Only the chosen command's module is imported (``bench.replay.hitrate`` does not pay for grpc or
torch). Each module exposes ``configure(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "hitrate": (
        "bench.replay.hitrate",
        "replay a trace through the kvstore index: hit rate vs capacity",
    ),
    "schedule": (
        "bench.replay.schedule",
        "replay a trace through the conductor scheduler (simulated)",
    ),
    "store": ("bench.micro.store", "kvstore throughput vs a raw-copy reference"),
    "node": ("bench.micro.node", "node server throughput over gRPC / shared memory"),
    "transfer": ("bench.micro.transfer", "messenger transfer throughput vs a raw socket reference"),
    "conductor": ("bench.micro.conductor_scale", "conductor Schedule latency and memory at scale"),
    "live": ("bench.replay.live", "replay a trace against a running cluster"),
    "failover": ("bench.faults.failover", "conductor failover in etcd mode vs an embedded restart"),
    "drain": (
        "bench.replay.drain",
        "the pool's hit rate after a node leaves: handed over (kvcache drain) or not",
    ),
    "soak": (
        "bench.faults.soak",
        "a local cluster under load while processes are killed: no page lost",
    ),
    "torch": ("bench.micro.torch_ttft", "torch prefill with and without cached prefixes (TTFT)"),
    "layerwise": (
        "bench.micro.layerwise",
        "torch client layer-wise put/load vs memcpy; host<->device vs a pinned copy (CUDA)",
    ),
    "vllm": (
        "bench.micro.vllm_ttft",
        "vLLM TTFT with the prefix loaded from kvcache vs recomputed",
    ),
    "pool": (
        "bench.micro.pool_ttft",
        "vLLM TTFT of a prefix another node holds (pulled, loaded) vs a local hit vs recomputed",
    ),
    "serve": (
        "bench.replay.serve",
        "the trace through the router and vLLM engines: modes x policies x rates, goodput",
    ),
    "router": (
        "bench.micro.router_overhead",
        "the router's own cost against fake engines: req/s and latency added vs direct",
    ),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "command",
        choices=sorted(COMMANDS),
        metavar="command",
        help="; ".join(f"{n}: {h}" for n, (_, h) in COMMANDS.items()),
    )
    parser.add_argument(
        "options",
        nargs=argparse.REMAINDER,
        help="options of the command (see 'kvcache bench <command> --help')",
    )


def load_command(name: str):
    """Import the module behind ``name``; a clear error if it is unknown or not written yet."""
    try:
        module_name = COMMANDS[name][0]
    except KeyError:
        raise SystemExit(
            f"kvcache bench: unknown command {name!r}; choose one of {', '.join(sorted(COMMANDS))}"
        ) from None
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the module exists but one of its imports is missing: show the real error
        raise SystemExit(
            f"kvcache bench {name}: not available yet ({module_name} does not "
            "exist in this checkout)"
        ) from None


def run(args: argparse.Namespace) -> int:
    module = load_command(args.command)
    parser = argparse.ArgumentParser(
        prog=f"kvcache bench {args.command}", description=COMMANDS[args.command][1]
    )
    module.configure(parser)
    sub_args = parser.parse_args(args.options)
    # The top-level --log-level also applies below; keep it visible to the command.
    sub_args.log_level = getattr(args, "log_level", "INFO")
    return int(module.run(sub_args) or 0)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.cli hitrate ...`` without the kvcache front end."""
    parser = argparse.ArgumentParser(prog="kvcache bench")
    configure(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
