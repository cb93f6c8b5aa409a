"""The `vramlab` command: no arguments opens the GUI; subcommands run headless (see core.cli)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and not args[0].startswith("--gui"):
        from vramlab.core.cli import main as cli_main

        return cli_main(args)
    return gui_main(args)


def gui_main(argv: list[str] | None = None) -> int:
    from vramlab.app.main import run

    return run(argv or [])
