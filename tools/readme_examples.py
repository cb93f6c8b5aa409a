"""The README's example outputs, taken from the program itself.

An example in README.md is a fenced block right after ``<!-- output of: vramlab ARGS -->``: its first line is
``$ vramlab ARGS``, the rest what the command prints. A line ``...`` stands for any number of lines (the rest of
the output when it comes last). ``tests/test_readme.py`` runs each command and fails when the block differs
from the real output; ``python tools/readme_examples.py --write`` rewrites the blocks from it (keeping each
block's ``...`` cut: the lines before it, and the same number after the first ``...`` as before).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = re.compile(r"<!-- output of: (?P<cmd>vramlab [^>]*?) -->\n```\n(?P<body>.*?)```\n", re.S)
ELIDED = "..."


@dataclass
class Example:
    command: str
    shown: list[str]  # the block's lines after the "$ command" line
    span: tuple[int, int]


def examples(text: str) -> list[Example]:
    out = []
    for m in MARK.finditer(text):
        lines = m["body"].rstrip("\n").split("\n")
        if lines[0] != f"$ {m['cmd']}":
            raise ValueError(f"the block after 'output of: {m['cmd']}' must start with '$ {m['cmd']}'")
        out.append(Example(m["cmd"], lines[1:], m.span()))
    return out


def run(command: str, timeout: float = 300) -> list[str]:
    """What ``command`` prints, run as the installed entry point runs it."""
    args = shlex.split(command)[1:]
    code = "import sys; from vramlab.app.entry import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                       check=False, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{command} exited with {r.returncode}: {r.stderr.strip()}")
    return r.stdout.rstrip("\n").split("\n")


def matches(shown: list[str], real: list[str]) -> bool:
    """Whether ``real`` is ``shown`` with each ``...`` line standing for any run of lines."""
    parts: list[list[str]] = [[]]
    for line in shown:
        if line.strip() == ELIDED:
            parts.append([])
        else:
            parts[-1].append(line.rstrip())
    real = [line.rstrip() for line in real]
    if len(parts) == 1:
        return parts[0] == real
    if real[:len(parts[0])] != parts[0] or (parts[-1] and real[-len(parts[-1]):] != parts[-1]):
        return False
    pos, end = len(parts[0]), len(real) - len(parts[-1])
    for part in parts[1:-1]:  # the middle parts in order, each at its first place
        found = next((i for i in range(pos, end - len(part) + 1) if real[i:i + len(part)] == part), None)
        if found is None:
            return False
        pos = found + len(part)
    return pos <= end


def rewrite(text: str) -> str:
    for ex in reversed(examples(text)):
        real = run(ex.command)
        cut = next((i for i, line in enumerate(ex.shown) if line.strip() == ELIDED), None)
        body = real if cut is None else [*real[:cut], ELIDED]
        block = f"<!-- output of: {ex.command} -->\n```\n$ {ex.command}\n" + "\n".join(body) + "\n```\n"
        text = text[:ex.span[0]] + block + text[ex.span[1]:]
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the README's example outputs from the program")
    args = p.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    if args.write:
        README.write_text(rewrite(text), encoding="utf-8")
        return 0
    stale = [ex.command for ex in examples(text) if not matches(ex.shown, run(ex.command))]
    for command in stale:
        print(f"README.md: the output shown for '{command}' is not what it prints now", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
