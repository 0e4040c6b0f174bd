"""``kvcache completion bash|zsh|tcsh``: a shell completion script for every command and flag.

shtab writes the script once from the real argparse parsers (each command's own ``configure``,
``kvcache bench``'s commands included): completing then runs no Python at all, where argcomplete
would start an interpreter and import the command's modules on every Tab.

    kvcache completion bash > ~/.local/share/bash-completion/completions/kvcache
    kvcache completion zsh > "${fpath[1]}/_kvcache"
"""

from __future__ import annotations

import argparse
import importlib

SHELLS = ("bash", "zsh", "tcsh")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete in")


def full_parser() -> argparse.ArgumentParser:
    """``kvcache`` with every command as a subparser (and every ``kvcache bench`` command)."""
    from bench.cli import COMMANDS as BENCH

    from .cli import COMMANDS, add_common_args

    parser = argparse.ArgumentParser(prog="kvcache")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    for name, (module_name, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        add_common_args(p)
        if name == "bench":
            bench = p.add_subparsers(dest="bench_command")
            for bname, (bmodule, bhelp) in BENCH.items():
                bp = bench.add_parser(bname, help=bhelp, description=bhelp)
                importlib.import_module(bmodule).configure(bp)
        else:
            importlib.import_module(module_name).configure(p)
    return parser


def run(args: argparse.Namespace) -> int:
    import shtab

    print(shtab.complete(full_parser(), shell=args.shell))
    return 0
