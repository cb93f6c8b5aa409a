"""The recipes issue #12 found refused or parting from transformers' own classes, at full size.

Each recipe is estimated and simulated with transformers' own model class (and peft) under fake tensors
(``simulate --hf``, the reference); where the fix was a modelled mechanism, the estimate without it is
shown beside ("before": the same spec with the mechanism switched off). Qwen-7B's first release
(remote code) is counted from sparse safetensors files with its real tensor shapes.

Run: .venv/bin/python benchmarks/recipes.py   (about 4 minutes and 6 GB of memory at a time; CPU only)
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from vramlab.core.catalog import find_model  # noqa: E402
from vramlab.core.checks import SetupError  # noqa: E402
from vramlab.core.estimate import estimate  # noqa: E402
from vramlab.core.simulation.simulate import simulate  # noqa: E402
from vramlab.core.sources.folder import load_model_source  # noqa: E402
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup  # noqa: E402

RECIPES = [
    ("Mistral-7B-v0.1 LoRA r8 q,k,v,o 1x4096 sdpa", "mistral-7b-v0.1",
     TrainingSetup(method="lora", lora_targets="q,k,v,o", seq_len=4096), {"sliding_window": 0}),
    ("Llama-3.1-8B last 2 layers trained, checkpointing, 2x2048", "llama-3.1-8b",
     TrainingSetup(method="freeze", trainable_layers=2, grad_ckpt=True, micro_batch=2, seq_len=2048), None),
    ("Phi-3-mini LoRA r16 qkv_proj,o_proj,gate_up_proj,down_proj 1x2048", "phi-3-mini-4k",
     TrainingSetup(method="lora", lora_rank=16, lora_targets="qkv_proj,o_proj,gate_up_proj,down_proj",
                   seq_len=2048), None),
    # fp32 weights, bf16 autocast (AMP): the reference emulates CUDA autocast's op lists and weight cache
    ("TinyLlama full fp32 weights + bf16 autocast, checkpointing, 4x2048", "tinyllama-1.1b",
     TrainingSetup(weights="fp32", grad_ckpt=True, micro_batch=4, seq_len=2048), None),
    ("TinyLlama full bf16 weights + bf16 autocast (Trainer bf16=True), checkpointing, 4x2048", "tinyllama-1.1b",
     TrainingSetup(amp=True, grad_ckpt=True, micro_batch=4, seq_len=2048), None),
]
NOT_RUN: dict[str, str] = {}

QWEN_7B = {
    "architectures": ["QWenLMHeadModel"], "auto_map": {"AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
    "hidden_size": 4096, "intermediate_size": 22016, "kv_channels": 128, "max_position_embeddings": 8192,
    "model_type": "qwen", "num_attention_heads": 32, "num_hidden_layers": 32, "tie_word_embeddings": False,
    "vocab_size": 151936, "torch_dtype": "bfloat16",
}


def qwen_7b_count() -> dict:
    """Qwen-7B (remote code): refused from config.json alone; counted from its (sparse) safetensors."""
    h, ff, v = 4096, 11008, 151936
    shapes = {"transformer.wte.weight": (v, h), "transformer.ln_f.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(32):
        p = f"transformer.h.{i}."
        shapes |= {p + "ln_1.weight": (h,), p + "attn.c_attn.weight": (3 * h, h), p + "attn.c_attn.bias": (3 * h,),
                   p + "attn.c_proj.weight": (h, h), p + "ln_2.weight": (h,), p + "mlp.w1.weight": (ff, h),
                   p + "mlp.w2.weight": (ff, h), p + "mlp.c_proj.weight": (h, ff)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "Qwen-7B"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(QWEN_7B))
        try:
            load_model_source(folder / "config.json")
            alone = "read (not refused)"
        except SetupError as e:
            alone = f"refused: {e}"
        header, offset = {}, 0
        for name, shape in shapes.items():
            n = 2
            for d in shape:
                n *= d
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with (folder / "model.safetensors").open("wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
        m = load_model_source(folder)
    return {"config_alone": alone, "params_from_headers": m.spec.param_count,
            "read_as_llama_before": 12_049_453_056,
            "note": next(w for w in m.warnings if "headers" in w)}


def run_recipe(label: str, model: str, setup: TrainingSetup, before: dict | None) -> dict:
    spec: ModelSpec | None = find_model(model)
    assert spec is not None, model
    t0 = time.perf_counter()
    est = estimate(spec, setup)
    t_est = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = simulate(spec, setup, hf=True)
    t_ref = time.perf_counter() - t0
    row = {"recipe": label, "model": model, "setup": setup.to_dict(),
           "estimate_bytes": est.peak_allocated_bytes, "simulate_hf_bytes": ref.peak_allocated_bytes,
           "error_pct": round(100 * (est.peak_allocated_bytes / ref.peak_allocated_bytes - 1), 4),
           "params_equal": est.total_params == ref.total_params and est.trainable_params == ref.trainable_params,
           "phases_estimate_minus_simulate_hf_bytes": {
               p.key: e.bytes - p.bytes for p, e in zip(ref.phases, est.phases) if p.key == e.key},
           "estimate_s": round(t_est, 3), "simulate_hf_s": round(t_ref, 1)}
    if before:
        old = estimate(dataclasses.replace(spec, **before), setup).peak_allocated_bytes
        row["before_bytes"] = old
        row["before_error_pct"] = round(100 * (old / ref.peak_allocated_bytes - 1), 4)
        row["before_is"] = f"the same spec with {before} (the mechanism not modelled)"
    print(f"{label}: estimate {row['error_pct']:+.3f} % vs simulate --hf"
          + (f" (before {row['before_error_pct']:+.2f} %)" if before else ""), flush=True)
    return row


def main() -> None:
    rows = [run_recipe(*r) for r in RECIPES]
    qwen = qwen_7b_count()
    print(f"Qwen-7B: {qwen['params_from_headers']:,} parameters from the headers; config alone: "
          f"{qwen['config_alone'][:40]}")
    record("recipes", {"tensor_level": "peak allocated (max_memory_allocated)", "recipes": rows,
                       "not_run": NOT_RUN, "qwen_7b_remote_code": qwen})


if __name__ == "__main__":
    main()
