"""The fast simulation (meta tensors, ``simulate``'s default) against the reference (FakeTensorMode,
``simulate(fast=False)``), event by event, over the accuracy matrix, the published comparison and the
objectives: every allocation and free with its serial, the live-bytes timeline, the phase marks, every
phase's peak with its breakdown, the global peak with what was alive then, and the parameter counts.

A setup the meta path cannot run (torch's fused AdamW refuses meta parameters) is simulated on fake tensors
by ``simulate``; it is listed as such, with the reason. Run (about 20 minutes on two idle cores; the
reference is most of it):
    .venv/bin/python benchmarks/simulate_identity.py
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from common import record  # noqa: E402

from tests.support import simulate_paths  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402


def cases() -> list[tuple[str, object, TrainingSetup]]:
    from estimate_identity import cases as estimate_cases

    from tests.test_objectives import CASES, PAIR_CASES, PAIR_FAMILIES

    estimated = list(estimate_cases())
    objectives = [(f"objective-{i:02d}-{family}-{fields['objective']}", PAIR_FAMILIES[family], TrainingSetup(**fields))
                  for i, (family, fields) in enumerate([*CASES, *PAIR_CASES])]
    # interleaved, so that a run stopped early has compared some of each
    groups = [[c for c in estimated if not c[0].startswith("published-")],
              [c for c in estimated if c[0].startswith("published-")], objectives]
    return [c for row in itertools.zip_longest(*groups) for c in row if c is not None]


def save(rows: dict, digest: str, total: int, updated: list[str] | None = None) -> None:
    counts: dict[str, int] = {}
    for row in rows.values():
        counts[row["result"]] = counts.get(row["result"], 0) + 1
    data = {"note": "timings on a shared, loaded machine (load average below); only the identity counts",
            "load_average": os.getloadavg(), "compared": f"{len(rows)} of {total} setups", "counts": counts,
            "sha256_of_reference_events": digest, **({"updated": updated} if updated else {}), "setups": rows}
    record("simulate_identity", data)


def main() -> int:
    """Arguments: labels (or parts of them) to compare only those, printed; ``--update LABEL...`` compares
    them and replaces their rows in the recorded result."""
    rows: dict[str, dict] = {}
    digest = hashlib.sha256()
    only = sys.argv[1:]
    update = bool(only) and only[0] == "--update"
    if update:
        only = only[1:]
        previous = json.loads((Path(__file__).resolve().parent / "results" / "simulate_identity.json").read_text())
    todo = [c for c in cases() if not only or any(o in c[0] for o in only)]
    for label, spec, setup in todo:
        t = time.perf_counter()
        reference = simulate_paths.reference(spec, setup)
        t_ref = time.perf_counter() - t
        t = time.perf_counter()
        try:
            fast = simulate_paths.fast(spec, setup)
        except Exception as e:  # noqa: BLE001 - the setups simulate() runs on fake tensors instead
            rows[label] = {"result": "fake tensors", "reason": f"{type(e).__name__}: {str(e)[:160]}"}
            print(label, rows[label], flush=True)
            if not only:
                save(rows, digest.hexdigest(), len(todo))
            continue
        t_fast = time.perf_counter() - t
        diff = simulate_paths.first_difference(reference, fast)
        digest.update(repr(sorted(reference.items())).encode())
        rows[label] = {"result": "identical" if diff is None else "DIFFERS", "events": len(reference["timeline"]),
                       "reference_s": round(t_ref, 2), "fast_s": round(t_fast, 2), **({"where": diff} if diff else {})}
        print(label, rows[label], flush=True)
        if not only:  # recorded as it goes: a stopped run leaves what it compared
            save(rows, digest.hexdigest(), len(todo))
    if update:  # the other rows as recorded; their digest is the recorded run's
        merged = {**previous["setups"], **rows}
        total = int(previous["compared"].split(" of ")[1].split()[0])
        save(merged, previous["sha256_of_reference_events"], total, [*previous.get("updated", []), *rows])
        rows = merged
    differs = [label for label, row in rows.items() if row["result"] == "DIFFERS"]
    print(json.dumps({"compared": len(rows), "differ": differs}))
    return 1 if differs else 0


if __name__ == "__main__":
    raise SystemExit(main())
