"""One colour per memory kind and per overhead, the same in the light and the dark theme.

The kind colours are the Okabe-Ito palette (designed to stay distinguishable with the common forms of
colour-vision deficiency) extended with Paul Tol's "muted" and "light" colours; neighbours in the stacking
order differ in lightness as well as hue, so the stacks also read in greyscale. Overheads above the
tensor level (allocator cache, CUDA context, ...) are greys, each of its own lightness or tint: they are
not tensors, and each must still be told apart from the others.

Every two colours differ by at least ``MIN_DELTA_E`` (CIE76 distance in CIELAB; about 2.3 is the smallest
difference people notice side by side, and colours in a legend need much more): yellow, pear and olive
(temporaries, vision activations, batch inputs) and four greys within 4-8 of each other were told apart by
nobody (issue 27). tests/gui/test_window_details.py holds it.
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
    Kind.INPUTS: "#8C564B",  # brown
    Kind.VISION_WEIGHTS: "#1B9E9E",  # teal
    Kind.PROJECTOR_WEIGHTS: "#117733",  # Tol green
    Kind.VISION_ACTIVATIONS: "#FFAABB",  # Tol light pink
    Kind.VISION_TRAINING: "#AA4499",  # Tol purple
    Kind.REFERENCE: "#AADDEE",  # pale cyan
    Kind.KV_CACHE: "#661100",  # Tol dark red
}

# Overheads by the name core.levels gives them; anything new falls back to OVERHEAD_FALLBACK.
OVERHEAD_COLORS: dict[str, str] = {
    "Allocator cache & fragmentation": "#C8C8C8",  # light neutral grey
    "CUDA context": "#6B6B6B",  # dark neutral grey
    "cuBLAS workspace": "#8DA0BC",  # blue-grey
    "Flash-attention backward scratch": "#BFA58A",  # warm grey
    "NCCL buffers": "#3A3A3A",  # charcoal
    "Paged optimizer states (managed)": "#E8D9A8",  # pale sand
}
OVERHEAD_FALLBACK = "#969696"
MIN_DELTA_E = 20.0  # between any two kinds, any two overheads; 15 between a kind and an overhead


def text_color_on(background: QtGui.QColor) -> QtGui.QColor:
    """Black or white, whichever reads better on ``background`` (WCAG relative luminance)."""

    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    lum = 0.2126 * channel(background.redF()) + 0.7152 * channel(background.greenF()) \
        + 0.0722 * channel(background.blueF())
    return QtGui.QColor("#000000") if lum > 0.25 else QtGui.QColor("#FFFFFF")
