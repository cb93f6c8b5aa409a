"""What this build of VRAM Lab has: whether torch is there, and the one line that says so when it is not.

Imported by the entry point (:mod:`vramlab.app.entry`) and the self-test (:mod:`vramlab.app.selftest`); it
imports nothing of ours and no Qt, so both can use it before anything heavy is loaded."""

from __future__ import annotations

import importlib.util
import sys

# the same text as the estimator-only build's runtime hook (packaging/rthooks/estimator_only.py), which imports
# nothing of ours and so keeps its own copy
NO_TORCH = ("this build of VRAM Lab has no torch (the estimator-only build): `simulate` and `profile` need "
            "the full build, or `pip install vramlab` in a Python environment")


def has_torch() -> bool:
    """Whether torch can be imported here (without importing it)."""
    if "torch" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:  # the estimator-only build answers with an explanation
        return False
