"""The `vramlab` command: no arguments opens the GUI; subcommands run headless (see core.cli).

Two hidden options serve the packaged app (one executable, see packaging/):

* ``--profile-child``: the profile child process (``core.profiling.child``). ``core.profiling.profile``
  starts ``[sys.executable, "--profile-child"]`` when frozen, since a frozen app has no ``python -m``.
* ``--self-test``: a smoke test of what was shipped (``app.selftest``): GUI offscreen, an estimate, a tiny
  simulation and profile when torch is bundled. Exit code 0 when everything works.

Both are routed before anything imports Qt, so a profile child never loads Qt.
"""

from __future__ import annotations

import sys

from vramlab.app.build import NO_TORCH


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if getattr(sys, "frozen", False):
        import multiprocessing

        multiprocessing.freeze_support()  # a frozen multiprocessing child never gets past this line
    if args[:1] == ["--profile-child"]:
        return profile_child(args[1:])
    if args[:1] == ["--self-test"]:
        from vramlab.app.selftest import main as self_test

        return self_test(args[1:])
    if args and not args[0].startswith("--gui"):
        return cli_main(args)
    return gui_main(args)


def profile_child(argv: list[str]) -> int:
    """The child reads its request from stdin; extra arguments are passed on in ``sys.argv``."""
    from vramlab.core.profiling import child

    sys.argv = [sys.argv[0], *argv]
    return child.main()


def cli_main(argv: list[str]) -> int:
    from vramlab.core.cli import main as run_cli

    try:
        return run_cli(argv)
    except ModuleNotFoundError as e:  # simulate / profile in a build (or environment) without torch
        if (e.name or "").split(".")[0] != "torch":
            raise
        print(f"error: {NO_TORCH if getattr(sys, 'frozen', False) else e}", file=sys.stderr)
        return 2


def gui_main(argv: list[str] | None = None) -> int:
    from vramlab.app.platform_check import check

    if (missing := check()) is not None:  # one line naming the system package, instead of Qt's abort
        print(missing, file=sys.stderr)
        return 1
    from vramlab.app.main import run

    return run(argv or [])
