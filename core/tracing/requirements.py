"""What the trace of transformers' own classes needs: the libraries it runs (and their versions, which a traced
tape and a cached config count depend on). Every recipe runs there (a vision-language class:
core/spec/vlm_objectives.py says which objectives). Torch-free: the
estimate asks it before anything imports torch, and the estimator-only build answers "not installed"."""

from __future__ import annotations

from vramlab.core.checks import SetupError
from vramlab.core.versions import trace_versions


def installed() -> bool:
    """Whether torch, transformers and peft are installed (the trace can run; not the estimator-only build)."""
    return not missing()


def missing() -> list[str]:
    v = trace_versions()
    return [n for n in ("torch", "transformers", "peft") if not v[n]]


def check_available() -> None:
    """Refuse, with what to install, where torch, transformers or peft is missing (the estimator-only build)."""
    absent = missing()
    if absent:
        raise SetupError(f"this model is estimated from a trace of transformers' own classes, which needs "
                         f"{', '.join(absent)} (pip install 'vramlab[hf]'); the estimator-only build estimates "
                         "the hand-written families and every preset")
