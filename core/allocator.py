"""A model of PyTorch's CUDA caching allocator, replayed over a step's exact sequence of allocations.

What it reproduces (c10/cuda/CUDACachingAllocator.cpp, single stream):

* sizes round up to 512-byte blocks; requests up to 1 MiB come from the *small pool*, whose segments are
  2 MiB; larger requests from the *large pool*, whose segments are 20 MiB for requests under 10 MiB and
  the request rounded up to 2 MiB otherwise;
* a request takes the smallest free cached block that fits (best fit); the block is split when the
  rest is at least 512 bytes (small pool) or more than 1 MiB (large pool), otherwise the whole block is
  handed out — so ``max_memory_allocated`` itself can exceed the tensor bytes slightly;
* a freed block merges with free neighbours of its segment; segments are never returned (no
  ``empty_cache``), so the reserved level only grows: its peak is the reserved level at the end;
* ``max_split_size_mb``: blocks of at least that size are never split for smaller requests, and a large
  request does not take a block more than 20 MiB larger than itself;
* ``expandable_segments``: one segment per pool that grows in 2 MiB pages, so freed space anywhere can be
  reused for any later request.

Limitations: one CUDA stream (no cross-stream reuse rules), no out-of-memory retries (the GPU is assumed
large enough; near capacity the real allocator frees its cache and retries, so the reserved peak can
only be lower).
"""

from __future__ import annotations

import bisect
import gc
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vramlab.core.checks import SetupError

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
PAGE = 2 << 20
# Addresses count 512-byte units (_UNIT: every block's size and address is a whole number of them, as requests
# round up to 512 bytes, segments and pages to 2 MiB, and the first address is 1 MiB); sizes are bytes. A free
# list's keys are size << shift | addr, so that one integer compare orders blocks by size, then address: the
# size, a multiple of 512, leaves the key's low shift + 9 bits to the address. ``shift`` is the allocator's:
# _PACKED while the address space used is at most PACKED_LIMIT bytes (2**40, 2**31 units): an address then fits
# its 31 bits, and a cached block's size, within its segment, is below 2**40, so that a key is below 2**62, a
# machine integer in the compiled build; _WIDE (keys of any size, Python integers) once a segment would pass
# the limit or a request is that large (CachingAllocator._widen).
_UNIT = 9
_PACKED = 31 - _UNIT
_WIDE = 64
PACKED_LIMIT = 1 << 40
# empty here; in the compiled copy of this file (setup.py: module _allocator_c) the sha256 of the text it was
# compiled from, so that an edited allocator.py is never shadowed by an older build (see the end of this file)
COMPILED_FROM = ""


def round_size(size: int) -> int:
    if size < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


class _Block:
    """A block of a segment, allocated or cached (free): ``addr`` in 512-byte units (see _UNIT), ``size`` in
    bytes, ``segment`` the address of its segment; ``prev`` / ``next``: its neighbours in the segment.
    A plain class rather than a dataclass so that the compiled build can make it a typed extension type
    (allocator.pxd)."""

    __slots__ = ("addr", "free", "next", "prev", "segment", "size")

    def __init__(self, addr: int, size: int, segment: int, free: bool = True, prev: _Block | None = None,
                 next: _Block | None = None) -> None:  # noqa: A002 - the field's name in c10's Block
        self.addr = addr
        self.size = size
        self.segment = segment
        self.free = free
        self.prev = prev
        self.next = next


@dataclass(frozen=True)
class AllocatorConfig:
    expandable_segments: bool = False
    max_split_size_mb: int | None = None

    @classmethod
    def parse(cls, text: str) -> AllocatorConfig:
        """PYTORCH_CUDA_ALLOC_CONF syntax: 'expandable_segments:True,max_split_size_mb:128'. torch's other
        options (garbage_collection_threshold, roundup_power2_divisions, ...) are accepted and not modelled.
        A value torch would refuse, or one we cannot read exactly ('128MB'), is a SetupError saying the form."""
        exp, split = False, None
        for item in filter(None, (x.strip() for x in str(text).split(","))):
            key, sep, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if not sep or not key:
                raise SetupError(f"allocator option {item[:40]!r} is not key:value (e.g. expandable_segments:True)")
            if key == "expandable_segments":
                if value not in ("True", "False"):  # torch accepts exactly these two
                    raise SetupError(f"expandable_segments takes True or False (got {value[:40]!r})")
                exp = value == "True"
            elif key == "max_split_size_mb":
                if not re.fullmatch(r"[0-9]{1,9}", value):
                    raise SetupError(f"max_split_size_mb takes a whole number of MiB such as 128 (got {value[:40]!r})")
                split = int(value)
                if split <= 20:  # torch: "max_split_size_mb too small, must be > 20"
                    raise SetupError(f"max_split_size_mb must be more than 20 (got {split}), as torch requires")
        return cls(exp, split)


class _Pool:
    def __init__(self, small: bool, cfg: AllocatorConfig, owner: CachingAllocator) -> None:
        self.small = small
        self.cfg = cfg
        self.owner = owner
        # the cached (free) blocks, sorted by size, then address: their keys (_UNIT: one integer compare per
        # bisection step) and, at the same index, the blocks; an allocated block is in the owner's live
        self.free: list[int] = []
        self.cached: list[_Block] = []
        self.expandable_end: int | None = None  # expandable segment: next free address (units)
        self.max_split = (cfg.max_split_size_mb << 20) if cfg.max_split_size_mb else None

    def _insert_free(self, b: _Block) -> None:
        key = self.owner.key(b)
        i = bisect.bisect_right(self.free, key)
        self.free.insert(i, key)
        self.cached.insert(i, b)

    def _remove_free(self, b: _Block) -> None:
        i = bisect.bisect_left(self.free, self.owner.key(b))
        del self.free[i]
        del self.cached[i]

    def _fits(self, block_size: int, size: int) -> bool:
        ms = self.max_split
        if ms is None:
            return True
        if size < ms and block_size >= ms:
            return False
        return not (size >= ms and block_size >= size + LARGE_BUFFER)

    def malloc(self, size: int) -> _Block:
        free = self.free
        i = bisect.bisect_left(free, size << self.owner.shift)  # the first block at least as large
        if self.max_split is None:  # best fit: the first cached block at least as large
            if i < len(free):
                del free[i]
                return self._take(self.cached.pop(i), size)
            return self._take(self._new_segment(size), size)
        while i < len(free):
            if self._fits(self.cached[i].size, size):
                del free[i]
                return self._take(self.cached.pop(i), size)
            i += 1
        return self._take(self._new_segment(size), size)

    def _new_segment(self, size: int) -> _Block:
        if self.cfg.expandable_segments:
            return self._expand(size)
        seg = segment_size(size)
        addr = self.owner.claim(seg)
        self.owner.reserved += seg
        return _Block(addr, seg, addr)

    def _expand(self, size: int) -> _Block:
        """Grow the pool's single segment by whole pages, joining a free block at its end if any."""
        if self.expandable_end is None:
            self.expandable_end = self.owner.claim(1 << 50)  # a large virtual range
        tail = next((b for b in self.cached if b.addr + (b.size >> _UNIT) == self.expandable_end), None)
        need = size - (tail.size if tail else 0)
        grow = PAGE * ((need + PAGE - 1) // PAGE)
        self.owner.reserved += grow
        if tail is not None:
            self._remove_free(tail)
            tail.size += grow
            self.expandable_end += grow >> _UNIT
            return tail
        block = _Block(self.expandable_end, grow, 0)
        # the segment's last block, allocated (a cached one would have been the tail): one of this pool's (an
        # allocated block is at most 1 MiB in the small pool, larger in the large one)
        prev = next((b for b in self.owner.live.values()
                     if b.addr + (b.size >> _UNIT) == block.addr and (b.size <= SMALL_SIZE) == self.small), None)
        if prev is not None:
            prev.next, block.prev = block, prev
        self.expandable_end += grow >> _UNIT
        return block

    def _take(self, block: _Block, size: int) -> _Block:
        rest = block.size - size
        split = rest >= MIN_BLOCK if self.small else rest > SMALL_SIZE
        if self.max_split is not None and not self.small and block.size >= self.max_split:
            split = False if size < self.max_split else split
        if split:
            tail = _Block(block.addr + (size >> _UNIT), rest, block.segment, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._insert_free(tail)
        block.free = False
        return block

    def release(self, block: _Block) -> None:
        block.free = True
        for nb in (block.prev, block.next):
            if nb is not None and nb.free and (nb.segment == block.segment or self.cfg.expandable_segments):
                self._remove_free(nb)
                if nb is block.prev:
                    nb.size += block.size
                    nb.next = block.next
                    if block.next is not None:
                        block.next.prev = nb
                    block = nb
                else:
                    block.size += nb.size
                    block.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = block
        self._insert_free(block)


class CachingAllocator:
    """Replay allocations and frees; read ``reserved`` / ``peak_reserved`` / ``peak_allocated``."""

    def __init__(self, cfg: AllocatorConfig | None = None) -> None:
        self.cfg = cfg or AllocatorConfig()
        self.next_addr = (1 << 20) >> _UNIT  # in units, as every address (see _UNIT)
        self.shift = _PACKED  # the free lists' keys: see _UNIT
        self.reserved = 0
        self.allocated = 0
        self.peak_allocated = 0
        self.small = _Pool(True, self.cfg, self)
        self.large = _Pool(False, self.cfg, self)
        # allocated blocks by key; a block's pool is its size's: at most 1 MiB small (a request of at most 1 MiB
        # takes a block less than 512 bytes larger), more large
        self.live: dict[object, _Block] = {}

    def key(self, block: _Block) -> int:
        """``block``'s key in a free list (see _UNIT)."""
        return block.size << self.shift | block.addr

    def claim(self, length: int) -> int:
        """The address of ``length`` new bytes of address space (a segment, or an expandable one's range)."""
        if self.next_addr + (length >> _UNIT) > PACKED_LIMIT >> _UNIT:
            self._widen()
        addr = self.next_addr
        self.next_addr += length >> _UNIT
        return addr

    def _widen(self) -> None:
        """Free-list keys of any size from now on: the address space passes what packed keys hold (_UNIT)."""
        if self.shift != _WIDE:
            self.shift = _WIDE
            for pool in (self.small, self.large):
                pool.free[:] = [self.key(b) for b in pool.cached]  # the same order: by size, then address

    def malloc(self, key: object, nbytes: int) -> None:
        size = MIN_BLOCK * ((nbytes + MIN_BLOCK - 1) // MIN_BLOCK) if nbytes > MIN_BLOCK else MIN_BLOCK
        if size >= PACKED_LIMIT:  # its search key would not be packed; no cached block is that large
            self._widen()
        pool = self.small if size <= SMALL_SIZE else self.large
        block = pool.malloc(size)
        self.live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        block = self.live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        (self.small if block.size <= SMALL_SIZE else self.large).release(block)

    @property
    def peak_reserved(self) -> int:
        return self.reserved  # segments are never released

    def replay(self, events: Iterable[tuple[object, int]]) -> CachingAllocator:
        """``events``: (key, +bytes) to allocate, (key, -1) to free."""
        if self.cfg.expandable_segments or self.cfg.max_split_size_mb is not None:
            malloc, free = self.malloc, self.free
            for key, n in events:
                if n >= 0:
                    malloc(key, n)
                else:
                    free(key)
            return self
        pairs = events if isinstance(events, list) else list(events)
        _replay_default(self, [key for key, _ in pairs], [n for _, n in pairs])
        return self

    def replay_columns(self, ids: Sequence[object], nbytes: Sequence[int]) -> CachingAllocator:
        """``replay(zip(ids, nbytes))`` without a pair per event (the estimator's allocations come as two
        lists, which are read as they are; other sequences are copied into lists first)."""
        if self.cfg.expandable_segments or self.cfg.max_split_size_mb is not None:
            return self.replay(zip(ids, nbytes))
        _replay_default(self, ids if type(ids) is list else list(ids),
                        nbytes if type(nbytes) is list else list(nbytes))
        return self


def _replay_default(alloc: CachingAllocator, ids: list[object], nbytes: list[int]) -> None:
    """:func:`_replay_events` with Python's cyclic garbage collector paused: the blocks a replay creates are
    tens of thousands of linked objects, and collections that walk them again and again while they are being
    made were 5-15 % of a replay (the collector resumes afterwards, and finds them when they are garbage).
    The events it leaves (an address space past packed keys, see _UNIT) go through malloc and free."""
    enabled = gc.isenabled()  # off already where the app's workers run (app/workers.py: GcPause): left so
    gc.disable()
    try:
        taken = _replay_events(alloc, ids, nbytes) if alloc.shift == _PACKED else 0
        malloc, free = alloc.malloc, alloc.free
        for i in range(taken, len(ids)):
            if nbytes[i] >= 0:
                malloc(ids[i], nbytes[i])
            else:
                free(ids[i])
    finally:
        if enabled:
            gc.enable()


def _replay_events(alloc: CachingAllocator, ids: list[object], nbytes: list[int]) -> int:
    """:meth:`CachingAllocator.replay` under torch's default settings (fixed segments, no ``max_split_size_mb``),
    with packed free-list keys: the same steps as :meth:`~CachingAllocator.malloc` and
    :meth:`~CachingAllocator.free` (best fit, split, merge with free neighbours of the segment), written out in
    one loop with the constants in local names. A replay is tens of thousands of these; the calls between the
    methods were most of its time (tests/test_allocator.py holds the two equal on random sequences).
    allocator.pxd types it for the compiled build, where the keys are machine integers. The events come as
    columns: keys, and bytes to allocate (-1: free). Returns how many it took: all, or those before the
    first one that needs wider keys (a request or a segment past PACKED_LIMIT)."""
    small, large = alloc.small, alloc.large
    sfree, lfree = small.free, large.free
    scached, lcached = small.cached, large.cached
    live = alloc.live
    bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right
    typed = COMPILED_FROM != ""  # the compiled build: its own searches over machine integers (_first_at_least)
    allocated, peak = alloc.allocated, alloc.peak_allocated
    next_addr, reserved = alloc.next_addr, alloc.reserved
    shift, unit, limit, end = _PACKED, _UNIT, PACKED_LIMIT, PACKED_LIMIT >> _UNIT
    min_block, small_size, small_buffer = MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER
    large_buffer, min_large, round_large = LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE
    taken = len(ids)
    for e, key in enumerate(ids):
        n = nbytes[e]
        if n >= 0:
            size = (n + min_block - 1) & -min_block if n > min_block else min_block
            tiny = size <= small_size
            if tiny:
                free, cached = sfree, scached
            elif size < limit:
                free, cached = lfree, lcached
            else:  # its search key would not be packed
                taken = e
                break
            i = _first_at_least(free, size << shift) if typed else bisect_left(free, size << shift)
            if i < len(free):
                free.pop(i)
                block = cached.pop(i)
            else:  # a new segment (segment_size, written out)
                if tiny:
                    seg = small_buffer
                elif size < min_large:
                    seg = large_buffer
                else:
                    seg = (size + round_large - 1) & -round_large
                if seg >> unit > end - next_addr:  # past packed keys (CachingAllocator.claim)
                    taken = e
                    break
                # _Block(next_addr, seg, next_addr) without the call's argument parsing (the compiled build
                # makes the object directly)
                block = _Block.__new__(_Block)
                block.addr = next_addr
                block.size = seg
                block.segment = next_addr
                block.prev = None
                block.next = None
                next_addr += seg >> unit
                reserved += seg
            rest = block.size - size
            if rest >= min_block if tiny else rest > small_size:
                nxt = block.next
                addr = block.addr + (size >> unit)
                tail = _Block.__new__(_Block)  # _Block(addr, rest, block.segment, True, block, nxt)
                tail.addr = addr
                tail.size = rest
                tail.segment = block.segment
                tail.free = True
                tail.prev = block
                tail.next = nxt
                if nxt is not None:
                    nxt.prev = tail
                block.next = tail
                block.size = size
                cut = rest << shift | addr
                i = _first_above(free, cut) if typed else bisect_right(free, cut)
                free.insert(i, cut)
                cached.insert(i, tail)
            block.free = False
            live[key] = block
            allocated += block.size
            if allocated > peak:  # noqa: PLR1730 - max() is a call per allocation
                peak = allocated
            continue
        block = live.pop(key, None)
        if block is None:  # never allocated, or freed already
            continue
        size = block.size
        allocated -= size
        if size <= small_size:
            free, cached = sfree, scached
        else:
            free, cached = lfree, lcached
        block.free = True
        # a block's neighbours are of its own segment (only expandable segments link blocks across, and they do
        # not take this loop): a free one merges (release(), without its segment compare)
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            cut = prev.size << shift | prev.addr
            i = _first_at_least(free, cut) if typed else bisect_left(free, cut)
            free.pop(i)
            cached.pop(i)
            prev.size += size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            cut = nxt.size << shift | nxt.addr
            i = _first_at_least(free, cut) if typed else bisect_left(free, cut)
            free.pop(i)
            cached.pop(i)
            block.size += nxt.size
            after = nxt.next
            block.next = after
            if after is not None:
                after.prev = block
        cut = block.size << shift | block.addr
        i = _first_above(free, cut) if typed else bisect_right(free, cut)
        free.insert(i, cut)
        cached.insert(i, block)
    alloc.allocated, alloc.peak_allocated = allocated, peak
    alloc.next_addr, alloc.reserved = next_addr, reserved
    return taken


def _first_at_least(keys: list[int], key: int) -> int:
    """``bisect.bisect_left(keys, key)``, for the compiled build: there, where the keys are packed (machine
    integers, see _UNIT), allocator.pxd makes this a C function, whose compares are machine instructions
    where bisect's are calls through Python's comparison. The interpreted build calls bisect's."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi) >> 1
        k = keys[mid]
        if k < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _first_above(keys: list[int], key: int) -> int:
    """``bisect.bisect_right(keys, key)``, as :func:`_first_at_least`."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi) >> 1
        k = keys[mid]
        if k <= key:
            lo = mid + 1
        else:
            hi = mid
    return lo


InterpretedCachingAllocator = CachingAllocator


def _compiled() -> type[CachingAllocator] | None:
    """The compiled build's CachingAllocator (this same file compiled by Cython as ``_allocator_c``, where
    ``pip install`` found Cython and a C compiler: setup.py), if it was compiled from this file as it is now;
    None where there is none or it is older (the interpreted class then serves: the same results, slower).
    tests/test_allocator_compiled.py holds the two to the same state on random event streams."""
    try:
        from vramlab.core import _allocator_c  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        text = Path(__file__).read_bytes()
    except OSError:  # a packaged app ships no source: its build compiled the file it bundles
        return _allocator_c.CachingAllocator
    return _allocator_c.CachingAllocator if _allocator_c.COMPILED_FROM == hashlib.sha256(text).hexdigest() else None


if not COMPILED_FROM:  # this file, not its compiled copy
    CachingAllocator = _compiled() or CachingAllocator  # type: ignore[misc]
