"""A vision-language family is a unit: its folder answers the same pieces by the same names, imports no other
family's folder, and its vision rules never import core.vision (which asks them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vramlab.core.families import piece
from vramlab.core.families.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ROOT / "core" / "families"
VLM = [f for f in FAMILIES if f.vision]
SHARED = ("vramlab.core.families.vlm_base", "vramlab.core.families.registry")

# what the code outside a family asks of each piece (core/vision.py, the estimator, estimate, simulate)
ASKED = {
    "vision": ("READS", "CLS_POSITION", "AUTOCAST", "QUANTIZED", "check", "check_setup", "setup_notes",
               "block_params", "tower_params", "projector_params", "language_extra_params", "lora_params_per_rank"),
    "program": ("step_model",),
    "reference": ("hf_config", "check", "build", "guard"),
}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("fam", VLM, ids=lambda f: f.name)
def test_a_vlm_family_answers_every_asked_piece_by_its_names(fam):
    for name, names in ASKED.items():
        assert name in fam.pieces, f"{fam.name} lacks its {name} piece"
        module = piece(fam.model_types[0], name)
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{fam.name}.{name} lacks {missing}"


@pytest.mark.parametrize("fam", [f for f in FAMILIES if (FOLDERS / f.name).is_dir()], ids=lambda f: f.name)
def test_a_family_imports_no_other_familys_folder(fam):
    mine = f"vramlab.core.families.{fam.name}"
    for path in sorted((FOLDERS / fam.name).glob("*.py")):
        for module in _imports(path):
            if module.startswith("vramlab.core.families.") and not module.startswith((mine, *SHARED)):
                pytest.fail(f"{path.relative_to(ROOT)} imports {module}, another family's folder")


@pytest.mark.parametrize("path", sorted(FOLDERS.glob("*/vision.py")), ids=lambda p: p.parent.name)
def test_vision_rules_never_import_core_vision(path):
    assert "vramlab.core.vision" not in _imports(path)  # core.vision asks them: that would be a cycle


def test_a_piece_a_family_lacks_is_none_and_an_unknown_type_has_no_family():
    assert piece("no-such-type", "vision") is None
    text_only = [f for f in FAMILIES if "reference" not in f.pieces]
    if text_only:
        assert piece(text_only[0].model_types[0], "reference") is None


def test_core_vision_imports_no_tracing_module():
    """Processor runs need transformers: the spec carries its run (ProcessorSpec.run), core.vision never imports
    the tracing layer (it tied spec, vision and the tracing layer into one import cycle)."""
    imports = _imports(ROOT / "core" / "vision.py")
    assert not [m for m in imports if m.startswith("vramlab.core.tracing")]
