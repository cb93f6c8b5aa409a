"""The architecture matrix: model types the installed transformers ships, at their real width, under
``simulate --hf`` (transformers' own class + peft under fake tensors), beside the estimate.

Each type is built from the dimensions of a published config (``CONFIGS``: the model id they come from and
the numbers of its ``config.json``), with its layer stacks cut to the fewest layers that hold one layer of
every kind (dense / MoE, sliding / full attention; ``core.tracing.hfconfig.plan_depth``). Per type and recipe:

* the tensor peak of one training step (two optimizer steps, 512-byte blocks) at that depth,
* the full model's parameter count (per layer kind x layers + the rest) and the model's own count (built
  at full depth on the meta device): they must be equal,
* ``estimate``: what :func:`estimate_for` answers for the same case: today the hand-written estimate where
  the family is hand-written (the config read by ``spec_from_hf_config`` at the same depth, predicting the
  simulation: ``match_simulation``), "not yet" elsewhere; the trace (issue #12) fills the hook in. Beside
  it the hand-written CUDA prediction (gradients accumulated in place, as a CUDA run does and a dispatch
  mode prevents).

A recipe a type cannot run is recorded with the reason (an exclusion), never dropped.

Run:   .venv/bin/python benchmarks/architectures.py             (all types; a few minutes, CPU only)
       .venv/bin/python benchmarks/architectures.py --quick     (a handful of types, two recipes)
       .venv/bin/python benchmarks/architectures.py --only gpt2,t5 --no-record
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from vramlab.core.checks import SetupError  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402

SEQ = 512  # the longest every type here has positions for (BERT, RoBERTa: 512)
RANK = 16

# model type -> (the published model its dimensions come from, those dimensions in its config's own keys)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("meta-llama/Llama-3.1-8B", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=False)),
    "mistral": ("mistralai/Mistral-7B-v0.1", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, sliding_window=4096)),
    "mixtral": ("mistralai/Mixtral-8x7B-v0.1", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, num_local_experts=8,
        num_experts_per_tok=2, rope_theta=1e6)),
    "qwen2": ("Qwen/Qwen2.5-7B", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_theta=1e6)),
    "qwen2_moe": ("Qwen/Qwen1.5-MoE-A2.7B", dict(
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=151936, max_position_embeddings=8192,
        tie_word_embeddings=False)),
    "qwen3": ("Qwen/Qwen3-8B", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3_moe": ("Qwen/Qwen3-30B-A3B", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False)),
    "gemma": ("google/gemma-7b", dict(
        hidden_size=3072, intermediate_size=24576, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=16, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh")),
    "gemma2": ("google/gemma-2-9b", dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        sliding_window=4096, query_pre_attn_scalar=256, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0)),
    "gemma3_text": ("google/gemma-3-1b-pt", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768,
        sliding_window=512, query_pre_attn_scalar=256)),
    "phi": ("microsoft/phi-2", dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=32, num_attention_heads=32,
        vocab_size=51200, max_position_embeddings=2048, partial_rotary_factor=0.4)),
    "phi3": ("microsoft/Phi-3-mini-4k-instruct", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, sliding_window=2047,
        pad_token_id=32000, bos_token_id=1, eos_token_id=32000)),
    "phimoe": ("microsoft/Phi-3.5-MoE-instruct", dict(
        hidden_size=4096, intermediate_size=6400, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=16, num_experts_per_tok=2, vocab_size=32064,
        max_position_embeddings=131072)),
    "gpt2": ("openai-community/gpt2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
    "gpt_neox": ("EleutherAI/pythia-1.4b", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16, vocab_size=50304,
        max_position_embeddings=2048, rotary_pct=0.25, tie_word_embeddings=False)),
    "gptj": ("EleutherAI/gpt-j-6b", dict(n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, vocab_size=50400,
                                         n_positions=2048)),
    "falcon": ("tiiuae/falcon-7b", dict(
        hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True, parallel_attn=True,
        new_decoder_architecture=False, bias=False, alibi=False, vocab_size=65024)),
    "bloom": ("bigscience/bloom-560m", dict(hidden_size=1024, n_layer=24, n_head=16, vocab_size=250880)),
    "opt": ("facebook/opt-1.3b", dict(
        hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32, vocab_size=50272,
        max_position_embeddings=2048, word_embed_proj_dim=2048)),
    "gpt_bigcode": ("bigcode/starcoderbase-1b", dict(
        n_embd=2048, n_inner=8192, n_layer=24, n_head=16, multi_query=True, vocab_size=49152, n_positions=8192)),
    "olmo": ("allenai/OLMo-1B-hf", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=50304, max_position_embeddings=2048, tie_word_embeddings=True)),
    "olmo2": ("allenai/OLMo-2-1124-7B", dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096)),
    "granite": ("ibm-granite/granite-3.0-2b-base", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=49155, max_position_embeddings=4096, tie_word_embeddings=True,
        embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.015625)),
    "granitemoe": ("ibm-granite/granite-3.0-1b-a400m-base", dict(
        hidden_size=1024, intermediate_size=512, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=8, vocab_size=49155,
        max_position_embeddings=4096, tie_word_embeddings=True)),
    "cohere": ("CohereForAI/c4ai-command-r-v01", dict(
        hidden_size=8192, intermediate_size=22528, num_hidden_layers=40, num_attention_heads=64,
        num_key_value_heads=64, vocab_size=256000, max_position_embeddings=8192, use_qk_norm=False)),
    "cohere2": ("CohereForAI/c4ai-command-r7b-12-2024", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=256000, max_position_embeddings=8192, sliding_window=4096,
        sliding_window_pattern=4)),
    "stablelm": ("stabilityai/stablelm-2-1_6b", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096, partial_rotary_factor=0.25,
        use_qkv_bias=True, tie_word_embeddings=False)),
    "starcoder2": ("bigcode/starcoder2-3b", dict(
        hidden_size=3072, intermediate_size=12288, num_hidden_layers=30, num_attention_heads=24,
        num_key_value_heads=2, vocab_size=49152, max_position_embeddings=16384, sliding_window=4096,
        use_bias=True)),
    "deepseek_v2": ("deepseek-ai/DeepSeek-V2-Lite", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", n_group=1,
        topk_group=1, vocab_size=102400, max_position_embeddings=163840)),
    "deepseek_v3": ("deepseek-ai/DeepSeek-V3", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
        vocab_size=129280, max_position_embeddings=163840)),
    "gpt_oss": ("openai/gpt-oss-20b", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        sliding_window=128, max_position_embeddings=131072)),
    "llama4_text": ("meta-llama/Llama-4-Scout-17B-16E (text_config)", dict(
        hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16,
        num_experts_per_tok=1, interleave_moe_layer_step=1, vocab_size=202048,
        max_position_embeddings=10485760, attention_chunk_size=8192, use_qk_norm=True)),
    "mpt": ("mosaicml/mpt-7b", dict(d_model=4096, n_layers=32, n_heads=32, expansion_ratio=4, vocab_size=50432,
                                    max_seq_len=2048)),
    "codegen": ("Salesforce/codegen-350M-mono", dict(n_embd=1024, n_layer=20, n_head=16, rotary_dim=32,
                                                     vocab_size=51200, n_positions=2048, n_ctx=2048)),
    "glm": ("THUDM/glm-4-9b-chat-hf", dict(
        hidden_size=4096, intermediate_size=13696, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=2, head_dim=128, vocab_size=151552, max_position_embeddings=131072,
        attention_bias=True, partial_rotary_factor=0.5)),
    "helium": ("kyutai/helium-1-preview-2b", dict(
        hidden_size=2560, intermediate_size=7040, num_hidden_layers=24, num_attention_heads=20,
        num_key_value_heads=20, head_dim=128, vocab_size=48000, max_position_embeddings=4096)),
    "smollm3": ("HuggingFaceTB/SmolLM3-3B", dict(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=128256, max_position_embeddings=65536, tie_word_embeddings=True,
        no_rope_layer_interval=4)),
    "t5": ("google-t5/t5-base", dict(d_model=768, d_ff=3072, d_kv=64, num_layers=12, num_heads=12,
                                     vocab_size=32128, decoder_start_token_id=0, pad_token_id=0)),
    "mt5": ("google/mt5-base", dict(d_model=768, d_ff=2048, d_kv=64, num_layers=12, num_heads=12,
                                    vocab_size=250112, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                    decoder_start_token_id=0, pad_token_id=0)),
    "bart": ("facebook/bart-base", dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                                        decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
                                        vocab_size=50265, max_position_embeddings=1024)),
    "bert": ("google-bert/bert-base-uncased", dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=30522)),
    "roberta": ("FacebookAI/roberta-base", dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=50265,
        max_position_embeddings=514, type_vocab_size=1, pad_token_id=1)),
}

RECIPES: dict[str, TrainingSetup] = {
    "full bf16": TrainingSetup(seq_len=SEQ),
    "LoRA all-linear": TrainingSetup(method="lora", lora_targets="all-linear", lora_rank=RANK, seq_len=SEQ),
    "QLoRA NF4 all-linear": TrainingSetup(method="qlora", lora_targets="all-linear", lora_rank=RANK, seq_len=SEQ),
    "LoRA all-linear + checkpointing": TrainingSetup(method="lora", lora_targets="all-linear", lora_rank=RANK,
                                                     seq_len=SEQ, grad_ckpt=True),
}
QUICK_TYPES = ("llama", "gpt2", "mixtral", "t5", "bert")
QUICK_RECIPES = ("full bf16", "LoRA all-linear")


@dataclasses.dataclass(frozen=True)
class Case:
    """One cell of the matrix: a model type's published config at reduced depth under one recipe."""

    model_type: str
    model_id: str
    config: dict[str, Any]  # the full config (model_type included)
    reduced_config: dict[str, Any]  # the config as built (layer counts cut)
    recipe: str
    setup: TrainingSetup


def estimate_for(case: Case) -> tuple[int | None, str]:
    """The estimate for ``case`` (tensor peak, bytes) as ``simulate --hf`` measures it, and where it came
    from (the result's ``source``). Hand-written families: the default (``auto``) estimate of the reduced
    config with ``match_simulation`` (the simulation's dispatch mode makes autograd accumulate gradients out
    of place, which a CUDA run does in place: the CUDA prediction is recorded beside it): the hand-written
    program, or the trace where ``auto`` takes it (an MoE with LoRA on its MLP; a type read generically);
    others: None ("not yet"; ``--traced`` records the traced estimate of every cell)."""
    from vramlab.core.estimate import estimate
    from vramlab.core.families.registry import REFUSED
    from vramlab.core.sources.hf_config import spec_from_hf_config

    if case.model_type in REFUSED:  # VRAM Lab does not read this type itself: only traced (--traced)
        return None, f"not yet (hand-written: {REFUSED[case.model_type][:160]})"
    try:
        spec = spec_from_hf_config(case.reduced_config, id=case.model_type, name=case.model_id)
        est = estimate(spec, case.setup, match_simulation=True)
    except SetupError as e:
        return None, f"not yet (hand-written: {str(e).splitlines()[0][:160]})"
    return est.peak_allocated_bytes, est.source


def traced_estimate_for(case: Case) -> tuple[int | None, str]:
    """The traced source's estimate for ``case`` (core/traced.py: the same classes recorded at 2-4 layers over
    a few points, fitted, verified, extended to the depth built here), in the simulation's variant, and how it
    was obtained (fitted, per sequence length, or simulated directly), or why there is none."""
    from vramlab.core.estimate import estimate
    from vramlab.core.sources.traced_config import traced_spec

    try:  # every type as a traced spec, hand-written families too: the trace builds from the config itself
        spec, _ = traced_spec(case.reduced_config, case.model_type, id=case.model_type, name=case.model_id,
                              source="matrix", dtype=None)
        est = estimate(spec, case.setup, match_simulation=True)
    except SetupError as e:
        return None, f"refused: {str(e).splitlines()[0][:160]}"
    how = est.notes[0].split(":")[0] if est.notes else ""
    return est.peak_allocated_bytes, f"{est.source}; {how}"


def cuda_estimate_for(case: Case) -> int | None:
    """The hand-written prediction of a CUDA run (gradients accumulated in place), where there is one."""
    from vramlab.core.estimate import estimate
    from vramlab.core.families.registry import REFUSED
    from vramlab.core.sources.hf_config import spec_from_hf_config

    if case.model_type in REFUSED:
        return None
    try:
        spec = spec_from_hf_config(case.reduced_config, id=case.model_type, name=case.model_id)
        return estimate(spec, case.setup, calibration=None).peak_allocated_bytes
    except SetupError:
        return None


def run_case(model_type: str, recipe: str, traced: bool = False) -> dict[str, Any]:
    from vramlab.core.tracing import hf, hfconfig

    model_id, dims = CONFIGS[model_type]
    config = {"model_type": model_type, **dims}
    setup = RECIPES[recipe]
    row: dict[str, Any] = {"model_type": model_type, "model_id": model_id, "recipe": recipe}
    t0 = time.perf_counter()
    try:
        run = hf.measure_config(config, setup)
    except SetupError as e:
        row.update(excluded=str(e).splitlines()[0], seconds=round(time.perf_counter() - t0, 1))
        return row
    except Exception as e:  # noqa: BLE001 - transformers / peft failing mid-step: recorded as the reason
        row.update(excluded=f"{type(e).__name__} in the step: {str(e).splitlines()[0][:200]}",
                   seconds=round(time.perf_counter() - t0, 1))
        return row
    reduced = hfconfig.plan_depth(hfconfig.task_of(config)).config.to_dict()
    case = Case(model_type, model_id, config, reduced, recipe, setup)
    est, source = estimate_for(case)
    row.update(model_class=run.model_class, depth=run.depth, simulate_hf_peak_bytes=run.peak_bytes,
               peak_phase=run.peak_phase, params=run.params, own_params=run.own_params,
               params_equal=run.params == run.own_params, built_params=run.built_params,
               trainable_params_built=run.trainable_params, notes=list(run.notes),
               estimate_bytes=est, estimate_source=source, estimate_cuda_bytes=cuda_estimate_for(case),
               estimate_error_pct=None if est is None else round(100 * (est / run.peak_bytes - 1), 3),
               seconds=round(run.seconds, 1))
    if traced:
        t1 = time.perf_counter()
        tr, how = traced_estimate_for(case)
        row.update(traced_bytes=tr, traced_source=how, traced_seconds=round(time.perf_counter() - t1, 1),
                   traced_error_pct=None if tr is None else round(100 * (tr / run.peak_bytes - 1), 3))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_TYPES)} and two recipes")
    ap.add_argument("--only", default="", help="comma-separated model types")
    ap.add_argument("--recipes", default="", help="comma-separated recipe names")
    ap.add_argument("--traced", action="store_true",
                    help="also the traced estimate of every cell (a trace each; recorded as architectures_traced)")
    ap.add_argument("--update", action="store_true",
                    help="re-run the cells asked and keep the other rows of the recorded result")
    ap.add_argument("--no-record", action="store_true", help="print only; do not write results/architectures.json")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging

    import transformers

    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

    transformers.logging.set_verbosity_error()
    types = [t for t in args.only.split(",") if t] or (list(QUICK_TYPES) if args.quick else list(CONFIGS))
    recipes = [r for r in args.recipes.split(",") if r] or (list(QUICK_RECIPES) if args.quick else list(RECIPES))
    unknown = [t for t in types if t not in CONFIGS] + [r for r in recipes if r not in RECIPES]
    if unknown:
        print(f"unknown model type or recipe: {', '.join(unknown)}", file=sys.stderr)
        return 2
    rows = []
    t0 = time.perf_counter()
    for t in types:
        for r in recipes:
            row = run_case(t, r, traced=args.traced)
            rows.append(row)
            if "excluded" in row:
                print(f"{t:14s} {r:32s} excluded: {row['excluded'][:110]}", flush=True)
            else:
                est = "not yet" if row["estimate_bytes"] is None else f"{row['estimate_error_pct']:+.2f} %"
                print(f"{t:14s} {r:32s} depth {row['depth']} peak {row['simulate_hf_peak_bytes'] / 2**30:7.2f} GiB "
                      f"params {row['params']:>15,} {'==' if row['params_equal'] else '!='} own; estimate {est} "
                      f"({row['seconds']} s)"
                      + (f"; traced {row['traced_error_pct']:+.3f} % ({row['traced_source']})"
                         if row.get("traced_bytes") is not None else
                         f"; traced: {row['traced_source']}" if args.traced else ""), flush=True)
    total = time.perf_counter() - t0
    import peft
    import torch

    name = "architectures_traced" if args.traced else "architectures"
    rerun = {(r["model_type"], r["recipe"]) for r in rows}
    if args.update:  # these cells re-run, the rest of the recorded matrix kept (and said so per row)
        import json

        from common import RESULTS

        kept = json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))["rows"]
        merged = {(r["model_type"], r["recipe"]): r for r in kept}
        merged.update({(r["model_type"], r["recipe"]): r for r in rows})
        rows = list(merged.values())
        types = sorted({r["model_type"] for r in rows})
    summary = {
        "types": len(types), "cases": len(rows), "run": sum("excluded" not in r for r in rows),
        "excluded": sum("excluded" in r for r in rows),
        "params_equal_everywhere": all(r.get("params_equal", True) for r in rows),
        "estimated": sum(r.get("estimate_bytes") is not None for r in rows), "seconds": round(total, 1),
    }
    if args.traced:
        errs = [abs(r["traced_error_pct"]) for r in rows if r.get("traced_error_pct") is not None]
        summary.update(traced=len(errs), traced_within_half_pct=sum(e <= 0.5 for e in errs),
                       traced_exact=sum(r.get("traced_bytes") == r.get("simulate_hf_peak_bytes") for r in rows
                                        if r.get("traced_bytes") is not None))
    print(summary)
    if not args.no_record:
        record(name, {
            "tensor_level": "peak allocated (512-byte blocks, max_memory_allocated) of simulate --hf at the depth "
                            "shown; params: the full model's",
            "versions": {"transformers": transformers.__version__, "peft": peft.__version__,
                         "torch": torch.__version__},
            "sequence": SEQ, "micro_batch": 1, "lora_rank": RANK,
            "subset": bool(args.only or args.quick) and not args.update,
            "rerun_by_update": sorted(f"{t} / {r}" for t, r in rerun) if args.update else [],
            "summary": summary, "rows": rows,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
