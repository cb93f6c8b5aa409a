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
