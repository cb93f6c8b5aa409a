"""Every number the estimate gives over the accuracy matrix and the published comparison, to the byte: the
proof that a change to the estimator's evaluation (not to its model) loses nothing.

``--old REF`` measures the code of an older commit instead (``git archive``, imported ahead of this tree),
for the file it was compared with: ``estimate_identity_before.json`` is e03f9b1, before issue #17's changes.

For each setup of ``tests/support/matrix.py`` (110) and each published measurement's setup
(``benchmarks/published.py``), in both modes (CUDA and simulation), fast and with the allocator replayed:
the three levels, every component at the peak and every phase's peak with its breakdown. The result file
holds one SHA-256 over all of them and the numbers themselves; compare the digest before and after.

Run: .venv/bin/python benchmarks/estimate_identity.py [--out NAME]   (about a minute on two cores)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from common import record  # noqa: E402

from tests.support import matrix  # noqa: E402
from vramlab.core.estimate import estimate  # noqa: E402
from vramlab.core.result import MemoryResult  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402


def numbers(r: MemoryResult) -> dict:
    return {
        "peak_allocated": r.peak_allocated_bytes, "peak_reserved": r.peak_reserved_bytes,
        "device_used": r.device_used_bytes, "peak_phase": r.peak_phase,
        "components": {k.value: v for k, v in sorted(r.components.items(), key=lambda kv: kv[0].value)},
        "phases": {p.key: [p.bytes, {k.value: v for k, v in sorted(p.components.items(), key=lambda kv: kv[0].value)}]
                   for p in r.phases},
    }


def cases() -> list[tuple[str, object, TrainingSetup]]:
    import published

    out = [(label, spec, setup) for spec, setup, label in matrix.setups()]
    for mid, m in sorted(published.MAP.items()):
        if m.excluded:
            continue
        out.append((f"published-{mid}", published.spec_of(m.model), TrainingSetup(**m.setup)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="estimate_identity", help="result file name under benchmarks/results/")
    ap.add_argument("--old", metavar="REF", help="measure this commit's estimator instead of this tree's")
    args = ap.parse_args()
    if args.old:
        return _run_old(args.old, args.out)
    rows = {}
    for label, spec, setup in cases():
        row = {}
        for mode, match in (("cuda", False), ("simulation", True)):
            for replay in (False, True):
                if replay and match:
                    continue
                r = estimate(spec, setup, match_simulation=match, allocator=replay, calibration=None)
                row[f"{mode}{'+replay' if replay else ''}"] = numbers(r)
        rows[label] = row
    text = json.dumps(rows, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    # kept small: the three levels per setup and mode, and a digest of everything else (components, phases)
    brief = {label: {mode: [n["peak_allocated"], n["peak_reserved"], n["device_used"],
                            hashlib.sha256(json.dumps(n, sort_keys=True).encode()).hexdigest()[:16]]
                     for mode, n in row.items()} for label, row in rows.items()}
    print(record(args.out, {"setups": len(rows), "sha256": digest,
                            "columns": ["peak_allocated", "peak_reserved", "device_used", "sha256 of all numbers"],
                            "estimates": brief}))
    print(digest)
    return 0


def _run_old(ref: str, out: str) -> int:
    """This script in a child process with ``ref``'s core/ and resources/ first on the import path."""
    import subprocess

    from common import old_tree

    with old_tree(ref, prefix="vramlab-identity-") as path:
        code = (f"import sys; sys.path.insert(0, {str(path)!r}); sys.argv = ['x', '--out', {out!r}];"
                f"sys.path.insert(0, {str(Path(__file__).parent)!r}); import estimate_identity as m;"
                "import vramlab.core.estimate as e; assert 'vramlab-identity-' in e.__file__, e.__file__;"
                "raise SystemExit(m.main())")
        return subprocess.run([sys.executable, "-c", code], check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
