"""Vision-language models: the estimate against transformers' own VLM class simulated under fake tensors, over
a matrix of vision tunings x image sizes x batch x attention x checkpointing (tiny widths) and at full size
(Qwen2.5-VL-3B and -7B), with the processor's token counts recorded beside each case.

Run: .venv/bin/python benchmarks/vlm.py [--no-full]   (about 20 minutes on two loaded cores; --no-full: 15)
Writes benchmarks/results/vlm.json. Timings are of a loaded, shared machine.
``--family llava``: LLaVA-1.5 (a tiny CLIP tower, and llava-1.5-7b at full size; about 2 minutes), written to
benchmarks/results/vlm_llava.json.
``--family mllama``: Llama 3.2 Vision (a tiny tiled tower with cross-attention layers over tunings x 1 and 4
tiles, and llama-3.2-11b-vision at full size; about 12 minutes), written to benchmarks/results/vlm_mllama.json.
``--family gemma3``: Gemma 3 (a tiny SigLIP tower with a 7-layer decoder that has a global layer, and
gemma-3-4b-it, -12b-it and -27b-it at full size; about 25 minutes), written to
benchmarks/results/vlm_gemma3.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from common import record  # noqa: E402

from vramlab.core.catalog import find_model  # noqa: E402
from vramlab.core.estimate import estimate  # noqa: E402
from vramlab.core.simulation.simulate import simulate  # noqa: E402
from vramlab.core.spec.model import ModelSpec  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402
from vramlab.core.vision import ProcessorSpec, VisionSpec, token_counts  # noqa: E402

PROC = ProcessorSpec("qwen_vl", patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136,
                     max_pixels=12845056)
TINY = ModelSpec(id="qwen2.5-vl-tiny", name="Qwen2.5-VL (tiny)", num_layers=2, hidden_size=256, num_heads=4,
                 num_kv_heads=2, intermediate_size=512, vocab_size=1000, qkv_bias=True,
                 vision=VisionSpec("qwen2_5_vl", depth=4, hidden_size=128, num_heads=2, intermediate_size=256,
                                   out_hidden_size=256, window_size=112, fullatt_block_indexes=(1, 3),
                                   mrope_section=(8, 12, 12), processor=PROC))


CLIP_PROC = ProcessorSpec("siglip_fixed", patch_size=14, tile_size=84, tokens_per_tile=36, cls_token=True)
LLAVA_TINY = ModelSpec(id="llava-tiny", name="LLaVA (tiny)", num_layers=2, hidden_size=256, num_heads=4,
                       num_kv_heads=4, intermediate_size=512, vocab_size=1000,
                       vision=VisionSpec("llava", depth=3, hidden_size=128, num_heads=2, intermediate_size=256,
                                         out_hidden_size=256, hidden_act="quick_gelu", image_size=84,
                                         image_token_id=999, processor=CLIP_PROC))


def llava_tiny_cases() -> list[tuple[str, TrainingSetup]]:
    out = []
    for tune, method in (("frozen", "lora"), ("projector", "lora"), ("lora", "lora"), ("full", "full")):
        for images, batch, attention, ckpt in ((1, 1, "sdpa", False), (2, 2, "sdpa", False), (1, 2, "eager", False),
                                               (2, 1, "sdpa", True)):
            s = TrainingSetup(method=method, vision_tuning=tune, images=images, micro_batch=batch, seq_len=64,
                              attention=attention, grad_ckpt=ckpt)
            out.append((f"{tune}/{method} {images} image(s) b{batch} {attention}{' ckpt' if ckpt else ''}", s))
    return out


def llava_full_cases() -> list[tuple[str, str, TrainingSetup]]:
    lora = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return [
        ("llava-1.5-7b", "LoRA r8 q/v, tower LoRA, 1 image, seq 512",
         TrainingSetup(method="lora", vision_tuning="lora", images=1, seq_len=512)),
        ("llava-1.5-7b", "LoRA all-linear, frozen tower, 2 images, seq 1024",
         TrainingSetup(method="lora", lora_targets=lora, images=2, seq_len=1024)),
    ]


MLLAMA_PROC = ProcessorSpec("mllama", patch_size=14, tile_size=56, max_tiles=4, cls_token=True)
MLLAMA_TINY = ModelSpec(id="mllama-tiny", name="Llama 3.2 Vision (tiny)", num_layers=5, hidden_size=256, num_heads=4,
                        num_kv_heads=2, intermediate_size=512, vocab_size=1000,
                        vision=VisionSpec("mllama", depth=4, global_depth=2, hidden_size=128, num_heads=2,
                                          intermediate_size=256, out_hidden_size=256, hidden_act="gelu",
                                          image_size=56, intermediate_layers=(1, 3), aspect_ratios=8,
                                          cross_attention_layers=(1, 3), image_token_id=999, processor=MLLAMA_PROC))


def mllama_tiny_cases() -> list[tuple[str, TrainingSetup]]:
    """Tunings x one tile (56x56) and four tiles (112x112, a 2x2 canvas) x batch, images and attention."""
    out = []
    for tune, method in (("frozen", "lora"), ("projector", "lora"), ("lora", "lora"), ("full", "lora"),
                         ("frozen", "full"), ("full", "full")):
        for side, images, batch, attention in ((56, 1, 1, "sdpa"), (112, 1, 2, "sdpa"), (112, 2, 1, "sdpa"),
                                               (56, 1, 2, "eager")):
            s = TrainingSetup(method=method, vision_tuning=tune, images=images, image_width=side, image_height=side,
                              micro_batch=batch, seq_len=64, attention=attention)
            out.append((f"{tune}/{method} {side}x{side} {images} image(s) b{batch} {attention}", s))
    return out


def mllama_full_cases() -> list[tuple[str, str, TrainingSetup]]:
    lora = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return [
        ("llama-3.2-11b-vision", "LoRA r8 q/v, frozen tower, 1 image 560x560 (1 tile), seq 512",
         TrainingSetup(method="lora", images=1, image_width=560, image_height=560, seq_len=512)),
        ("llama-3.2-11b-vision", "LoRA r8 q/v, tower LoRA, 1 image 1120x1120 (4 tiles), seq 512",
         TrainingSetup(method="lora", vision_tuning="lora", images=1, image_width=1120, image_height=1120,
                       seq_len=512)),
        ("llama-3.2-11b-vision", "LoRA all-linear r16, projector trained, 1 image 1120x560 (2 tiles), seq 1024",
         TrainingSetup(method="lora", lora_targets=lora, lora_rank=16, vision_tuning="projector", images=1,
                       image_width=1120, image_height=560, seq_len=1024)),
        ("llama-3.2-11b-vision", "LoRA r8 q/v, frozen tower, 2 images 800x600 a sample, batch 2, seq 512",
         TrainingSetup(method="lora", images=2, image_width=800, image_height=600, micro_batch=2, seq_len=512)),
        ("llama-3.2-11b-vision", "full, tower trained, 1 image 560x560, seq 256",
         TrainingSetup(method="full", vision_tuning="full", images=1, image_width=560, image_height=560,
                       seq_len=256)),
    ]


GEMMA3_PROC = ProcessorSpec("siglip_fixed", patch_size=14, tile_size=112, tokens_per_tile=16, pan_and_scan_max_crops=4,
                            pan_and_scan_min_crop=56)
GEMMA3_TINY = ModelSpec(id="gemma3-tiny", name="Gemma 3 (tiny)", num_layers=7, hidden_size=256, num_heads=4,
                        num_kv_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000, activation="gelu_tanh",
                        norms_per_layer=4, qk_norm=True, scale_embeddings=True, tie_embeddings=True,
                        vision=VisionSpec("gemma3", depth=2, hidden_size=128, num_heads=2, intermediate_size=256,
                                          out_hidden_size=256, hidden_act="gelu_pytorch_tanh", image_size=112,
                                          image_token_id=999, processor=GEMMA3_PROC))


def gemma3_tiny_cases() -> list[tuple[str, TrainingSetup]]:
    """(frozen, projector, LoRA, trained tower) x (one image; two images; a 300x100 image with its pan-and-scan
    crops, batch 2; eager; checkpointing, one and two images)."""
    out = []
    for tune, method in (("frozen", "lora"), ("projector", "lora"), ("lora", "lora"), ("full", "full")):
        for images, batch, attention, ckpt, pas in ((1, 1, "sdpa", False, False), (2, 2, "sdpa", False, False),
                                                    (1, 2, "sdpa", False, True), (1, 2, "eager", False, False),
                                                    (1, 1, "sdpa", True, False), (2, 2, "sdpa", True, True)):
            s = TrainingSetup(method=method, vision_tuning=tune, images=images, image_width=300, image_height=100,
                              pan_and_scan=pas, micro_batch=batch, seq_len=64, attention=attention, grad_ckpt=ckpt)
            out.append((f"{tune}/{method} {images} image(s){' pan-and-scan' if pas else ''} b{batch} {attention}"
                        f"{' ckpt' if ckpt else ''}", s))
    return out


def gemma3_full_cases() -> list[tuple[str, str, TrainingSetup]]:
    lora = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return [
        ("gemma-3-4b-it", "LoRA r8 q/v, tower LoRA, 1 image, seq 512",
         TrainingSetup(method="lora", vision_tuning="lora", images=1, seq_len=512)),
        ("gemma-3-4b-it", "LoRA all-linear, frozen tower, 2 images, seq 1024",
         TrainingSetup(method="lora", lora_targets=lora, images=2, seq_len=1024)),
        ("gemma-3-4b-it", "LoRA all-linear, frozen tower, checkpointing, 1 image 1280x720 pan-and-scan, seq 512",
         TrainingSetup(method="lora", lora_targets=lora, images=1, image_width=1280, image_height=720,
                       pan_and_scan=True, seq_len=512, grad_ckpt=True)),
        ("gemma-3-4b-it", "LoRA all-linear + tower LoRA, checkpointing, 2 images, seq 512",
         TrainingSetup(method="lora", lora_targets=lora, vision_tuning="lora", images=2, seq_len=512,
                       grad_ckpt=True)),
        ("gemma-3-12b-it", "LoRA r8 q/v, frozen tower, checkpointing, 1 image, seq 512",
         TrainingSetup(method="lora", images=1, seq_len=512, grad_ckpt=True)),
        ("gemma-3-27b-it", "LoRA r8 q/v, frozen tower, checkpointing, 1 image, seq 512",
         TrainingSetup(method="lora", images=1, seq_len=512, grad_ckpt=True)),
    ]


def tiny_cases() -> list[tuple[str, TrainingSetup]]:
    out = []
    for tune, method in (("frozen", "lora"), ("projector", "lora"), ("lora", "lora"), ("frozen", "full"),
                         ("full", "lora"), ("full", "full")):
        for (w, h), batch, attention, ckpt in (((224, 168), 1, "sdpa", False), ((640, 480), 2, "sdpa", False),
                                               ((333, 1000), 1, "eager", False), ((640, 480), 1, "sdpa", True)):
            s = TrainingSetup(method=method, vision_tuning=tune, images=1, image_width=w, image_height=h,
                              micro_batch=batch, seq_len=64, attention=attention, grad_ckpt=ckpt)
            out.append((f"{tune}/{method} {w}x{h} b{batch} {attention}{' ckpt' if ckpt else ''}", s))
    out.append(("full/full 320x240 b2 + 5-frame video",
                TrainingSetup(method="full", vision_tuning="full", images=1, image_width=320, image_height=240,
                              frames=5, micro_batch=2, seq_len=64)))
    return out


def full_cases() -> list[tuple[str, str, TrainingSetup]]:
    lora = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return [
        ("qwen2.5-vl-7b", "LoRA all-linear, frozen tower, 1 image 1280x720, seq 512",
         TrainingSetup(method="lora", lora_targets=lora, images=1, image_width=1280, image_height=720, seq_len=512)),
        ("qwen2.5-vl-7b", "LoRA all-linear + tower LoRA, 1 image 1280x720, seq 512",
         TrainingSetup(method="lora", lora_targets=lora, vision_tuning="lora", images=1, image_width=1280,
                       image_height=720, seq_len=512)),
        ("qwen2.5-vl-3b", "full, tower trained, 2 images 640x480, seq 256",
         TrainingSetup(method="full", vision_tuning="full", images=2, image_width=640, image_height=480,
                       seq_len=256)),
        ("qwen2.5-vl-3b", "LoRA, frozen tower, checkpointing, 4 images 1024x768, seq 512",
         TrainingSetup(method="lora", images=4, image_width=1024, image_height=768, seq_len=512, grad_ckpt=True)),
    ]


def compare(spec: ModelSpec, setup: TrainingSetup) -> dict:
    t0 = time.perf_counter()
    est = estimate(spec, setup, match_simulation=True)
    t1 = time.perf_counter()
    sim = simulate(spec, setup)
    t2 = time.perf_counter()
    diff = est.peak_allocated_bytes - sim.peak_allocated_bytes
    phases = {p.key: p.bytes - q.bytes for p, q in zip(est.phases, sim.phases)}
    return {"estimate_bytes": est.peak_allocated_bytes, "simulation_bytes": sim.peak_allocated_bytes,
            "diff_bytes": diff, "error_pct": round(100 * diff / sim.peak_allocated_bytes, 4),
            "peak_phase": [est.peak_phase, sim.peak_phase], "worst_phase_diff_bytes": max(map(abs, phases.values())),
            "tokens": token_counts(spec, setup), "estimate_s": round(t1 - t0, 3), "simulate_s": round(t2 - t1, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-full", action="store_true", help="skip the full-size simulations")
    ap.add_argument("--family", choices=("qwen", "llava", "mllama", "gemma3"), default="qwen")
    args = ap.parse_args()
    tiny, tiny_spec = {"llava": (llava_tiny_cases(), LLAVA_TINY), "mllama": (mllama_tiny_cases(), MLLAMA_TINY),
                       "gemma3": (gemma3_tiny_cases(), GEMMA3_TINY)}.get(args.family, (tiny_cases(), TINY))
    rows = []
    for label, setup in tiny:
        r = compare(tiny_spec, setup)
        rows.append({"model": tiny_spec.id, "case": label, **r})
        print(f"{label:48s} {r['error_pct']:+8.4f} %  ({r['diff_bytes']:+,} B)", flush=True)
    full = []
    if not args.no_full:
        fulls = {"llava": llava_full_cases, "mllama": mllama_full_cases,
                 "gemma3": gemma3_full_cases}.get(args.family, full_cases)()
        for model_id, label, setup in fulls:
            r = compare(find_model(model_id), setup)
            full.append({"model": model_id, "case": label, **r})
            print(f"{model_id} {label:60s} {r['error_pct']:+8.4f} %  ({r['diff_bytes']:+,} B, "
                  f"{r['simulation_bytes'] / 2**30:.2f} GiB, sim {r['simulate_s']} s)", flush=True)
    errs = [abs(r["error_pct"]) for r in rows + full]
    summary = {"cases": len(errs), "exact": sum(1 for r in rows + full if r["diff_bytes"] == 0),
               "worst_pct": max(errs), "within_1_pct": sum(1 for e in errs if e <= 1.0)}
    print(summary)
    cls = {"llava": "LlavaForConditionalGeneration", "mllama": "MllamaForConditionalGeneration",
           "gemma3": "Gemma3ForConditionalGeneration"}.get(args.family, "Qwen2_5_VLForConditionalGeneration")
    record({"llava": "vlm_llava", "mllama": "vlm_mllama", "gemma3": "vlm_gemma3"}.get(args.family, "vlm"),
           {"note": f"estimate(match_simulation=True) against simulate() of transformers' {cls} under fake "
                    "tensors; loaded 2-core machine",
                   "summary": summary, "tiny": rows, "full_size": full})
    return 0


if __name__ == "__main__":
    sys.exit(main())
