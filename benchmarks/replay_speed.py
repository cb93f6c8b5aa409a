"""The allocator replay (the reserved level of ``estimate(..., allocator=True)``: the window's reserved and
device levels, ``estimate``, ``fit``), for the code in this tree and, side by side in the same run, for an
older commit (``--baseline REF``, default the last commit before the written-out full-depth step and the
integer free lists). Goal (issue #17): <= 20 ms warm, <= 100 ms for a new structure.

The older code runs from ``git archive REF`` in a child process with the same Python; both measure CPU time
of their process (``time.process_time``) because the machine is shared: wall-clock figures on a loaded
machine measure the other users. The load average is recorded.

* ``new_structure_ms``: ``estimate(spec, setup, allocator=True)`` right after the fast estimate of the same
  setup (as the window asks for it), with nothing of the replay kept: the full-depth step recorded (old) or
  written out from a depth-four recording (new), evaluated and replayed. Best of 3.
* ``warm_ms``: the median over 20 new (batch, sequence) pairs of the same structure (concrete-size MoE
  models make every pair a new structure).
* ``replay_only_ms``: the allocator replay alone over the same events, as the estimator calls it
  (``CachingAllocator.replay_columns``; older trees: ``replay`` of the pairs), best of 5.
* ``reserved``: the replayed reserved level of each case, which must be the same in every column where the
  baseline replays the same step: ``baseline_replays_this_step`` is false for a baseline before 6067adc (the
  default one among them), whose estimator followed peft's LoRA lifetimes and transformers' residual adds less
  closely, so that its step, and its reserved levels, differ by design (``same_reserved`` is then recorded,
  not required).

This tree's code is measured twice: ``new`` with the allocator the install built (compiled by Cython where it
could: setup.py; ``compiled`` says which), ``new_interpreted`` with the interpreted module forced (what an
install without a C compiler gets). The older code runs interpreted (``old``: ``git archive`` has no build)
and, where it has a compiled build and Cython is installed here, compiled by its own setup.py
(``old_compiled``, else null). A run against another baseline than the default is recorded beside the
default one under a name that says what the comparison measures (``--out replay_speed-packed_keys``), not the
baseline's commit, which the file records as ``baseline_ref``.

Run: .venv/bin/python benchmarks/replay_speed.py [--baseline REF --out replay_speed-WHAT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BASELINE = "3fb1ef7"  # main before this change (issue #17: the replay's remaining goal)
# the commit from which the estimator's step is the one this tree replays (6067adc: the hand-written program
# follows peft's LoRA lifetimes and transformers' residual adds, estimate_identity digest 38ded8f0 since)
STEP_CHANGED = "6067adc"
CASES = [("llama-2-7b", dict(method="lora")),
         ("llama-3.1-8b", dict(method="qlora", lora_targets="all-linear", grad_ckpt=True)),
         ("llama-3.1-70b", dict(sharding="fsdp", gpus=8, weights="fp32", compute="bf16")),
         ("mixtral-8x7b", dict(method="qlora"))]


def _clear(est_mod) -> None:  # noqa: ANN001
    est_mod._FULL_CACHE._d.clear()
    est_mod._REPLAYED.clear()
    getattr(est_mod, "_EXPANDED", {}).clear()  # this tree's written-out steps


def measure(interpreted: bool = False) -> dict:
    """Every case, with whichever ``vramlab`` is first on sys.path; ``interpreted``: with the interpreted
    allocator even where a compiled one was built."""
    from vramlab.core import allocator
    from vramlab.core import estimate as est_mod
    from vramlab.core.catalog import find_model
    from vramlab.core.estimate import estimate
    from vramlab.core.spec.training import TrainingSetup

    CachingAllocator = allocator.CachingAllocator  # noqa: N806
    reference = getattr(allocator, "InterpretedCachingAllocator", CachingAllocator)  # older trees have one class
    if interpreted:
        CachingAllocator = est_mod.CachingAllocator = reference  # noqa: N806
    out: dict = {"code": est_mod.__file__, "compiled": CachingAllocator is not reference}
    for mid, kw in CASES:
        spec, setup = find_model(mid), TrainingSetup(**kw)
        estimate(spec, setup)  # the fast level first, as the window shows it
        first = float("inf")
        for _ in range(3):
            _clear(est_mod)
            t = time.process_time()
            r = estimate(spec, setup, allocator=True)
            first = min(first, time.process_time() - t)
        warm, reserved = [], []
        for b in range(1, 21):
            s = setup.replace(micro_batch=1 + b % 4, seq_len=256 * (1 + b % 8) + 64 * (b // 8))
            estimate(spec, s)
            t = time.process_time()
            reserved.append(estimate(spec, s, allocator=True).peak_reserved_bytes)
            warm.append(time.process_time() - t)
        full = est_mod._FULL_CACHE.get(spec, setup).tape
        ids, nbytes = full.allocation_columns(setup.micro_batch, setup.seq_len, setup.lora_rank)
        alone = float("inf")
        columns = hasattr(CachingAllocator, "replay_columns")  # what the estimator calls (older trees: pairs)
        for _ in range(5):
            t = time.process_time()
            if columns:
                CachingAllocator().replay_columns(ids, nbytes)
            else:
                CachingAllocator().replay(zip(ids, nbytes))
            alone = min(alone, time.process_time() - t)
        out[f"{mid}/{setup.method.value}"] = {
            "new_structure_ms": first * 1e3, "warm_ms": sorted(warm)[10] * 1e3, "replay_only_ms": alone * 1e3,
            "events": len(ids), "reserved": [r.peak_reserved_bytes, *reserved]}
    return out


def _child(call: str) -> dict:
    """``call`` of this module in a child process with this tree's code (a fresh process, as the old code's)."""
    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import replay_speed; "
            f"print(json.dumps(replay_speed.{call}))")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_old_compiled(ref: str) -> dict | None:
    """:func:`measure` with ``ref``'s code and its allocator compiled as its own setup.py compiles it, in a child
    process; None where ``ref`` has no compiled build, or Cython is not installed here (pip builds the
    project's own with Cython in an isolated environment: ``pip install cython`` to measure the old one)."""
    import importlib.util

    from common import ROOT, old_tree

    has_setup = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{ref}:setup.py"], capture_output=True,
                               check=False)
    if has_setup.returncode or importlib.util.find_spec("Cython") is None:
        return None
    with old_tree(ref, prefix="vramlab-replay_speed-compiled-", parts=("core", "resources", "setup.py")) as path:
        root = (path / "vramlab" / "core").resolve().parent  # the archive, whose core/ the package's points to
        (root / "vramlab" / "core").mkdir(parents=True)  # where build_ext --inplace puts the module (no package-dir)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root, check=True,
                       capture_output=True)
        for built in (root / "vramlab" / "core").glob("_allocator_c.*"):
            built.rename(root / "core" / built.name)
        code = (f"import sys, json; sys.path.insert(0, {str(path)!r}); sys.path.insert(0, {str(HERE)!r});"
                f"import replay_speed; print(json.dumps(replay_speed.measure()))")
        done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    from common import measure_old, record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help="git ref of the older code measured alongside")
    ap.add_argument("--out", help="result name, saying what the comparison measures (needed with --baseline)")
    args = ap.parse_args()
    if args.out is None and args.baseline != BASELINE:
        ap.error("name the result by what it compares: --out replay_speed-WHAT (e.g. replay_speed-packed_keys)")
    data: dict = {"note": "CPU milliseconds of the benchmark process, old and new in one run on a shared, loaded "
                          "2-core machine", "load_average_start": os.getloadavg(), "baseline_ref": args.baseline}
    data["old"] = measure_old(args.baseline, "replay_speed", "measure()")
    data["old_compiled"] = measure_old_compiled(args.baseline)
    data["new_interpreted"] = _child("measure(interpreted=True)")
    data["new"] = measure()
    data["load_average_end"] = os.getloadavg()
    cases = [k for k in data["new"] if "/" in k]
    olds = [data["old"]] + ([data["old_compiled"]] if data["old_compiled"] else [])
    data["same_reserved"] = all(old[k]["reserved"] == data["new"][k]["reserved"] for old in olds for k in cases)
    data["compiled_same_reserved"] = all(data["new_interpreted"][k]["reserved"] == data["new"][k]["reserved"]
                                         for k in cases)
    # a baseline older than STEP_CHANGED replays another step (the tape changed on purpose there), so its reserved
    # levels differ from this tree's by design: recorded, and not a failure
    data["baseline_replays_this_step"] = _descends(args.baseline, STEP_CHANGED)
    print(record(args.out or "replay_speed", data))
    print(json.dumps(data, indent=2))
    same = data["same_reserved"] or not data["baseline_replays_this_step"]
    return 0 if same and data["compiled_same_reserved"] else 1


def _descends(ref: str, ancestor: str) -> bool:
    """Whether ``ref`` is ``ancestor`` or comes after it in this repository's history."""
    done = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, ref], cwd=HERE, capture_output=True,
                          check=False)
    return done.returncode == 0


if __name__ == "__main__":
    raise SystemExit(main())
