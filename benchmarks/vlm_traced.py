"""Vision-language models traced whole (core/tracing/vlm_traced.py) against ``simulate --hf`` of the same
transformers class at full depth, at a point the trace did not fit, over SmolVLM, InternVL, Qwen2-VL and
Qwen3-VL (and Idefics3, LLaVA-NeXT with --all) x (frozen tower with LoRA, LoRA tower, full) x two image sizes,
at tiny widths (tests/support/traced_vlm.py); ``--real smolvlm``: SmolVLM-256M-Instruct's sizes;
``--qwen2-vl-7b``: Qwen2-VL-7B at ms-swift's recipe (benchmarks/published.py) at text 100, rank 16.
Each row records the token counts of core/vision.py beside the image processor's own.

Run: .venv/bin/python benchmarks/vlm_traced.py [--all] [--real smolvlm]   (tiny matrix: about 45 minutes on
two loaded cores; the trace of each cell dominates, and a cell whose tape is in the cache costs only its
simulation: trace_seconds is the tape's own). Writes benchmarks/results/vlm_traced.json after every cell.
Timings are of a loaded, shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from common import record  # noqa: E402

from tests.support.traced_vlm import processor_tokens, tiny_configs  # noqa: E402
from vramlab.core.estimate import estimate  # noqa: E402
from vramlab.core.simulation.simulate import simulate  # noqa: E402
from vramlab.core.sources.traced_vlm import traced_vlm_spec  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402
from vramlab.core.traced import cached_tape  # noqa: E402
from vramlab.core.vision import token_counts  # noqa: E402

FAMILIES = ("smolvlm", "internvl", "qwen2_vl", "qwen3_vl")
MORE = ("idefics3", "llava_next")
SIZES = ((100, 80), (300, 200))
TUNINGS = (("frozen", "lora"), ("lora", "lora"), ("full", "full"))
POINT = dict(micro_batch=3, seq_len=100, lora_rank=16)  # fitted at b 2, 3; s 41, 64, 89; r 4, 8

# SmolVLM-256M-Instruct (HuggingFaceTB): SmolLM2-135M-style Llama text model, SigLIP-B/16 at 512 px, pixel
# shuffle 4 (64 tokens per 512 px tile)
SMOLVLM_256M = dict(
    model_type="idefics3", image_token_id=49190, scale_factor=4, tie_word_embeddings=True,
    text_config=dict(model_type="llama", vocab_size=49280, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     tie_word_embeddings=True, max_position_embeddings=8192, rope_parameters={
                         "rope_type": "default", "rope_theta": 100000.0}, bos_token_id=None, eos_token_id=None,
                     pad_token_id=None),
    vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       patch_size=16, image_size=512))


def row(family: str, cfg: dict, tune: str, method: str, size: tuple[int, int], recipe: dict | None = None) -> dict:
    spec, _ = traced_vlm_spec(cfg, id=family, name=family, source="benchmark", dtype=None)
    setup = TrainingSetup(**recipe) if recipe else TrainingSetup(
        method=method, vision_tuning=tune, images=1, image_width=size[0], image_height=size[1], **POINT)
    counts = token_counts(spec, setup)
    proc = spec.vision.processor
    if setup.max_pixels:  # MAX_PIXELS as the processor's longest_edge
        proc = dataclasses.replace(proc, max_pixels=setup.max_pixels)
    own_tokens, own_tower = processor_tokens(proc, setup.image_width, setup.image_height)
    est = estimate(spec, setup, match_simulation=True)
    trace_s = cached_tape(spec, setup, cuda=False).seconds  # how long its trace took (also when read back)
    cuda = estimate(spec, setup)
    t0 = time.perf_counter()
    sim = simulate(spec, setup)
    sim_s = time.perf_counter() - t0
    err = (est.peak_allocated_bytes - sim.peak_allocated_bytes) / sim.peak_allocated_bytes
    kinds = ("vision_weights", "projector_weights", "vision_activations", "vision_training")
    return {
        "family": family, "vision_tuning": setup.vision_tuning, "method": setup.method.value,
        "image": f"{setup.image_width}x{setup.image_height}", "micro_batch": setup.micro_batch,
        "seq_len": setup.seq_len, "lora_rank": setup.lora_rank,
        "vision_tokens": counts["vision_tokens"], "processor_vision_tokens": own_tokens,
        "tokens_equal": counts["vision_tokens"] == own_tokens, "sequence": counts["sequence"],
        "traced_peak_bytes": est.peak_allocated_bytes, "simulate_hf_peak_bytes": sim.peak_allocated_bytes,
        "error": round(err, 6), "cuda_peak_bytes": cuda.peak_allocated_bytes, "peak_phase": est.peak_phase,
        "source": est.source, "how": est.notes[0],
        "params": est.total_params, "params_simulated": sim.total_params,
        "trainable": est.trainable_params, "trainable_simulated": sim.trainable_params,
        "vision_kinds_at_peak": {k.value: v for k, v in est.components.items() if k.value in kinds},
        "trace_seconds": round(trace_s, 1), "simulate_seconds": round(sim_s, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="also Idefics3 and LLaVA-NeXT")
    ap.add_argument("--real", nargs="*", default=[], help="families at real width (smolvlm)")
    ap.add_argument("--no-tiny", action="store_true")
    ap.add_argument("--families", nargs="*", default=None, help="tiny families to run (default: all four)")
    ap.add_argument("--append", action="store_true", help="keep the rows already in the results file")
    ap.add_argument("--qwen2-vl-7b", action="store_true",
                    help="Qwen2-VL-7B at ms-swift's recipe of benchmarks/published.py (text 100, rank 16)")
    args = ap.parse_args()
    rows = []
    if args.append:
        rows = json.loads((ROOT / "benchmarks" / "results" / "vlm_traced.json").read_text())["rows"]
    if args.qwen2_vl_7b:
        from published import SWIFT_QWEN2_VL_LORA, VLM_CONFIGS

        recipe = {**SWIFT_QWEN2_VL_LORA, "seq_len": 100, "lora_rank": 16}
        r = {"width": "real", **row("qwen2-vl-7b", VLM_CONFIGS["qwen2-vl-7b"], "", "", (0, 0), recipe)}
        print(r["family"], r["traced_peak_bytes"], r["simulate_hf_peak_bytes"], r["error"], r["how"], flush=True)
        rows.append(r)
        write(rows)
    configs = tiny_configs()
    families = () if args.no_tiny else tuple(args.families or FAMILIES + (MORE if args.all else ()))
    cells = [(f, configs[f], "tiny") for f in families]
    if "smolvlm" in args.real:
        cells.append(("smolvlm-256m", SMOLVLM_256M, "real"))
    for family, cfg, width in cells:
        for tune, method in TUNINGS:
            for size in SIZES:
                r = {"width": width, **row(family, cfg, tune, method, size)}
                print(f"{family:14} {width:5} {tune:7} {r['image']:8} tokens {r['vision_tokens']:5} "
                      f"(processor {r['processor_vision_tokens']:5}) traced {r['traced_peak_bytes']:>13,} "
                      f"simulate --hf {r['simulate_hf_peak_bytes']:>13,} {r['error']:+.4%} "
                      f"trace {r['trace_seconds']} s", flush=True)
                rows.append(r)
                write(rows)
    return 0


def write(rows: list[dict]) -> None:
    """The rows so far (written after each, so that a long run that is stopped keeps what it measured)."""
    worst = max(abs(r["error"]) for r in rows)
    record("vlm_traced", {
        "what": "the traced estimate of whole vision-language models (tower, projector, language model) against "
                "simulate --hf of the same transformers class at full depth, at batch 3, text 100, rank 16 "
                "(not a fitted point); tiny widths from tests/support/traced_vlm.py, real: SmolVLM-256M's sizes",
        "rows": rows, "cells": len(rows), "worst_error": worst,
        "byte_equal": sum(r["error"] == 0 for r in rows),
        "tokens_equal_to_processor": sum(r["tokens_equal"] for r in rows),
        "note": "timings of a loaded, shared 2-core machine",
    })


if __name__ == "__main__":
    raise SystemExit(main())
