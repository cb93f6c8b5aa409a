"""A traced architecture's DPO / KTO / GRPO step past the 4,096 rows of TRL's fused LM head tile: the first
estimate's time (the trace), this tree beside an older one.

Where one call of TRL's fused LM head scores more than 4,096 tokens (DPO's chosen and rejected rows of a batch of 2 at
4,096 tokens: 8,192), its tile stops growing, which has no polynomial form in batch or length, so the step cannot be
fitted in those sizes. Before, the step was then simulated at full depth at the sizes asked; now it is traced at
those sizes at reduced depth with the layers fitted (the tile is per call of the head, after the layers), which gives
the same bytes (``tests/test_traced_head_depth.py``).

Each case runs in a fresh process with an empty trace cache: Llama-2-7B's config (Llama-2-70B's for ``*-70b``) at
full width and depth (32 and 80 layers) read as a traced architecture (``tape="traced"``), LoRA on q / v, then the
first ``estimate`` (the trace), timed wall and CPU (the machine is shared: the CPU time is the steadier figure).
With ``--old REF`` the same case runs in that commit's code too (same machine, same run), and the peaks are
compared.

Run: .venv/bin/python benchmarks/trace_head.py [--old REF] [--only dpo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, old_tree, record  # noqa: E402

LORA = {"method": "lora", "lora_targets": ["q_proj", "v_proj"]}
CASES = {  # (model, recipe)
    "dpo": ("llama-2-7b", {"objective": "dpo", "micro_batch": 2, "seq_len": 4096, **LORA}),  # 2 x 2 x 2,048 rows
    "kto": ("llama-2-7b", {"objective": "kto", "micro_batch": 4, "seq_len": 4096, **LORA}),  # KTO halves the batch
    "grpo": ("llama-2-7b", {"objective": "grpo", "micro_batch": 4, "seq_len": 2560, "completion_len": 2048,
                            "num_generations": 4, "generation_backend": "vllm-server", **LORA}),  # the step alone
    "dpo-70b": ("llama-2-70b", {"objective": "dpo", "micro_batch": 2, "seq_len": 4096, **LORA}),  # 80 layers
    # a fused loss kernel (no polynomial form in batch or length) takes the same route, whatever the objective
    "sft-cce-70b": ("llama-2-70b", {"objective": "sft", "micro_batch": 2, "seq_len": 4096, "loss_kernel": "cce",
                                    **LORA}),
}


def measure(model: str, recipe: dict) -> dict:
    """One case in this process (a fresh one): the first estimate of the traced step, timed."""
    import dataclasses
    import time

    from vramlab.core.catalog import find_model
    from vramlab.core.estimate import estimate
    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.traced import cached_tape, head_tokens

    spec = dataclasses.replace(find_model(model), id=f"{model}-traced", tape="traced")
    setup = TrainingSetup(**{k: tuple(v) if isinstance(v, list) else v for k, v in recipe.items()})
    t, c = time.perf_counter(), time.process_time()
    result = estimate(spec, setup, match_simulation=True)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    tape = cached_tape(spec, setup, cuda=False)
    return {"head_tokens": head_tokens(setup), "first_estimate_s": round(wall, 2),
            "first_estimate_cpu_s": round(cpu, 2), "peak_allocated_bytes": result.peak_allocated_bytes,
            "tape": tape.mode if tape else None, "note": tape.note if tape else None}


def _child(case: tuple[str, dict], path: Path | None) -> dict:
    here = Path(__file__).resolve().parent
    first = f"sys.path.insert(0, {str(path)!r}); " if path is not None else ""
    code = (f"import sys, json; {first}sys.path.insert(0, {str(here)!r}); import trace_head; "
            f"print(json.dumps(trace_head.measure(*json.loads({json.dumps(json.dumps(case))}))))")
    with tempfile.TemporaryDirectory(prefix="vramlab-trace-head-") as cache:
        env = {**os.environ, "VRAMLAB_CACHE_DIR": cache}
        done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="a commit to run beside this tree (its code simulates these steps at full depth)")
    ap.add_argument("--only", help="comma-separated case names")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CASES)
    rows = {}
    for name in names:
        row = {"model": CASES[name][0], "recipe": CASES[name][1], "new": _child(CASES[name], None)}
        if args.old:
            with old_tree(args.old, prefix="vramlab-trace-head-old-") as path:
                row["old"] = _child(CASES[name], path)
            row["same_peak"] = row["old"]["peak_allocated_bytes"] == row["new"]["peak_allocated_bytes"]
            row["speedup_cpu"] = round(row["old"]["first_estimate_cpu_s"] / row["new"]["first_estimate_cpu_s"], 2)
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    kept = RESULTS / "trace_head.json"
    if args.only and kept.is_file():  # the cases not run again keep their recorded rows
        rows = {**json.loads(kept.read_text(encoding="utf-8")).get("cases", {}), **rows}
    record("trace_head", {"models": "Llama-2-7B (32 layers) and Llama-2-70B (80 layers) read as traced architectures",
                          "old": args.old, "cases": rows})


if __name__ == "__main__":
    main()
