"""The compiled build of the allocator model (core/allocator.py compiled by Cython as ``_allocator_c``: setup.py,
typed by core/allocator.pxd) against the interpreted module, which is the reference: on random event streams
both leave the allocator in the same state, block for block, under every setting, through ``replay`` and
through the per-event ``malloc`` / ``free``. Skipped where the install built no compiled module (no Cython or
no C compiler); the interpreted class then serves."""

from __future__ import annotations

import pytest

from vramlab.core import allocator
from vramlab.core.allocator import AllocatorConfig

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MiB = 1 << 20
COMPILED = allocator.CachingAllocator
INTERPRETED = allocator.InterpretedCachingAllocator
needs_build = pytest.mark.skipif(COMPILED is INTERPRETED, reason="no compiled allocator in this install "
                                 "(pip install -e . with Cython and a C compiler builds it)")

# sizes around every threshold of the model: 512-byte rounding, the 1 MiB small-pool limit, the 10 MiB
# limit of 20 MiB segments, 2 MiB rounding of larger segments, the split rules' 512 bytes / 1 MiB rests, and
# the address space of packed free-list keys (PACKED_LIMIT: a segment or request past it widens them)
_EDGES = [1, 511, 512, 513, 4096, MiB - 1, MiB, MiB + 1, 2 * MiB, 9 * MiB, 10 * MiB - 1, 10 * MiB,
          10 * MiB + 1, 19 * MiB + 512 * 1024, 20 * MiB, 21 * MiB, 64 * MiB, 3 << 30,
          allocator.PACKED_LIMIT - 2 * MiB, allocator.PACKED_LIMIT - 20 * MiB, allocator.PACKED_LIMIT, 1 << 41]
_SIZES = st.one_of(st.sampled_from(_EDGES), st.integers(1, 2 * MiB), st.integers(1, 80 * MiB))


@st.composite
def _streams(draw: st.DrawFn) -> list[tuple[object, int]]:
    """Allocations (key, bytes) and frees (key, -1): frees of live keys in any order, now and then a key freed
    twice or never allocated (both ignored)."""
    events: list[tuple[object, int]] = []
    live: list[int] = []
    for key in range(draw(st.integers(1, 250))):
        if live and draw(st.booleans()):
            events.append((live.pop(draw(st.integers(0, len(live) - 1))), -1))
            if draw(st.integers(0, 30)) == 0:
                events.append((events[-1][0], -1))
        events.append((key, draw(_SIZES)))
        live.append(key)
        if draw(st.integers(0, 40)) == 0:
            events.append((-key - 1, -1))
    return events


def _fields(b: object) -> tuple:
    return (b.addr, b.size, b.segment, b.free, None if b.prev is None else b.prev.addr,
            None if b.next is None else b.next.addr)


def _state(a: object) -> tuple:
    """Every block with its neighbours: the cached ones of each pool in their order, and the live ones."""
    pools = tuple((list(p.free), [_fields(b) for b in p.cached], p.expandable_end) for p in (a.small, a.large))
    live = sorted((k, *_fields(b)) for k, b in a.live.items())
    return a.reserved, a.allocated, a.peak_allocated, a.next_addr, a.shift, pools, live


_CONFIGS = [None, AllocatorConfig(expandable_segments=True), AllocatorConfig(max_split_size_mb=64),
            AllocatorConfig(expandable_segments=True, max_split_size_mb=21)]


@needs_build
@settings(max_examples=60)
@given(events=_streams(), cfg=st.sampled_from(_CONFIGS), cut=st.integers(0, 300))
def test_the_compiled_allocator_leaves_the_state_the_interpreted_one_does(events, cfg, cut):
    """One replay, then (from where it stopped) the rest event by event, in both builds: the same state after
    each part; the default settings take the compiled loop, the others the compiled methods."""
    head, rest = events[:cut], events[cut:]
    fast, ref = COMPILED(cfg).replay(head), INTERPRETED(cfg).replay(head)
    assert _state(fast) == _state(ref)
    for key, n in rest:
        for a in (fast, ref):
            a.malloc(key, n) if n >= 0 else a.free(key)
    assert _state(fast) == _state(ref)
    assert fast.peak_reserved == ref.peak_reserved


@needs_build
def test_a_compiled_build_of_another_text_is_not_used(monkeypatch):
    """The compiled class serves only when it was compiled from allocator.py as it is now: after an edit the
    older build is left aside (the interpreted class serves) until the next install compiles it again."""
    from vramlab.core import _allocator_c

    assert allocator._compiled() is COMPILED
    monkeypatch.setattr(_allocator_c, "COMPILED_FROM", "0" * 64)
    assert allocator._compiled() is None


@needs_build
def test_the_compiled_replay_widens_its_keys_where_the_interpreted_one_does():
    """At the edge of packed free-list keys (a segment past PACKED_LIMIT, a request of it or larger, whose key
    would not be a machine integer) the compiled loop hands over as the interpreted one does: the same blocks,
    the same keys, no overflow."""
    limit = allocator.PACKED_LIMIT
    streams = [
        [("a", 30 * MiB), ("a", -1), ("b", 1 << 41), ("c", 4096)],
        [("a", 30 * MiB), ("b", 4096), ("a", -1), ("c", limit), ("b", -1), ("d", 12 * MiB)],
        [("a", limit - 2 * MiB), ("a", -1), ("b", 30 * MiB), ("c", 4096), ("b", -1), ("d", 3 * MiB)],
        [("a", limit - 22 * MiB), ("b", 9 * MiB), ("c", 8 * MiB), ("b", -1), ("d", 64 * MiB), ("c", -1)],
    ]
    for events in streams:
        for cut in range(len(events) + 1):
            fast, ref = COMPILED().replay(events[:cut]), INTERPRETED().replay(events[:cut])
            assert _state(fast) == _state(ref)
            fast.replay(events[cut:])
            ref.replay(events[cut:])
            assert _state(fast) == _state(ref)
