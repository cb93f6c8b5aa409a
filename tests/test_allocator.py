"""The caching-allocator model, on cases worked out from the allocator's rules by hand."""

from __future__ import annotations

from vramlab.core.allocator import AllocatorConfig, CachingAllocator, round_size, segment_size

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(513) == 1024
    assert segment_size(1000) == 2 * MiB  # small pool
    assert segment_size(3 * MiB) == 20 * MiB  # large, under 10 MiB
    assert segment_size(int(10.5 * MiB)) == 12 * MiB  # rounded up to 2 MiB


def test_small_requests_share_a_2mib_segment():
    a = CachingAllocator().replay([(i, 4096) for i in range(100)])
    assert a.reserved == 2 * MiB and a.allocated == 100 * 4096


def test_freed_block_is_reused_and_not_returned():
    a = CachingAllocator().replay([("x", 50 * MiB), ("x", -1), ("y", 40 * MiB)])
    assert a.reserved == 50 * MiB  # y fits in x's cached segment
    a.replay([("z", 50 * MiB)])  # x's segment is split: 40 used, 10 free -> z needs a new one
    assert a.reserved == 100 * MiB


def test_fragmentation_that_expandable_segments_avoid():
    events = [("a", 30 * MiB), ("a", -1), ("c", 50 * MiB)]
    classic = CachingAllocator().replay(events)
    assert classic.reserved == 80 * MiB  # a's cached 30 MiB segment cannot hold c
    expandable = CachingAllocator(AllocatorConfig(expandable_segments=True)).replay(events)
    assert expandable.reserved == 50 * MiB  # the segment grows by 20 MiB past a's free space


def test_unsplit_remainder_counts_as_allocated():
    a = CachingAllocator().replay([("x", 19 * MiB + 512 * 1024)])  # 20 MiB segment, 0.5 MiB rest stays attached
    assert a.allocated == 20 * MiB


def test_parse_alloc_conf():
    cfg = AllocatorConfig.parse("expandable_segments:True, max_split_size_mb:128")
    assert cfg.expandable_segments and cfg.max_split_size_mb == 128


def _state(a: CachingAllocator) -> tuple:
    """Every block: the cached ones of each pool (their keys sorted, each key its block's, the blocks by size,
    then address) and the live ones."""
    for p in (a.small, a.large):
        assert p.free == sorted(p.free) == [a.key(b) for b in p.cached]
        assert [(b.size, b.addr) for b in p.cached] == sorted((b.size, b.addr) for b in p.cached)
        assert all(b.free for b in p.cached)
    pools = tuple((p.free, [(b.addr, b.size, b.segment, b.prev and b.prev.addr, b.next and b.next.addr)
                            for b in p.cached]) for p in (a.small, a.large))
    live = sorted((k, b.addr, b.size, b.segment, b.free) for k, b in a.live.items())
    return a.reserved, a.allocated, a.peak_allocated, pools, live


def test_the_default_replay_loop_takes_the_same_steps_as_malloc_and_free():
    """replay() and replay_columns() under the default settings run their own loop (core/allocator.py:
    _replay_default); on random sequences that mix both pools, splits, merges on either side and frees of
    unknown keys they must leave the allocator exactly as the per-event methods do, block for block."""
    import random

    rng = random.Random(17)
    sizes = [1, 512, 513, 4096, 700_000, MiB, MiB + 1, 3 * MiB, 9 * MiB, 10 * MiB, 11 * MiB + 5, 64 * MiB]
    for _case in range(40):
        events: list[tuple[int, int]] = []
        live: list[int] = []
        for key in range(rng.randrange(50, 400)):
            if live and rng.random() < 0.45:
                events.append((live.pop(rng.randrange(len(live))), -1))
            else:
                n = rng.choice(sizes) if rng.random() < 0.5 else rng.randrange(1, 30 * MiB)
                events.append((key, n))
                live.append(key)
            if rng.random() < 0.02:
                events.append((-key - 1, -1))  # never allocated: ignored by both
        fast = CachingAllocator().replay(events)
        slow = CachingAllocator()
        for key, n in events:
            slow.malloc(key, n) if n >= 0 else slow.free(key)
        assert _state(fast) == _state(slow)
        columns = CachingAllocator().replay_columns([k for k, _ in events], [n for _, n in events])
        assert _state(columns) == _state(slow)
        columns = CachingAllocator().replay_columns(tuple(k for k, _ in events), tuple(n for _, n in events))
        assert _state(columns) == _state(slow)


def test_max_split_size_keeps_large_cached_blocks_whole_and_close_in_size():
    """max_split_size_mb:64: a cached 100 MiB block is neither split for a 30 MiB request nor handed to a 70 MiB
    one (more than 20 MiB larger), but serves an 85 MiB one, split (torch's rules, core/allocator.py)."""
    a = CachingAllocator(AllocatorConfig(max_split_size_mb=64))
    a.replay([("a", 100 * MiB), ("a", -1), ("b", 30 * MiB)])
    assert a.reserved == 130 * MiB
    a.replay([("c", 70 * MiB)])
    assert a.reserved == 200 * MiB
    a.replay([("d", 85 * MiB)])
    assert a.reserved == 200 * MiB and a.allocated == (30 + 70 + 85) * MiB


def test_the_compiled_builds_searches_are_bisects():
    """_first_at_least / _first_above are what the compiled build searches the free lists with (allocator.pxd);
    held here to bisect's answers on sorted lists with repeats, at and between their keys."""
    import bisect
    import random

    from vramlab.core.allocator import _first_above, _first_at_least

    rng = random.Random(5)
    for n in (0, 1, 2, 3, 7, 64, 100):
        keys = sorted(rng.randrange(40) << 22 | rng.randrange(3) for _ in range(n))
        for key in {*keys, *(k + 1 for k in keys), *(k - 1 for k in keys), -1, 0, 1 << 61}:
            assert _first_at_least(keys, key) == bisect.bisect_left(keys, key)
            assert _first_above(keys, key) == bisect.bisect_right(keys, key)


def test_an_address_space_past_packed_keys_replays_the_same_blocks():
    """Free-list keys are machine-sized while the address space stays within PACKED_LIMIT (2**40 bytes); the
    segment that would pass it, or a request that large, widens them (core/allocator.py: _UNIT). The last
    segment that fits keeps them packed; past it, the replay loop hands over to malloc and free and every block
    is where an allocator with wide keys from the start puts it."""
    from vramlab.core.allocator import _PACKED, _WIDE, PACKED_LIMIT

    edge = PACKED_LIMIT - 2 * MiB  # the first address is 1 MiB: this segment ends 1 MiB below the limit
    a = CachingAllocator().replay([("a", edge), ("a", -1), ("b", 30 * MiB)])
    assert a.shift == _PACKED and a.next_addr << 9 == PACKED_LIMIT - 1 * MiB and a.reserved == edge
    cases = [
        [("a", edge), ("b", 4096), ("c", 4096), ("x", 3 * MiB), ("b", -1), ("d", 8 * MiB), ("a", -1),
         ("e", 50 * MiB), ("x", -1), ("f", 2 * MiB), ("g", 700_000)],  # b: its small segment passes it
        [("a", 64 * MiB), ("b", 4096), ("a", -1), ("big", PACKED_LIMIT), ("c", 30 * MiB), ("b", -1),
         ("d", 4096), ("big", -1), ("e", 12 * MiB)],  # a request of 2**40 bytes
    ]
    for events in cases:
        fast = CachingAllocator().replay(events)
        columns = CachingAllocator().replay_columns([k for k, _ in events], [n for _, n in events])
        wide = CachingAllocator()
        wide._widen()
        for key, n in events:
            wide.malloc(key, n) if n >= 0 else wide.free(key)
        assert fast.shift == columns.shift == wide.shift == _WIDE
        assert _state(fast) == _state(columns) == _state(wide)
