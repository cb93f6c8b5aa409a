"""Every result names the library versions whose behaviour it models (``models_versions`` in --json, a line in the
text), says where the installed ones differ, and a training config's framework says which transformers its run has."""

from __future__ import annotations

import importlib.metadata

import pytest

from vramlab.core import versions
from vramlab.core.catalog import find_model
from vramlab.core.estimate import estimate
from vramlab.core.report import render_table, versions_text
from vramlab.core.sources import defaults as D
from vramlab.core.sources.mapping import framework_versions_text
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

TINY = ModelSpec(id="tiny", name="Tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, vocab_size=300)


def _pretend_installed(monkeypatch, **found: str) -> None:
    monkeypatch.setattr(versions, "installed", lambda: {**{k: "" for k in versions.LIBRARIES}, **found})


def test_the_hand_written_estimate_names_the_release_it_models(monkeypatch):
    _pretend_installed(monkeypatch, **versions.MODELLED)
    r = estimate(find_model("llama-3.1-8b"), TrainingSetup())
    got = r.to_json()["models_versions"]
    # transformers 5.25's Hub kernels, on by default: the kernels library and the Hub repo whose layer it loads
    assert got == {**versions.MODELLED, "hub_kernels": versions.hub_versions(), "by": "the hand-written program"}
    assert "transformers 5.25.0" in render_table(r)
    assert "installed here" not in render_table(r)


def test_an_installed_transformers_that_differs_is_named(monkeypatch):
    _pretend_installed(monkeypatch, transformers="5.24.0", peft=versions.MODELLED["peft"],
                       torch=versions.MODELLED["torch"])
    r = estimate(find_model("llama-3.1-8b"), TrainingSetup())
    assert r.to_json()["models_versions"]["installed"] == {"transformers": "5.24.0"}
    text = versions_text(r)
    assert "installed here: transformers 5.24.0" in text and "--source traced" in text


def test_a_run_of_transformers_own_classes_models_the_installed_release():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    r = simulate(TINY, TrainingSetup(seq_len=32), hf=True)
    got = r.to_json()["models_versions"]
    assert got["by"] == "the installed release"
    assert got["transformers"] == importlib.metadata.version("transformers").split("+")[0]
    assert "installed" not in got


def test_a_framework_that_installs_another_transformers_says_so():
    (ax,) = framework_versions_text(["axolotl"])
    assert "transformers==5.16.1" in ax and "5.25.0" in ax
    assert framework_versions_text(["trl", "trl-dpo", "transformers", "peft"]) == []  # TRL allows 5.25.0
    assert len(framework_versions_text(["llamafactory", "llamafactory"])) == 1


@pytest.mark.parametrize("dist", sorted(D.FRAMEWORK_TRANSFORMERS))
def test_the_transformers_pins_are_the_frameworks_own(dist):
    try:
        if importlib.metadata.version(dist) != D.VERSIONS[dist]:
            pytest.skip(f"{dist} {importlib.metadata.version(dist)} installed; the pin is {D.VERSIONS[dist]}'s")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed (pip install -e .[conformance])")
    from packaging.requirements import Requirement

    pins = [Requirement(r) for r in importlib.metadata.requires(dist) or []]
    plain = [r for r in pins if r.name == "transformers" and r.marker is None]
    assert len(plain) == 1
    assert plain[0].specifier == Requirement(D.FRAMEWORK_TRANSFORMERS[dist]).specifier


def test_the_modelled_release_is_the_one_the_reference_tests_run_against():
    """tests/test_hf_reference.py holds the hand-written programs to the installed transformers: MODELLED must be
    that release, or the claim is unchecked (upgrade both together)."""
    here = versions.installed()
    for name in ("transformers", "peft"):
        if not here[name]:
            pytest.skip(f"{name} is not installed")
        assert here[name] == versions.MODELLED[name], name
