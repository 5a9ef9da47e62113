"""``python -m sgl_vtoken_tools <command> [args]``: the repository's benchmarks and evaluations
(`sgl_vtoken_tools.cli`); without a command, or with ``--help``, the list of commands."""

from __future__ import annotations

import importlib
import sys

from sgl_vtoken_tools.cli import COMMANDS


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(
        [
            "usage: python -m sgl_vtoken_tools <command> [args]   (<command> --help: its flags)",
            "",
            "commands:",
            *lines,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"sgl_vtoken_tools.cli.{COMMANDS[argv[0]][0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
