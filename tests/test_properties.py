"""Property tests (issue 13): every generated input of each kind either gets an answer that satisfies the
invariants (components sum to the peak, levels in order, nothing negative, everything finite) or is refused
cleanly (exit 2 and one line; SetupError). The issue's own cases run every time as a fixed seed corpus.
Strategies and checks are in tests/support/fuzz.py; benchmarks/fuzz.py runs many more."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.support import fuzz  # noqa: E402
from vramlab.core.catalog import find_model  # noqa: E402
from vramlab.core.checks import SetupError  # noqa: E402
from vramlab.core.estimate import estimate  # noqa: E402
from vramlab.core.spec.training import SETUP_BOUNDS, TrainingSetup  # noqa: E402


@pytest.mark.parametrize(("kind", "value"), [(k, v) for k, vs in fuzz.SEED_CORPUS.items() for v in vs],
                         ids=[f"{k}-{i}" for k, vs in fuzz.SEED_CORPUS.items() for i in range(len(vs))])
def test_seed_corpus(kind, value):
    assert fuzz.CHECKS[kind](value) in ("answered", "refused")


@given(fuzz.cli_argv())
def test_cli_flags(argv):
    fuzz.check_cli_flags(argv)


@given(fuzz.config_dict())
def test_config_files(cfg):
    fuzz.check_config_file(cfg)


@given(fuzz.safetensors_header())
def test_safetensors_headers(header):
    fuzz.check_safetensors_header(header)


@given(fuzz.setup_dict())
def test_scenario_setups(data):
    fuzz.check_scenario_setup(data)


@given(fuzz.setup_dict())
def test_saved_settings_always_repair(data):
    fuzz.check_settings(data)


@given(fuzz.calibration_text())
def test_calibration_files(text):
    fuzz.check_calibration_file(text)


VALID = st.fixed_dictionaries({
    "method": st.sampled_from(["full", "lora", "qlora", "freeze"]),
    "grad_ckpt": st.booleans(),
    "attention": st.sampled_from(["sdpa", "eager"]),
    "optimizer": st.sampled_from(["adamw", "adamw8bit"]),
})


@given(VALID, st.sampled_from(["gpt2", "qwen2.5-0.5b"]), st.integers(1, 4096),
       st.integers(1, 32768), st.integers(1, 64), st.integers(1, 4096))
def test_the_peak_never_falls_when_batch_or_sequence_grows(fields, model, b, s, db, ds):
    spec = find_model(model)
    extra = {"trainable_layers": 1} if fields["method"] == "freeze" else {}
    setup = TrainingSetup(**fields, **extra, micro_batch=b, seq_len=s)
    try:
        base = estimate(spec, setup).peak_allocated_bytes
        more_b = estimate(spec, setup.replace(micro_batch=min(b + db, SETUP_BOUNDS["micro_batch"][1])))
        more_s = estimate(spec, setup.replace(seq_len=s + ds))
    except SetupError:
        return  # a combination refused with its reason is not a wrong answer
    assert 0 < base <= more_b.peak_allocated_bytes and base <= more_s.peak_allocated_bytes
    for r in (more_b, more_s):
        assert sum(r.components.values()) == r.peak_allocated_bytes
        assert all(v >= 0 for v in r.components.values())
