"""Time per estimate (structure cached and not) and for a 10,000-setup sweep. Goal: well under 1 ms.

Also the allocator replay (``estimate(..., allocator=True)``: what ``vramlab estimate`` prints and what the
window shows a moment after the fast estimate), which records the step at full depth and replays every
allocation through the caching-allocator model.

Run: .venv/bin/python benchmarks/estimate_speed.py
"""

from __future__ import annotations

import itertools
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, summary  # noqa: E402

from vramlab.core import estimate as est_mod  # noqa: E402
from vramlab.core.catalog import find_model  # noqa: E402
from vramlab.core.estimate import estimate  # noqa: E402
from vramlab.core.spec import TrainingSetup  # noqa: E402

CASES = [("llama-2-7b", TrainingSetup(method="lora")),
         ("llama-3.1-8b", TrainingSetup(method="qlora", lora_targets="all-linear", grad_ckpt=True)),
         ("llama-3.1-70b", TrainingSetup(sharding="fsdp", gpus=8, weights="fp32", compute="bf16")),
         ("mixtral-8x7b", TrainingSetup(method="qlora"))]


def per_replay(runs: int = 20) -> dict:
    out = {}
    for mid, setup in CASES:
        spec = find_model(mid)
        est_mod._FULL_CACHE._d.clear()
        t = time.perf_counter()
        estimate(spec, setup, allocator=True)
        cold = time.perf_counter() - t
        warm = []
        for b in range(1, runs + 1):
            t = time.perf_counter()
            estimate(spec, setup.replace(micro_batch=1 + b % 4, seq_len=256 * (1 + b % 8)), allocator=True)
            warm.append(time.perf_counter() - t)
        out[f"{mid}/{setup.method.value}"] = {"first_ms": cold * 1e3, "warm_ms": summary([w * 1e3 for w in warm])}
    return out


def per_estimate() -> dict:
    out = {}
    for mid, setup in CASES:
        spec = find_model(mid)
        est_mod._CACHE._d.clear()
        t = time.perf_counter()
        estimate(spec, setup)
        cold = time.perf_counter() - t
        warm = []
        for b in range(1, 201):
            t = time.perf_counter()
            estimate(spec, setup.replace(micro_batch=1 + b % 8, seq_len=256 * (1 + b % 16)))
            warm.append(time.perf_counter() - t)
        out[f"{mid}/{setup.method.value}"] = {"first_ms": cold * 1e3, "warm_ms": summary([w * 1e3 for w in warm])}
    return out


def sweep(n: int = 10_000) -> dict:
    rng = random.Random(0)
    models = [find_model(m) for m in ("llama-3.2-1b", "llama-2-7b", "mistral-7b-v0.1", "qwen2.5-7b", "llama-3.1-8b")]
    methods = [dict(method="full"), dict(method="lora"), dict(method="qlora", lora_targets="all-linear"),
               dict(method="lora", grad_ckpt=True)]
    combos = list(itertools.product(models, methods))
    est_mod._CACHE._d.clear()
    t = time.perf_counter()
    for _ in range(n):
        spec, m = rng.choice(combos)
        setup = TrainingSetup(**m, micro_batch=rng.choice([1, 2, 4, 8, 16]), seq_len=rng.choice([256, 512, 1024, 2048,
                              4096, 8192]), lora_rank=rng.choice([4, 8, 16, 32, 64]))
        estimate(spec, setup)
    total = time.perf_counter() - t
    return {"setups": n, "structures": len(combos) * 2, "total_s": total, "per_setup_ms": total / n * 1e3,
            "cache": {"hits": est_mod._CACHE.hits, "misses": est_mod._CACHE.misses}}


if __name__ == "__main__":
    data = {"per_estimate": per_estimate(), "sweep_10k": sweep(), "per_replay": per_replay()}
    print(record("estimate_speed", data))
    import json

    print(json.dumps(data, indent=2))
