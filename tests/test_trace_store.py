"""The traced-tape file (issue 12, the first estimate after a restart): a tape read back from the disk cache
brings its evaluation plan with it and answers as the tape written, at every point; a plan built by other
code is built again; a damaged file is a miss.

No trace is needed: the hand-written program's tape of a small Llama (repeated layers as blocks, LoRA
with a symbolic rank) is written out as a traced tape is.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vramlab.core.checks import SetupError
from vramlab.core.estimator import record_tape
from vramlab.core.estimator import stored as stored_mod
from vramlab.core.estimator.stored import MAGIC, SUFFIX, TracedTape, TraceStore
from vramlab.core.estimator.tape import Tape
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=7, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=1000)
SETUP = TrainingSetup(method="lora", micro_batch=2, seq_len=300, lora_rank=8, grad_ckpt=True)
KEY = "a" * 64
POINTS = np.array([(b, s, r) for b in (1, 2, 7) for s in (1, 33, 300, 4096) for r in (1, 8, 64)])


def _as_traced(tape: Tape) -> TracedTape:
    """The hand-written tape in a traced tape's columns: each block of repeated layers one tag."""
    tag = np.full(tape.n, -1, dtype=np.int64)
    mult = {}
    for j, (a, e, m) in enumerate(zip(tape.block_first, tape.block_last, tape.block_mult)):
        tag[a:e + 1] = j
        mult[j] = int(m)
    return TracedTape(tape.coef.copy(), tape.sign.copy(), tape.kind.copy(), tape.new_kind.copy(), tag,
                      tape.phase.copy(), np.arange(tape.n, dtype=np.int64), tuple(tape.phases), mult,
                      (True, True, True), 123, 45, 6, note="written by the test")


@pytest.fixture(scope="module")
def written() -> tuple[Tape, TracedTape]:
    tape = record_tape(LLAMA, SETUP).tape
    assert len(tape.block_first), "the test needs repeated layers"
    tape.plan()  # the reference's own, built here
    return tape, _as_traced(tape)


def _same(a: Tape, b: Tape) -> None:
    ea, eb = a.evaluate_many(POINTS), b.evaluate_many(POINTS)
    for f in dataclasses.fields(ea):
        x, y = getattr(ea, f.name), getattr(eb, f.name)
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y, f.name


def test_a_tape_read_back_answers_as_written_without_building_its_plan(written, monkeypatch) -> None:  # noqa: ANN001
    tape, rec = written
    data = rec.to_bytes(KEY)
    assert data.startswith(MAGIC)

    def no_plan(self):  # noqa: ANN001, ANN202
        raise AssertionError("the plan was built again")

    monkeypatch.setattr(Tape, "_build_plan", no_plan)
    back = TracedTape.from_bytes(data, KEY)
    assert back is not None and back.plan is not None
    assert (back.total_params, back.trainable(8), back.note, back.multiplicity) == \
        (123, 45 + 6 * 8, "written by the test", rec.multiplicity)
    assert np.array_equal(back.coef, rec.coef) and np.array_equal(back.tag, rec.tag)
    _same(back.tape, tape)  # every point: peaks, kinds, phases, the largest allocation


def test_a_plan_built_by_other_code_is_built_again(written, monkeypatch) -> None:  # noqa: ANN001
    tape, rec = written
    data = rec.to_bytes(KEY)
    monkeypatch.setattr(stored_mod, "plan_digest", lambda: "other code")
    back = TracedTape.from_bytes(data, KEY)
    assert back is not None and back.plan is None
    _same(back.tape, tape)


def test_the_plan_digest_follows_the_code_that_builds_the_plan(monkeypatch) -> None:
    before = stored_mod.plan_digest()
    stored_mod.plan_digest.cache_clear()
    original = Tape._build_plan

    def changed(self):  # noqa: ANN001, ANN202
        return original(self)

    monkeypatch.setattr(Tape, "_build_plan", changed)
    try:
        assert stored_mod.plan_digest() != before
    finally:
        monkeypatch.undo()
        stored_mod.plan_digest.cache_clear()
    assert stored_mod.plan_digest() == before


def test_a_damaged_or_foreign_file_is_a_miss(written, tmp_path) -> None:  # noqa: ANN001
    _tape, rec = written
    data = rec.to_bytes(KEY)
    in_point = bytearray(data)
    in_point[len(data) // 4] ^= 0x10  # a byte of the single-point plan, which the first part's checksum covers
    in_header = bytearray(data)
    in_header[data.index(b'"total_params": 123') + len('"total_params": 1')] ^= 0x01  # 123 -> 133
    header_end = data.index(b"}") + 1  # the header, without its arrays
    for bad in (bytes(in_point), bytes(in_header), data[:header_end], data[:40], b"PK\x03\x04" + data[4:], b"",
                data.replace(b'"format": %d' % stored_mod.FORMAT, b'"format": %d' % (stored_mod.FORMAT - 1))):
        assert TracedTape.from_bytes(bad, KEY) is None
    assert TracedTape.from_bytes(data, "b" * 64) is None  # written for another key
    store = TraceStore(tmp_path)
    (tmp_path / f"{KEY}{SUFFIX}").write_bytes(bytes(in_point))
    assert store.get(KEY) is None
    store.put(KEY, rec)
    assert TraceStore(tmp_path).get(KEY) is not None
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_file_damaged_past_the_single_point_plan_is_found_when_read_and_traced_again(written, tmp_path) -> None:  # noqa: ANN001
    """The rest of a file (the columns, the full plan) is read and checked when first needed: damaged or cut
    short, it is refused with a message then, and the file is forgotten and removed, so that the next look-up
    misses (and traces again)."""
    tape, rec = written
    data = rec.to_bytes(KEY)
    flipped = bytearray(data)
    flipped[-100] ^= 0x10  # a byte of the columns or the full plan
    b, s, r = POINTS[0].tolist()
    for bad in (bytes(flipped), data[:-8]):
        back = TracedTape.from_bytes(bad, KEY)
        assert back is not None and back.tape.evaluate(b, s, r) == tape.evaluate(b, s, r)
        with pytest.raises(SetupError, match="checksum"):
            back.tape.evaluate_many(POINTS)
    path = tmp_path / f"{KEY}{SUFFIX}"
    path.write_bytes(bytes(flipped))
    store = TraceStore(tmp_path)
    back = store.get(KEY)
    assert back is not None and back.tape.evaluate(b, s, r) == tape.evaluate(b, s, r)  # the first part is intact
    with pytest.raises(SetupError, match="traced again"):
        _ = back.ref
    assert not path.exists() and store.get(KEY) is None


def test_the_first_estimate_from_a_file_reads_the_single_point_plan_only(written) -> None:  # noqa: ANN001
    """One point at a time (what an estimate asks) answers as the tape written, at every point, without
    decoding the tape's columns or its full plan; they are decoded when first asked for, and equal."""
    tape, rec = written
    back = TracedTape.from_bytes(rec.to_bytes(KEY), KEY)
    for b, s, r in POINTS.tolist():
        assert back.tape.evaluate(b, s, r) == tape.evaluate(b, s, r), (b, s, r)
    assert not {"coef", "tag", "plan"} & set(vars(back)), "the columns were decoded for single points"
    assert back.full_length == rec.full_length and np.array_equal(back.ref, rec.ref)
    assert back.tape.full_length == tape.full_length


def test_a_file_whose_checksum_holds_but_whose_indices_do_not_is_refused(written) -> None:  # noqa: ANN001
    """A file is data: an index of the single-point plan outside its table makes the file a miss; one of the
    columns (decoded later) is refused with a message when it is first needed, never read past its table."""
    tape, _rec = written
    bad_point = _as_traced(tape)
    bad_point.tape.plan().point.moments[0] = 10**4  # a row no table has
    assert TracedTape.from_bytes(bad_point.to_bytes(KEY), KEY) is None
    negative = _as_traced(tape)
    negative.tape.plan().point.block_of[-1] = -2  # a Python list would read it from the end, silently
    assert TracedTape.from_bytes(negative.to_bytes(KEY), KEY) is None
    crossed = _as_traced(tape)
    ends = crossed.tape.plan().point.segment_end
    ends[0], ends[1] = ends[1], ends[0]  # two segments' stretches crossed
    assert TracedTape.from_bytes(crossed.to_bytes(KEY), KEY) is None
    bad_rest = _as_traced(tape)
    bad_rest.tape.plan()  # built from the intact columns, then one column is spoilt
    bad_rest.phase[0] = len(bad_rest.phases) + 5
    back = TracedTape.from_bytes(bad_rest.to_bytes(KEY), KEY)
    assert back is not None  # the single-point plan is intact
    b, s, r = POINTS[0].tolist()
    assert back.tape.evaluate(b, s, r) == tape.evaluate(b, s, r)
    with pytest.raises(SetupError, match="out of range"):
        back.tape.evaluate_many(POINTS)


def test_prefetch_reads_the_most_recently_used_tapes_into_memory(written, tmp_path) -> None:  # noqa: ANN001
    """After a restart (a new store on the same folder) the window's idle prefetch reads the newest tapes, so that
    the look-up of one of them does not touch the disk; a look-up from disk makes its tape the newest; damaged
    and foreign files are skipped without an error."""
    import os

    _tape, rec = written
    keys = [c * 64 for c in "bcde"]
    writer = TraceStore(tmp_path)
    for i, k in enumerate(keys):
        writer.put(k, rec)
        os.utime(tmp_path / f"{k}{SUFFIX}", (1000 + i, 1000 + i))  # e newest, b oldest
    (tmp_path / f"{'f' * 64}{SUFFIX}").write_bytes(b"not a tape")  # damaged, and the newest file
    (tmp_path / "notes.txt").write_text("not ours")

    restarted = TraceStore(tmp_path)
    assert restarted.get(keys[0]) is not None  # b read from disk: now the most recently used
    assert restarted.disk_hits == 1
    again = TraceStore(tmp_path)
    assert again.prefetch(2) == 2
    for k in (keys[0], keys[3]):  # b (just used) and e (newest written); not c, d
        assert again.get(k) is not None
    assert again.disk_hits == 0
    assert again.get(keys[1]) is not None and again.disk_hits == 1
    assert TraceStore(tmp_path / "missing").prefetch() == 0


def test_a_prefetched_tape_answers_as_the_tape_written(written, tmp_path) -> None:  # noqa: ANN001
    tape, rec = written
    TraceStore(tmp_path).put(KEY, rec)
    store = TraceStore(tmp_path)
    assert store.prefetch() == 1
    _same(store.get(KEY).tape, tape)
    assert store.disk_hits == 0


def test_a_tapes_key_holds_the_recipe_as_recipe_key_does() -> None:
    """The key a traced tape is filed under tells two recipes apart exactly when :func:`recipe_key` does (sizes
    and the LoRA settings of a recipe without LoRA left out; every accumulation its own, since the step holds each
    of its micro-batches), and holds the model, the batch of one, the piece and the CUDA flag besides."""
    from vramlab.core import traced

    base = TrainingSetup(method="lora", micro_batch=2, seq_len=300, lora_rank=8, grad_accum=2)
    full = TrainingSetup(micro_batch=2, seq_len=300)
    variants = [base, base.replace(micro_batch=3, seq_len=999, lora_rank=64), base.replace(grad_accum=8),
                base.replace(grad_accum=1), base.replace(grad_ckpt=True), base.replace(lora_targets=("q_proj",)),
                base.replace(lora_alpha=32.0), full, full.replace(lora_alpha=32.0, lora_targets=("q_proj",)),
                full.replace(method="freeze", trainable_layers=2), full.replace(method="freeze", trainable_layers=3)]
    where = {"piece": [1, 4096]}
    for a in variants:
        for b in variants:
            same = traced.recipe_key(a) == traced.recipe_key(b) and (a.micro_batch == 1) == (b.micro_batch == 1)
            assert (traced.tape_key(LLAMA, a, where, True) == traced.tape_key(LLAMA, b, where, True)) == same, (a, b)
    key = traced.tape_key(LLAMA, base, where, True)
    assert len({key, traced.tape_key(LLAMA, base, where, False), traced.tape_key(LLAMA, base, {"seq_len": 300}, True),
                traced.tape_key(LLAMA, base.replace(micro_batch=1), where, True),
                traced.tape_key(dataclasses.replace(LLAMA, num_layers=8), base, where, True)}) == 5
    configured = dataclasses.replace(LLAMA, transformers_config='{"model_type":"llama"}')
    assert traced.tape_key(configured, base, where, True) != traced.tape_key(
        dataclasses.replace(configured, transformers_config='{"model_type":"mistral"}'), base, where, True)
