"""The "Latest figures" table of benchmarks/README.md, made from the recorded results in benchmarks/results/.

Each row is one result file: the date it was recorded and its headline figures, read from the file. The table
sits between the two ``<!-- latest figures -->`` markers; ``tests/test_benchmarks_readme.py`` fails when it is
not what this script makes from the files (after a benchmark is re-run, run this with ``--write``).

Run: .venv/bin/python benchmarks/summary.py [--write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
BEGIN, END = "<!-- latest figures: benchmarks/summary.py --write -->", "<!-- end of latest figures -->"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _ms(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f} ms"


def estimate_speed(d: dict) -> str:
    new = d["new"]
    cases = list(new["per_estimate"])
    warm = " / ".join(f"{new['per_estimate'][k]['warm_ms']:.2f}" for k in cases)
    return (f"{' / '.join(cases)}: warm estimate {warm} ms of CPU; 10,000 setups "
            f"{new['sweep_10k']['arrays_s']:.2f} s as arrays, {new['sweep_10k']['one_by_one_s']:.1f} s one by one")


def replay_speed(d: dict) -> str:
    new = d["new"]
    cases = [k for k in new if "/" in k]

    def col(part: dict, key: str) -> str:
        return " / ".join(f"{part[k][key]:.1f}" for k in cases)
    return (f"{' / '.join(cases)}: allocator replay warm {col(new, 'warm_ms')} ms "
            f"({'compiled' if new['compiled'] else 'interpreted'}; "
            f"interpreted {col(d['new_interpreted'], 'warm_ms')} ms), "
            f"new structure {col(new, 'new_structure_ms')} ms; same reserved level compiled and interpreted: "
            f"{'yes' if d['compiled_same_reserved'] else 'NO'}")


def simulate_speed(d: dict) -> str:
    def s(col: str) -> str:
        return " / ".join(f"{d[col][m]['seconds']:.1f}" for m in ("llama-3.2-1b", "llama-2-7b", "llama-2-70b"))
    return (f"Llama-3.2-1B / 2-7B / 2-70B, two steps, fresh process: {s('simulate')} s (a setup simulated before), "
            f"{s('simulate_first_run')} s (first run), reference fake tensors {s('simulate_old')} s; "
            "results identical: "
            f"{'yes' if all(d['identical'].values()) else 'NO'}")


def published(d: dict) -> str:
    t = d["summary"]["ours_by_trust"]
    rule = d["summary"]["rules_by_trust"]["18B_per_param_plus_activations"]["high"]
    return (f"{d['summary']['compared']} published measurements: median error {_pct(t['high']['median_abs'])} on "
            f"{t['high']['n']} high-trust rows, {_pct(t['medium']['median_abs'])} on {t['medium']['n']} medium-trust; "
            f"the 18-bytes-per-parameter rule {_pct(rule['median_abs'])}")


def accuracy_matrix(d: dict) -> str:
    sim, cuda = d["modes"]["simulation mode"]["tensor_peak"], d["modes"]["CUDA mode"]["tensor_peak"]
    beyond = d.get("beyond_test_tolerance")  # recorded since the benchmark holds each setup to the test's reference
    return (f"{d['setups']} setups: estimate vs simulation, tensor peak worst {sim['worst_pct']:.1f} % "
            f"(simulation mode), {cuda['worst_pct']:.1f} % in CUDA mode (median {cuda['median_pct']:.1f} %)"
            + (f"; beyond the test's tolerance: {len(beyond)}" if beyond is not None else ""))


def startup(d: dict) -> str:
    return f"first paint of the window {d['median_s']:.2f} s (median, goal {d['goal_s']} s), torch not imported: " \
           f"{'yes' if not d['torch_imported_before_window'] else 'NO'}"


def sampling(d: dict) -> str:
    return (f"live profile at 20 Hz: {_pct(d['new']['cpu_fraction_above_idle'])} of a core above idle "
            f"(goal {_pct(d['goal_cpu_fraction_above_idle'])}), readings lost: {len(d['readings_lost'])}")


def soak(d: dict) -> str:
    return (f"{d['minutes']:.0f} min: {_pct(d['cpu_fraction_above_idle'])} of a core above idle, memory growth "
            f"{d['rss_growth_after_first_run_mib']} MiB, {d['readings_drawn']:,} of {d['readings_produced']:,} "
            "readings drawn")


def build(d: dict) -> str:
    v = d["variants"]
    return "; ".join(f"{k}: folder {x['folder_mib']:.0f} MiB, .deb {x['packages']['deb']['mib']:.0f} MiB, "
                     f"window {x['start']['first_paint_s']['median']:.2f} s" for k, x in v.items())


def fuzz(d: dict) -> str:
    return f"{d['total_tried']:,} hostile inputs, contract broken: {d['contract_broken']}"


def vlm(d: dict) -> str:
    s = d["summary"]
    return f"{s['cases']} cases: {s['exact']} to the byte, worst {s['worst_pct']:g} %"


def vlm_traced(d: dict) -> str:
    return f"{d['cells']} cells: {d['byte_equal']} to the byte, worst {d['worst_error']:g}"


def objectives(d: dict) -> str:
    return (f"worst difference {d['worst_relative_difference']:g}, every phase equal: "
            f"{'yes' if d['all_phases_equal'] else 'NO'}")


def architectures(d: dict) -> str:
    s = d["summary"]
    traced = f", traced {s['traced']} ({s['traced_exact']} to the byte)" if "traced" in s else ""
    return f"{s['types']} model types, {s['run']} of {s['cases']} cases run, {s['estimated']} estimated{traced}"


def trace_speed(d: dict) -> str:
    rows = [r for r in d["rows"] if "first_read_and_estimate_s" in r]
    first = [r["first_read_and_estimate_s"] for r in rows]
    after = [r["after_restart_first_estimate_cpu_s"]["median"] * 1000 for r in rows]
    return (f"a traced 7B, config read and first estimate {min(first):.1f}-{max(first):.1f} s (goal "
            f"{d['goal_first_s']:g} s); first estimate after a restart {_ms(after)} of CPU (medians)")


def trace_head(d: dict) -> str:
    cases = d["cases"]
    cpu = ", ".join(f"{n} {c['old']['first_estimate_cpu_s']:.1f} -> {c['new']['first_estimate_cpu_s']:.1f} s"
                    for n, c in cases.items() if "old" in c)
    same = all(c.get("same_peak", True) for c in cases.values())
    return f"traced head past a fit (TRL's 4,096-row tile, a fused loss), first estimate's CPU (old -> new): " \
           f"{cpu}; same bytes: {'yes' if same else 'NO'}"


def trace_align(d: dict) -> str:
    both = [(n, c) for n, c in d["cases"].items() if "difflib_cpu_s" in c]
    old = ", ".join(f"{c['events'][1]:,} events {c['difflib_cpu_s']:.1f} -> {c['new_cpu_s']:.2f} s" for _, c in both)
    big = max(d["cases"].values(), key=lambda c: c["events"][1])
    return (f"layer alignment's CPU, difflib -> new: {old}; {big['events'][1]:,} events {big['new_cpu_s']:.1f} s "
            f"(difflib not run); same chunks: {'yes' if d['same_chunks'] else 'NO'}")


def simulate_identity(d: dict) -> str:
    return f"{d['compared']}: " + ", ".join(f"{n} {k}" for k, n in d["counts"].items())


def simulate_stored(d: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in d["counts"].items()) + \
        f"; answers from disk {d['later']['answers_from_disk']:,}"


def identity(d: dict) -> str:
    key = "sha256" if "sha256" in d else "digest"
    return f"digest {str(d[key])[:12]}" + (f" over {d['setups']} setups" if "setups" in d else "")


def conformance(d: dict) -> str:
    rows = [r for r in d.get("rows", []) if "unexplained_bytes" in r]
    trl = [r for r in rows if "measured_on_cuda_path_bytes" in r]
    if trl:  # conformance.json: TRL's own trainers, each also run on its CUDA path
        gaps = [r["estimated_peak_bytes"] - r["measured_on_cuda_path_bytes"] for r in trl]
        trainers = ", ".join(dict.fromkeys(r["case"].split()[1].upper() for r in trl))
        return (f"{len(trl)} runs of TRL's own trainers ({trainers}; full and LoRA): estimate {min(gaps):+,} to "
                f"{max(gaps):+,} B against the run on its CUDA path; unexplained "
                f"{max(abs(r['unexplained_bytes']) for r in trl):,} B at worst")
    # conformance_frameworks.json: each framework's own run on CPU
    return "; ".join(f"{r['case']}: estimate {r['difference_bytes']:+,} B against its own run, "
                     f"{r['unexplained_bytes']:+,} B unexplained" for r in rows) or "see the file"


def recipes(d: dict) -> str:
    return f"{len(d.get('recipes', []))} recipes at full size"


def composition(d: dict) -> str:
    s, fams = d["summary"], d["axes"]["family"]
    worst = "" if s["worst_error"] is None else f" (worst {100 * s['worst_error']:.4f} %)"
    return (f"{len(fams)} families, {s['cells']} cells: {s['answered']} answered, {s['within_0.5%']} within 0.5 %"
            f"{worst}; {s['refused']} refused, {s['no_reference']} without a reference")


HEADLINES: dict[str, Callable[[dict], str]] = {
    "estimate_speed": estimate_speed, "replay_speed": replay_speed, "simulate_speed": simulate_speed,
    "published": published, "accuracy_matrix": accuracy_matrix, "startup": startup, "sampling": sampling,
    "soak": soak, "build": build, "fuzz": fuzz, "vlm": vlm, "vlm_traced": vlm_traced, "objectives": objectives,
    "architectures": architectures, "trace_speed": trace_speed, "trace_head": trace_head,
    "trace_align": trace_align,
    "simulate_identity": simulate_identity,
    "simulate_stored": simulate_stored, "estimate_identity": identity, "trace_identity": identity,
    "recipes": recipes, "conformance": conformance, "composition": composition,
}


def headline(name: str, data: dict[str, Any]) -> str:
    for prefix in sorted(HEADLINES, key=len, reverse=True):  # replay_speed-packed_keys -> replay_speed
        if name == prefix or name.startswith(prefix + "-") or name.startswith(prefix + "_"):
            try:
                return HEADLINES[prefix](data)
            except (KeyError, TypeError, ValueError, statistics.StatisticsError):
                return "see the file"
    return "see the file"


def table() -> str:
    rows = ["| result | recorded | headline |", "|---|---|---|"]
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        rows.append(f"| `{path.name}` | {str(data.get('date', ''))[:10]} | {headline(path.stem, data)} |")
    return "\n".join(rows)


def rewrite(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the table in benchmarks/README.md")
    args = p.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    if args.write:
        README.write_text(rewrite(text), encoding="utf-8")
        return 0
    if rewrite(text) != text:
        print("benchmarks/README.md: the latest figures are not those of benchmarks/results/ (--write)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
