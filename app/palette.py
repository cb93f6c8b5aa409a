"""One colour per memory kind and per overhead, the same in the light and the dark theme.

The kind colours are the Okabe-Ito palette (designed to stay distinguishable with the common forms of
colour-vision deficiency) extended with four of Paul Tol's "muted" colours; neighbours in the stacking
order differ in lightness as well as hue, so the stacks also read in greyscale. Overheads above the
tensor level (allocator cache, CUDA context, ...) are neutral greys: they are not tensors.
"""

from __future__ import annotations

from vramlab.app.qt import QtGui
from vramlab.core.kinds import Kind

KIND_COLORS: dict[Kind, str] = {
    Kind.WEIGHTS: "#0072B2",  # Okabe-Ito blue
    Kind.ADAPTERS: "#56B4E9",  # sky blue
    Kind.MASTER_WEIGHTS: "#332288",  # Tol indigo
    Kind.GRADIENTS: "#E69F00",  # orange
    Kind.OPTIMIZER_STATES: "#D55E00",  # vermillion
    Kind.ACTIVATIONS: "#009E73",  # bluish green
    Kind.AMP_COPIES: "#DDCC77",  # Tol sand
    Kind.LOGITS: "#CC79A7",  # reddish purple
    Kind.TEMPORARIES: "#F0E442",  # yellow
    Kind.OPTIMIZER_TEMPS: "#882255",  # Tol wine
    Kind.INPUTS: "#999933",  # Tol olive
    Kind.VISION_WEIGHTS: "#44AA99",  # Tol teal
    Kind.PROJECTOR_WEIGHTS: "#117733",  # Tol green
    Kind.VISION_ACTIVATIONS: "#BBCC33",  # Tol pear
    Kind.VISION_TRAINING: "#AA4499",  # Tol purple
    Kind.REFERENCE: "#88CCEE",  # Tol cyan
    Kind.KV_CACHE: "#661100",  # Tol dark red
}

# Overheads by the name core.levels gives them; anything new falls back to OVERHEAD_FALLBACK.
OVERHEAD_COLORS: dict[str, str] = {
    "Allocator cache & fragmentation": "#BBBBBB",
    "CUDA context": "#7F7F7F",
    "cuBLAS workspace": "#A6A6A6",
    "Flash-attention backward scratch": "#B0B0B0",
    "NCCL buffers": "#5F5F5F",
    "Paged optimizer states (managed)": "#D4D4D4",
}
OVERHEAD_FALLBACK = "#969696"


def text_color_on(background: QtGui.QColor) -> QtGui.QColor:
    """Black or white, whichever reads better on ``background`` (WCAG relative luminance)."""

    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    lum = 0.2126 * channel(background.redF()) + 0.7152 * channel(background.greenF()) \
        + 0.0722 * channel(background.blueF())
    return QtGui.QColor("#000000") if lum > 0.25 else QtGui.QColor("#FFFFFF")
