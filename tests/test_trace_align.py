"""The layer alignment of two traces (issue 28: a traced GRPO step of a VLM spent 40 minutes in difflib) gives
difflib's opcodes, event for event: on random sequences, on sequences with one layer's events inserted at every
place it runs, and on the traces of a tiny model at two and three layers. ``benchmarks/trace_align.py`` times it."""

from __future__ import annotations

import difflib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramlab.core.tracing import align, capture, solve


def _difflib(a: list, b: list) -> list:
    return difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(0, 3), max_size=60))
def test_the_opcodes_are_difflibs_on_any_two_sequences(a: list, b: list) -> None:
    assert align.opcodes(a, b) == _difflib(a, b)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=8), st.lists(st.integers(0, 4), max_size=30),
       st.lists(st.integers(0, 30), min_size=1, max_size=6), st.integers(1, 3))
def test_the_opcodes_are_difflibs_where_a_layer_is_inserted_in_runs_of_alike_layers(
        layer: list, other: list, places: list, runs: int) -> None:
    """``low`` has ``runs`` copies of a layer at each of several places; ``template`` one more at each."""
    low, template = [], []
    for k, p in enumerate(sorted(places)):
        gap = other[p % len(other):][:3] if other else []
        low += gap + [9 + k] + layer * runs
        template += gap + [9 + k] + layer * (runs + 1)
    assert align.opcodes(low, template) == _difflib(low, template)


def test_the_matches_right_of_the_last_are_read_from_the_wider_range(monkeypatch) -> None:
    """A layer inserted in each of many generated tokens' forwards: difflib looks right of each match in turn,
    and the stretches read once answer those looks, each as difflib answers it; the automaton is built over
    little more than the template once (without the reading: about 30 times)."""
    read, built = [], []
    from_read, automaton = align.Matcher._from_read, align._automaton

    def counted_read(self: align.Matcher, *args: object) -> object:
        read.append(from_read(self, *args))
        return read[-1]

    monkeypatch.setattr(align.Matcher, "_from_read", counted_read)
    monkeypatch.setattr(align, "_automaton", lambda b, blo, bhi: built.append(bhi - blo) or automaton(b, blo, bhi))
    low, template = [], []
    for t in range(60):
        low += [1, 2, t % 3 + 3] + [7, 8, 9, 10, 11] * 2 + [6]
        template += [1, 2, t % 3 + 3] + [7, 8, 9, 10, 11] * 3 + [6]
    assert align.opcodes(low, template) == _difflib(low, template)
    # difflib's 30 looks right of a match, each over most of the template, are read from the first one's
    assert sum(r is not None for r in read) >= 29
    assert sum(built) < 2 * len(template)


def test_the_longest_match_of_subranges_is_difflibs() -> None:
    a = [1, 2, 3, 1, 2, 3, 4, 1, 2]
    b = [5, 1, 2, 3, 4, 1, 2, 3, 1, 2]
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for alo, ahi, blo, bhi in [(0, 9, 0, 10), (1, 9, 0, 10), (0, 5, 3, 10), (3, 9, 0, 6), (0, 2, 5, 6), (4, 4, 0, 9)]:
        assert tuple(align.Matcher(a, b).find_longest_match(alo, ahi, blo, bhi)) == tuple(
            matcher.find_longest_match(alo, ahi, blo, bhi))


def _trace(ops: list[tuple], sizes: list[int]) -> capture.Trace:
    return capture.Trace(ops, sizes, ["forward"], 0, 0, 0)


def test_a_layer_that_changes_events_is_refused() -> None:
    a = capture.ALLOC
    low = _trace([(a, 0, 1, 0, 0), (a, 1, 1, 0, 0), (a, 2, 2, 0, 0)], [8, 16, 4])
    more = _trace([(a, 0, 1, 0, 0), (a, 1, 1, 0, 0), (a, 2, 1, 0, 0), (a, 3, 2, 0, 0)], [8, 16, 16, 4])
    assert solve.layer_chunks(low, more) == [(2, 3)]
    changed = _trace([(a, 0, 1, 0, 0), (a, 1, 1, 0, 0), (a, 2, 1, 0, 0), (a, 3, 2, 0, 0)], [8, 16, 16, 5])
    with pytest.raises(capture.TraceFailed):
        solve.layer_chunks(low, changed)


def test_the_traces_of_a_tiny_model_align_as_difflib_aligns_them() -> None:
    """LoRA with gradient accumulation and checkpointing: the extra layer runs in each micro-batch's forward,
    its recomputation and backward."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.sources.traced_config import traced_spec
    from vramlab.core.spec.training import Method, TrainingSetup

    tiny = {"model_type": "olmo", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 500, "max_position_embeddings": 2048}
    spec, _ = traced_spec(tiny, "olmo", id="m", name="m", source="config.json", dtype=None)
    setup = TrainingSetup(method=Method.LORA, micro_batch=1, seq_len=9, grad_accum=2, grad_ckpt=True)
    low, more = (capture.trace_both(spec, setup, capture.Point(d, 1, 9, setup.lora_rank), spec.transformers_config,
                                    steps=1)[0] for d in (2, 3))
    a, b = low.tokens(), more.tokens()
    ops = align.opcodes(a, b)
    assert ops == _difflib(a, b)
    assert sum(j2 - j1 for tag, _, _, j1, j2 in ops if tag == "insert") == len(b) - len(a) > 0


def test_a_stretch_not_in_the_range_asked_is_not_found_left_of_it() -> None:
    """``_occurs`` searches ``b[blo:bhi]`` only: where the stretch is not there, "nowhere", never an earlier place
    (bytes.find's -1 once restarted the search from the start)."""
    from vramlab.core.tracing.align import Matcher

    m = Matcher([5, 6], [5, 6, 1, 2, 3, 4])
    assert m._occurs(0, 2, 2, 6) == -1
    assert m._occurs(0, 2, 0, 6) == 0
