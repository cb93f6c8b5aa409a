"""The first trace runs fewer and cheaper steps (issue 12: the first estimate of a new 7B architecture under
10 s): the fit points are those that determine each tensor's dimensions (1, b, s, r, bs) rather than its
byte count (8 monomials with LoRA), and besides the template they run the first optimizer step alone, the
second step's sizes read from the allocations it repeats. Held to the tape fitted the way before (two steps
at every point, still the fallback), array for array (the slower recipes with VRAMLAB_TRACE_MATRIX=1).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from vramlab.core.estimator.stored import FITTED, TraceStore
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core import traced  # noqa: E402
from vramlab.core.sources.traced_config import traced_spec  # noqa: E402
from vramlab.core.tracing import capture, trace  # noqa: E402

TINY = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 500, "max_position_embeddings": 2048}
NEOX = {**TINY, "model_type": "gpt_neox", "rotary_pct": 0.25, "tie_word_embeddings": False}
OLMO = {**TINY, "model_type": "olmo", "num_key_value_heads": 2}
MOE = {**TINY, "model_type": "qwen3_moe", "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32,
       "num_experts": 4, "num_experts_per_tok": 2}


def _arrays(rec) -> tuple:  # noqa: ANN001
    return (rec.coef, rec.sign, rec.kind, rec.new_kind, rec.tag, rec.phase, rec.ref, rec.phases,
            sorted(rec.multiplicity.items()), rec.symbolic, rec.total_params, rec.trainable_base,
            rec.trainable_per_rank, rec.mode)


def _tapes(cfg: dict, setup: TrainingSetup, folder: Path) -> tuple[dict, list[str]]:
    spec, _ = traced_spec(cfg, cfg["model_type"], id="m", name="m", source="config.json", dtype=None)
    runs: list[str] = []
    store = TraceStore(folder)
    made = {cuda: traced.traced_tape(spec, setup, cuda=cuda, store=store, progress=lambda what, _f: runs.append(what))
            for cuda in (True, False)}
    return made, [r for r in runs if r.startswith("tracing")]


def _same_tapes(cfg: dict, setup: TrainingSetup, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fast, fast_runs = _tapes(cfg, setup, folder / "fast")
    with monkeypatch.context() as m:
        m.setattr(trace, "step_one_sources", lambda _template: None)  # two steps at every point of the size fit
        before, before_runs = _tapes(cfg, setup, folder / "before")
    assert fast[True].mode == FITTED and len(fast_runs) < len(before_runs)
    for cuda in (True, False):
        for a, b in zip(_arrays(fast[cuda]), _arrays(before[cuda]), strict=True):
            assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b


def test_fewer_cheaper_runs_give_the_tape_of_two_steps_at_every_point(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA on GPT-NeoX's fused projection (sizes in b s r and b r: 5 points instead of 8)."""
    setup = TrainingSetup(method="lora", lora_targets=("query_key_value", "dense"), micro_batch=2, seq_len=300)
    _same_tapes(NEOX, setup, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("VRAMLAB_TRACE_MATRIX"), reason="two fitted traces each (30-60 s on two "
                    "cores): set VRAMLAB_TRACE_MATRIX=1")
@pytest.mark.parametrize(("cfg", "setup"), [
    (OLMO, TrainingSetup(micro_batch=1, seq_len=300)),
    (NEOX, TrainingSetup(method="lora", lora_targets=("query_key_value", "dense"), micro_batch=2, seq_len=300,
                         grad_accum=2, grad_ckpt=True)),
    (MOE, TrainingSetup(method="lora", lora_targets="all-linear", micro_batch=2, seq_len=300)),
    (NEOX, TrainingSetup(method="qlora", lora_targets="all-linear", micro_batch=2, seq_len=300)),
], ids=["olmo-batch-1", "neox-lora-accumulation-checkpointing", "qwen3-moe-lora-all-linear", "neox-qlora"])
def test_fewer_cheaper_runs_on_more_recipes(cfg: dict, setup: TrainingSetup, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _same_tapes(cfg, setup, tmp_path, monkeypatch)


def test_the_second_steps_allocations_are_read_from_the_first_steps() -> None:
    """Each allocation of the second step is mapped to the one at its place in the first step's phase of the
    same kind; the optimizer's first step also creates its states, which the second does not repeat."""
    a, f, p, r = capture.ALLOC, capture.FREE, capture.PHASE, capture.RECLASSIFY
    # load: weight; step 1: activation, freed; state created, temp freed; step 2: activation, freed; temp freed
    ops = [(p, -1, 0, 0, 0), (a, 0, 0, 0, 0),
           (p, -1, 0, 0, 1), (a, 1, 1, 0, 1), (f, 1, 1, 0, 1),
           (p, -1, 0, 0, 2), (a, 2, 2, 0, 2), (r, 2, 2, 3, 2), (a, 3, 4, 0, 2), (f, 3, 4, 0, 2),
           (p, -1, 0, 0, 3), (a, 4, 1, 0, 3), (f, 4, 1, 0, 3),
           (p, -1, 0, 0, 4), (a, 5, 4, 0, 4), (f, 5, 4, 0, 4)]
    phases = ["load", "forward@1", "optimizer@1", "forward@2", "optimizer@2"]
    sizes = [100, 40, 100, 100, 40, 100]
    tpl = capture.Trace(ops, sizes, phases, 0, 0, 0)
    assert trace.step_one_sources(tpl) == [0, 1, 2, 3, 1, 3]
    # a second step that allocates something the first did not: no source, so every point runs two steps
    grown = capture.Trace([*ops, (a, 6, 1, 0, 4)], [*sizes, 8], phases, 0, 0, 0)
    assert trace.step_one_sources(grown) is None
