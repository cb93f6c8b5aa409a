"""core/families: one registry names every ``model_type``, and each family is a folder with the pieces it lists."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

from vramlab.core.families import family, piece
from vramlab.core.families.registry import (
    FAMILIES,
    PIECES,
    REFUSED,
    SHARED_FOLDERS,
    TEXT_ALIASES,
    TEXT_DEFAULTS,
    TEXT_MODEL_TYPES,
    WRAPPED_TEXT_TYPE,
    named_model_types,
)
from vramlab.core.sources.remote_code import transformers_model_types

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAMILIES_DIR = ROOT / "core" / "families"
REGISTRY = "core/families/registry.py"

PENDING: frozenset[str] = frozenset()  # every module is held to none (issue 26)

# a string that happens to spell a model type but means something else (live.py's "opt" for the optimizer step)
# is kept with a comment on its line that says so
NOT_A_MODEL_TYPE = "not a model type"


def _model_types() -> frozenset[str]:
    """transformers' model types (the keys of CONFIG_MAPPING_NAMES, parsed from its source) and the registry's."""
    shipped = transformers_model_types()
    return named_model_types() | (frozenset(shipped[1]) if shipped is not None else frozenset())


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def model_type_strings(path: pathlib.Path, names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, string) of each string constant in ``path`` (docstrings aside) equal to one of ``names``."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)
    docs = _docstrings(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names and id(n) not in docs
            and NOT_A_MODEL_TYPE not in lines[n.lineno - 1]]


def test_no_module_but_the_registry_names_a_model_type():
    names = _model_types()
    assert "llama" in names and "qwen2_5_vl" in names  # the set the scan holds the tree to is not empty
    found = []
    for path in sorted([*(ROOT / "core").rglob("*.py"), *(ROOT / "app").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel == REGISTRY or rel in PENDING:
            continue
        found += [f"{rel}:{line}: {value!r}" for line, value in model_type_strings(path, names)]
    assert not found, ("model types named outside core/families/registry.py (name them there, use its constants "
                       "or tables):\n" + "\n".join(found))


def test_the_scan_finds_a_model_type_added_to_a_module(tmp_path):
    """The scan itself: a model type in code is found with its line; in a docstring, or marked, it is not."""
    module = tmp_path / "m.py"
    module.write_text('"""Reads llama configs."""\n\n'
                      'def f(mt):\n    """For "llama"."""\n    return mt == "llama"\n\n'
                      'ABBREV = {"optimizer": "opt"}  # ' + NOT_A_MODEL_TYPE + '\n'
                      'OTHER = ("mistral", "not_a_type")\n', encoding="utf-8")
    assert sorted(model_type_strings(module, _model_types())) == [(5, "llama"), (8, "mistral")]


def test_pending_files_exist():
    """An allowlisted file that moved or was deleted would leave the list silently stale."""
    assert [p for p in PENDING if not (ROOT / p).is_file()] == []


def _folders() -> set[str]:
    return {p.name for p in FAMILIES_DIR.iterdir() if p.is_dir() and p.name != "__pycache__"}


def test_every_family_folder_holds_exactly_its_pieces():
    assert {f.name for f in FAMILIES} | set(SHARED_FOLDERS) == _folders()
    for f in FAMILIES:
        modules = {p.stem for p in (FAMILIES_DIR / f.name).glob("*.py")} - {"__init__"}
        assert set(f.pieces) <= set(PIECES), f.name
        assert modules == set(f.pieces), f"{f.name}: folder has {sorted(modules)}, registry lists {f.pieces}"


def test_a_model_type_has_one_family():
    types = [t for f in FAMILIES for t in f.model_types]
    assert len(types) == len(set(types))
    assert all(family(t) is f for f in FAMILIES for t in f.model_types)
    assert family("not_a_type") is None and piece("not_a_type", "config") is None


@pytest.mark.parametrize("fam", [f for f in FAMILIES if "config" in f.pieces], ids=lambda f: f.name)
def test_a_config_piece_reads_the_vision_side(fam):
    """hf_config_to_spec calls every family's config piece the same way."""
    module = piece(fam.model_types[0], "config")
    assert module is importlib.import_module(f"vramlab.core.families.{fam.name}.config")
    assert callable(module.vision_from_config) and isinstance(module.PROJECTS_TO_TEXT, bool)


def test_the_text_tables_agree_with_the_readers():
    from vramlab.core.sources.text_readers import READERS

    assert set(READERS) == set(TEXT_DEFAULTS)
    assert set(TEXT_ALIASES.values()) <= set(READERS)
    assert not set(REFUSED) & set(TEXT_MODEL_TYPES)  # a type is read or refused, never both
    assert set(WRAPPED_TEXT_TYPE.values()) <= set(TEXT_MODEL_TYPES)
