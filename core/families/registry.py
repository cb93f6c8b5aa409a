"""The one place that names a transformers ``model_type``: which family answers it, and with which pieces.

A family is a folder under ``core/families/`` (``core/families/gemma3/``) holding what is particular to it:
``config`` (reading its ``config.json``), ``vision`` (its processor and tower rules, pure Python), ``program``
(its estimator program, no torch) and ``reference`` (transformers' own class built under fake tensors, torch).
The rest of the core never compares a ``model_type`` with a string: it asks :func:`vramlab.core.families.family`
for the family of a type, or :func:`vramlab.core.families.piece` for one of its modules, and uses the
constants below where it must name one. ``tests/test_families.py`` holds this: no module outside this one
names a model type.

Adding a family: its folder, one :class:`Family` line in :data:`FAMILIES`, and its tests (ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

PIECES = ("config", "vision", "program", "reference")


@dataclass(frozen=True)
class Family:
    """A family folder and the ``model_type`` values it answers.

    ``pieces`` names the modules its folder has (of :data:`PIECES`); a piece it lacks is answered by the shared
    code (the decoder, the generic processor path, the trace)."""

    name: str
    model_types: tuple[str, ...]
    pieces: tuple[str, ...] = ()
    vision: bool = False


# model types other modules must name (always through these constants)
QWEN2_5_VL = "qwen2_5_vl"
LLAVA = "llava"
GEMMA3 = "gemma3"
MLLAMA = "mllama"
PALIGEMMA = "paligemma"

FAMILIES: tuple[Family, ...] = (
    Family("qwen2_5_vl", (QWEN2_5_VL,), ("vision", "program", "reference"), vision=True),
    Family("llava", (LLAVA,), ("vision", "program", "reference"), vision=True),
    Family("mllama", (MLLAMA,), ("config", "vision", "program", "reference"), vision=True),
    Family("gemma3", (GEMMA3,), ("config", "vision", "program", "reference"), vision=True),
    Family("paligemma", (PALIGEMMA,), ("config", "vision", "program", "reference"), vision=True),
)

# Vision-language models without a family folder whose whole step is traced from transformers' own class
# (core/tracing/vlm_traced.py), by model type, with the processor rules of core/vision.py that make their images
TRACED_TOWERS = {"idefics3": "idefics3", "smolvlm": "idefics3", "internvl": "internvl", "qwen2_vl": "qwen_vl",
                 "qwen3_vl": "qwen_vl", "llava_next": "llava_next"}
