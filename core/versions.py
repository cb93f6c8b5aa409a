"""Which library versions' behaviour a result models, and the versions installed here.

The hand-written programs (the estimator's families and the built-in builder) follow one release of
transformers / peft / torch: :data:`MODELLED`, the versions the tests hold them to (tests/test_hf_reference.py,
tests/test_handwritten_vs_hf.py run transformers' own classes of the installed release beside them). A trace,
``simulate --hf`` and a profile run the installed release itself. transformers' behaviour moves between releases
(Falcon's attention ran through the math kernel in 5.24 and the fused one in 5.25, about 23 % of a Falcon-7B LoRA
run), so a result says which it follows and where the installed one differs (:func:`vramlab.core.report.versions_text`).
Versions are read from the packages' metadata: nothing is imported.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib import metadata

LIBRARIES = ("transformers", "peft", "torch")
MODELLED: Mapping[str, str] = {"transformers": "5.25.0", "peft": "0.21.2", "torch": "2.13.0"}
# the loss kernels whose allocations are written from one release's source (core/simulation/loss.py), whatever the
# result's source: a loss kernel's library runs on CUDA only, so no path here runs the installed one
LIGER = ("liger-kernel", "0.8.5")  # its fused linear cross-entropy and its other kernels (--liger-kernels)
UNSLOTH = ("unsloth", "2026.10.9")  # its fused LoRA kernels (--unsloth-kernels)
UNSLOTH_ZOO = ("unsloth_zoo", "2026.10.9")  # its checkpointing (--unsloth-gc) and fused loss (fused_loss)
# the newest transformers unsloth 2026.10.9 installs with (its wheel's Requires-Dist: transformers<=5.17.0)
UNSLOTH_TRANSFORMERS = "5.17.0"
LOSS_KERNELS: Mapping[str, tuple[str, str]] = {"cce": ("cut-cross-entropy", "25.1.1"), "trl": ("trl", "1.16.0"),
                                               "liger": LIGER}
# activation offloading (--offload-activations), written from TRL's source and axolotl's patches of it
# (core/simulation/act_offload.py)
ACT_OFFLOAD: Mapping[str, Mapping[str, str]] = {"trl": {"trl": "1.16.0"},
                                                "axolotl": {"trl": "1.16.0", "axolotl": "0.19.0"}}
# the ``source`` of a result whose step is a hand-written program (every other source runs the installed release)
HAND_WRITTEN_SOURCES = ("hand-written", "simulated (built-in builder)")


@functools.cache
def installed() -> Mapping[str, str]:
    """The installed versions of :data:`LIBRARIES` ("" where one is not installed), local build tags dropped."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name).split("+")[0]
        except metadata.PackageNotFoundError:
            out[name] = ""
    return out


def modelled_by(source: str) -> tuple[Mapping[str, str], str]:
    """(versions, what follows them) for a result's ``source``."""
    if source in HAND_WRITTEN_SOURCES or not source:
        return MODELLED, "the hand-written program"
    return installed(), "the installed release"


def kernel_versions(loss_kernel: str) -> dict[str, str]:
    """{library: version} of the loss kernel ``loss_kernel`` models (empty for transformers' own loss)."""
    found = LOSS_KERNELS.get(str(loss_kernel))
    return {found[0]: found[1]} if found else {}


def liger_versions(kernels: tuple[str, ...]) -> dict[str, str]:
    """{library: version} of Liger's other kernels (``--liger-kernels``; empty when none is on)."""
    return {LIGER[0]: LIGER[1]} if kernels else {}


def unsloth_versions(kernels: tuple[str, ...]) -> dict[str, str]:
    """{library: version} of Unsloth's kernels (``--unsloth-kernels``; empty when none is on): unsloth's, and
    unsloth_zoo's where its fused loss runs (``fused_loss``: ``fused_losses/fused_linear.py``)."""
    if not kernels:
        return {}
    return dict((UNSLOTH, UNSLOTH_ZOO)) if "fused_loss" in kernels else {UNSLOTH[0]: UNSLOTH[1]}


def unsloth_gc_versions(runs: bool) -> dict[str, str]:
    """{library: version} of Unsloth's checkpointing where it ``runs`` (``--unsloth-gc``: unsloth's switch and
    unsloth_zoo's function, core/spec/unsloth_gc.py; empty otherwise)."""
    return dict((UNSLOTH, UNSLOTH_ZOO)) if runs else {}


def hub_versions() -> dict[str, str]:
    """{library: version} of transformers' Hub kernels as modelled (core/spec/hub_kernels.py): the kernels library
    transformers 5.25.0 requires and the Hub repo whose RMSNorm layer it loads."""
    return {"kernels": "0.19.1", "kernels-community/liger-kernels": "version 4"}


def offload_versions(style: str) -> dict[str, str]:
    """{library: version} of the activation offloading modelled (``style``: the setup's; empty when it is off)."""
    return dict(ACT_OFFLOAD.get(style, {}))


def differing(models: Mapping[str, str]) -> dict[str, str]:
    """The libraries whose installed version differs from ``models`` (name -> installed, "" if absent)."""
    here = installed()
    return {k: here.get(k, "") for k, v in models.items() if here.get(k, "") != v}


@functools.cache
def trace_versions() -> dict[str, str]:
    """The versions a traced tape (and a counted config) depends on, read from the packages' metadata (no import)."""
    out = {}
    for name in ("torch", "transformers", "peft", "vramlab"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = ""
    return out


def release_numbers(version: str) -> tuple[int, ...]:
    """The release numbers a version starts with ("5.25.0.dev0" -> (5, 25, 0)), to compare releases."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+", maxsplit=1)[0])[:3])
