"""The ``llumdask`` command: ``llumdask COMMAND [ARGS...]``.

Each command lives in its own module and owns its own argument parser; this module only picks
the command and imports its module when it runs, so ``llumdask demo`` never imports the server
stack and a new command is one line in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import llumdask


@dataclass(frozen=True)
class Command:
    """A command's ``"module:function"`` target and its one-line help.

    The function receives the arguments after the command name and returns an exit status
    (None counts as 0).
    """

    target: str
    help: str

    def __post_init__(self) -> None:
        module, colon, function = self.target.partition(":")
        if not (module and colon and function.isidentifier()):
            raise ValueError(f"command target must look like 'package.module:function', got {self.target!r}")

    def load(self) -> Callable[[list[str]], int | None]:
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(module), function)


COMMANDS: Mapping[str, Command] = types.MappingProxyType(
    {
        "bench": Command(
            "llumdask.api.bench:main",
            "benchmarks: 'bench sim' compares policies, 'bench paper' reproduces the paper, 'bench migration' times live migration",
        ),
        "serve": Command(
            "llumdask.api.serve:serve_main",
            "an OpenAI-compatible gateway over a local cluster of instances, or over --scheduler ADDRESS",
        ),
        "profile": Command(
            "llumdask.api.profile_cli:main",
            "latency profiles for the simulator: 'profile fit-vidur' fits Vidur GPU tables, 'profile measure' times a real engine",
        ),
        "certs": Command(
            "llumdask.clusters.certs:main",
            "a CA and a node certificate for a test cluster under Dask's TLS (see README: security across machines)",
        ),
        "demo": Command(
            "llumdask.api.demo:main",
            "a few requests over simulated instances, with one migration, printed as they happen",
        ),
    }
)


def build_parser(commands: Mapping[str, Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llumdask",
        description="Llumnix-style LLM serving on Dask.",
        epilog="Run 'llumdask COMMAND --help' for a command's own options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {llumdask.__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for name, command in commands.items():
        # No options here: everything after the name goes to the command's own parser.
        subparsers.add_parser(name, help=command.help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None, commands: Mapping[str, Command] = COMMANDS) -> int:
    """Entry point of the ``llumdask`` console script; returns the exit status."""
    parsed, rest = build_parser(commands).parse_known_args(argv)
    return commands[parsed.command].load()(rest) or 0
