"""The full-depth allocation sequence of a step for the allocator replay, without replaying every layer.

The allocator replay needs every allocation and free of the step with the allocation each belongs to;
the fast tape folds the repeated layers into one block, which does not say which repetition frees what.
Recording the step at full depth costs a replay of every layer (0.1-0.3 s for 32-80 layers); this module
records it at depth four instead — layers ``0, 1, 2, n-1`` of the real model, each under its own tag — and
writes out layers ``3 .. n-2`` as copies of layer 2. (With some layers frozen, each run of alike layers,
frozen or trained, is written out so from its own four: its first, second, third and last.)

Layers 1 and 2 are both middle layers with a middle layer on one side: every run of layer 1's events
stands beside a run of layer 2's (before it where the layers go upward, after it where they go down), and
the two runs must hold the same sizes, signs and kinds in the same order, each event belonging to an
allocation in the same relation to the run's layer:

* *own*: the layer's own allocation, the same one counted in the layer's own allocation order;
* *below*: an allocation of the layer beneath it (layer 0 for layer 1; layer 1 for layer 2), e.g. the
  hidden state it was handed;
* *above*: one of the layer above it (layer 2 for layer 1; layer ``n-1`` for layer 2), e.g. the gradient
  its backward was handed.

Where all of that holds, a copy of layer 2 at depth ``j`` is layer 2 with its own allocations renamed,
its *below* ones those of layer ``j-1`` and its *above* ones those of layer ``j+1`` (layer ``n-1``'s for
the last copy); layer 2 then hands over to the first copy instead of layer ``n-1``, and layer ``n-1`` to
the last copy instead of layer 2. Anything else — an allocation of a middle layer freed outside its
neighbours' runs, a run of layer 1 or 2 without its partner, two middle layers told apart by their size —
and :func:`record` answers None: the caller records the full depth as before. tests/test_expand.py holds
the sequence equal, event for event, to the full-depth recording's over varied setups.
"""

from __future__ import annotations

import functools
import gc
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vramlab.core.estimator import unsloth_gc
from vramlab.core.estimator.engine import BLOCK, Engine
from vramlab.core.estimator.poly import MONOMIALS, Poly, monomial_values
from vramlab.core.estimator.tape import INT_LIMIT, too_large
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.sharded_precision import deepspeed_splits
from vramlab.core.spec.training import TrainingSetup

if TYPE_CHECKING:  # imported where used: the driver imports this package
    from vramlab.core.estimator.driver import StepModel
    from vramlab.core.estimator.program import Dims

_NONE, _OWN, _BELOW, _ABOVE = 0, 1, 2, 3


@dataclass(frozen=True, eq=False)
class Expanded:
    """A step's full-depth rows as indices into the depth-four tape's rows, with their allocations."""

    coef: np.ndarray  # (rows of the depth-four tape, monomials) sizes
    sign: np.ndarray  # (rows,) +1 allocate, -1 free, 0 reclassify
    rows: np.ndarray  # (full-depth rows,) the depth-four row each full-depth row repeats
    ids: np.ndarray  # (full-depth rows,) the allocation each belongs to (0: none)
    bound: np.ndarray  # (monomials,) every full-depth row's size in absolute value, summed

    def allocation_columns(self, b: int, s: int, r: int) -> tuple[list[int], list[int]]:
        """:meth:`Tape.allocation_columns` of the full-depth tape: ids, and bytes to allocate (-1: free). Read
        the lists, do not change them: where every allocation has bytes (most points), the ids are one list
        kept for the structure (a warm replay then spends its time in the replay, not in building them)."""
        exact = monomial_values(int(b), int(s), int(r))
        if float(self.bound @ np.array(exact, dtype=np.float64)) + BLOCK * len(self.rows) >= INT_LIMIT:
            raise too_large()
        raw = self.coef @ np.array([v if used else 0 for v, used in zip(exact, self.bound > 0)], dtype=np.int64)
        rows, ids, id_list, recorded = self._owned
        nbytes = np.where(self.sign > 0, raw, -1)[rows]
        empty = raw <= 0  # by recorded row: sizes that are zero at this point (their events are left out)
        if not (empty & recorded).any():
            return id_list, nbytes.tolist()
        use = ~empty[rows]
        return ids[use].tolist(), nbytes[use].tolist()

    @functools.cached_property
    def _owned(self) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray]:
        """The rows of the events that belong to an allocation (id not 0), their ids (an array and a list), and
        which recorded rows they repeat (a mask over the recorded rows)."""
        owned = self.ids != 0
        rows, ids = self.rows[owned], self.ids[owned]
        recorded = np.zeros(len(self.sign), dtype=bool)
        recorded[rows] = True
        return rows, ids, ids.tolist(), recorded


def record(spec: ModelSpec, setup: TrainingSetup, symbolic: tuple[bool, bool, bool]) -> Expanded | None:
    """The full-depth allocation sequence of ``setup`` (CUDA, not the simulation's), from a recording with four
    layers of each run of at least five alike layers; None where there is no such run, or where the
    recording does not show the layers repeating (see the module docstring)."""
    from vramlab.core.estimator import layer_plan
    from vramlab.core.estimator.driver import StepModel
    from vramlab.core.estimator.program import Dims, Model

    short, mult = layer_plan(spec, setup)
    if spec.vision is not None or not mult or deepspeed_splits(spec.param_count, setup):
        return None
    # each middle layer stands for the run between its neighbours: first, first + 1, ..., last
    if any(not 0 < q < len(short) - 1 or short[q] != short[q - 1] + 1 or short[q + 1] - short[q - 1] != m + 1
           for q, m in mult.items()):
        return None
    plan: list[int] = []
    groups: list[tuple[int, int]] = []  # (tag of a run's first layer, layers in the run)
    for q, layer in enumerate(short):
        if q - 1 in mult:  # the middle of a run stood for mult layers: record two of them
            plan.append(layer)
            if mult[q - 1] > 2:
                groups.append((len(plan) - 4, mult[q - 1] + 2))
        elif q in mult:
            plan.extend((layer, layer + 1))
        else:
            plan.append(layer)
    if not groups:
        return None
    b = Poly.var("b") if symbolic[0] else setup.micro_batch
    s = Poly.var("s") if symbolic[1] else setup.seq_len
    r = Poly.var("r") if symbolic[2] else setup.lora_rank
    # Python's cyclic collector paused while the step is recorded, as in the allocator's replay: the recording
    # makes some 40,000 linked objects (storages, nodes, tape rows), and collections walking them again and
    # again while they are made were 10-15 % of it (Mixtral-8x7B). It resumes once they are gone (they hold
    # no cycle: their references free them), so that no collection walks them afterwards either
    enabled = gc.isenabled()
    gc.disable()
    try:
        engine = Engine()
        engine.ckpt_reentrant = setup.ckpt_reentrant or setup.ckpt_offload  # the offloaded one: reentrant-style
        engine.ckpt_offload = setup.ckpt_offload
        unsloth_gc.attach(engine, setup)
        coef, sign, kinds, tag, hids = _recorded(StepModel(Model(spec, setup, engine, rank=r, plan=plan)),
                                                 Dims(b, s, setup.micro_batch > 1, spec.sdpa_mask(setup.seq_len)))
    finally:
        if enabled:
            gc.enable()
    seq: tuple[np.ndarray, np.ndarray, np.ndarray] | None = (np.arange(len(coef)), tag, hids)
    for first, layers in groups:
        seq = expand_run(coef, sign, kinds, *seq, first, layers)
        if seq is None:
            return None
    rows, _tags, ids = seq
    counts = np.bincount(rows, minlength=len(coef))
    bound = (np.abs(coef).astype(np.float64) * counts[:, None]).sum(axis=0)
    return Expanded(coef, sign, rows, ids, bound)


def _recorded(sm: StepModel, dims: Dims) -> tuple[np.ndarray, ...]:
    """The step ``sm`` recorded: its rows' coefficients (rows, monomials), signs, kinds (kind * 1000 + new
    kind), tags and allocations, as arrays; the engine and everything it made go when this returns."""
    sm.run(dims)
    e = sm.engine
    polys, sign, kind, new_kind, tag, _phase = zip(*e.tape)
    # one flat pass over the coefficients (np.array of the tuples is three times slower: 8 ms for an MoE step)
    coef = np.fromiter(itertools.chain.from_iterable(p.coefficients for p in polys), dtype=np.int64,
                       count=len(polys) * len(MONOMIALS)).reshape(len(polys), len(MONOMIALS))
    kinds = np.array(kind, dtype=np.int64) * 1000 + np.array(new_kind, dtype=np.int64)
    return (coef, np.array(sign, dtype=np.int64), kinds, np.array(tag, dtype=np.int64),
            np.array(e.hids, dtype=np.int64))


def expand_run(coef: np.ndarray, sign: np.ndarray, kinds: np.ndarray, rows: np.ndarray, tag: np.ndarray,
            hid: np.ndarray, first: int, layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(rows, tags, ids) with one run of ``layers`` alike layers written out, from the sequence ``rows`` (of
    the recorded rows), ``tag``, ``hid`` where it has four: tags ``first`` .. ``first + 3`` are its layers
    0, 1, 2 and its last. Copies keep layer 2's tag."""
    t0, t1, t2, t3 = first, first + 1, first + 2, first + 3
    top = int(hid.max(initial=0)) + 1
    alloc = (sign[rows] > 0) & (hid > 0)
    owner = np.full(top, -2, dtype=np.int64)  # the tag of the event that allocated each id
    owner[hid[alloc]] = tag[alloc]
    owner[0] = -3
    local = np.zeros(top, dtype=np.int64)  # an id's place in its layer's own allocation order
    for t in (t1, t2):
        mine = hid[alloc & (tag == t)]
        local[mine] = np.arange(len(mine))
    own2 = hid[alloc & (tag == t2)]
    width = len(own2)
    if width != int((alloc & (tag == t1)).sum()):
        return None
    copies = layers - 4
    base = top

    # runs of one tag; every run of layer 1 or 2 paired with the other's beside it
    change = np.flatnonzero(np.diff(tag)) + 1
    starts, ends = np.concatenate(([0], change)), np.concatenate((change, [len(tag)]))
    runs = [(int(tag[a]), int(a), int(e)) for a, e in zip(starts, ends)]
    out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    i = 0
    while i < len(runs):
        t, a, e = runs[i]
        if t not in (t1, t2):
            ids = hid[a:e].copy()
            held = owner[ids]
            if (t != t0 and (held == t1).any()) or (t != t3 and (held == t2).any()):
                return None  # a middle layer's allocation freed outside its neighbours
            if t == t3:  # the last layer hands over to the last copy instead of layer 2
                mid = held == t2
                ids[mid] = base + (copies - 1) * width + local[ids[mid]]
            out.append((rows[a:e], tag[a:e], ids))
            i += 1
            continue
        if i + 1 >= len(runs) or runs[i + 1][0] != 2 * first + 3 - t:
            return None
        one, two = (runs[i], runs[i + 1]) if t == t1 else (runs[i + 1], runs[i])
        rows1, rows2 = rows[one[1]:one[2]], rows[two[1]:two[2]]
        if len(rows1) != len(rows2) or not (np.array_equal(coef[rows1], coef[rows2])
                                            and np.array_equal(sign[rows1], sign[rows2])
                                            and np.array_equal(kinds[rows1], kinds[rows2])):
            return None
        h1, h2 = hid[one[1]:one[2]], hid[two[1]:two[2]]
        o1, o2 = owner[h1], owner[h2]
        cls = np.full(len(h1), -1, dtype=np.int64)
        idx = np.zeros(len(h1), dtype=np.int64)
        cls[(h1 == 0) & (h2 == 0)] = _NONE
        own = (o1 == t1) & (o2 == t2) & (local[h1] == local[h2])
        cls[own], idx[own] = _OWN, local[h1[own]]
        below = (o1 == t0) & (o2 == t1)
        cls[below], idx[below] = _BELOW, local[h2[below]]
        above = (o1 == t2) & (o2 == t3)
        cls[above], idx[above] = _ABOVE, local[h1[above]]
        if (cls < 0).any():
            return None
        ids2 = h2.copy()
        ids2[above] = base + idx[above]  # layer 2 hands over to the first copy instead of the last layer
        c = np.arange(copies)[:, None]
        block = np.zeros((copies, len(h1)), dtype=np.int64)
        block[:, own] = base + c * width + idx[own]
        block[:, below] = np.where(c == 0, own2[idx[below]], base + (c - 1) * width + idx[below])
        block[:, above] = np.where(c == copies - 1, h2[above], base + (c + 1) * width + idx[above])
        tags2 = tag[two[1]:two[2]]
        part = [(rows1, tag[one[1]:one[2]], h1), (rows2, tags2, ids2), *((rows2, tags2, ids) for ids in block)]
        out += part if t == t1 else part[::-1]  # downward: the last copy first, layer 1 last
        i += 2
    return tuple(np.concatenate(x) for x in zip(*out))
