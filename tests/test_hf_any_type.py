"""transformers' own classes for any model type it ships, built from a config (never remote code): reduced
depth with the full model's parameter count exact, LoRA on the model's own module names, generic freezing.

Tiny widths keep this fast; the real-width matrix is ``benchmarks/architectures.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.checks import SetupError  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402
from vramlab.core.tracing import (
    hf,  # noqa: E402
    hfconfig,  # noqa: E402
)

# more types and recipes: marked slow and run only with VRAMLAB_SLOW=1 (the default run stays within seconds)
SLOW = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("VRAMLAB_SLOW") != "1", reason="set VRAMLAB_SLOW=1")]

# tiny configs in each type's own keys (real configs differ only in size)
TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256),
    "gpt2": dict(n_embd=64, n_layer=5, n_head=4, vocab_size=256, n_positions=512),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                     vocab_size=256),
    "falcon": dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, vocab_size=256,
                   new_decoder_architecture=True, num_kv_heads=2),
    "bloom": dict(hidden_size=64, n_layer=5, n_head=4, vocab_size=256),
    "mixtral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2),
    # three dense layers, then MoE: a heterogeneous stack
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=7,
                        num_attention_heads=4, num_key_value_heads=4, vocab_size=256, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=3,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    # five sliding-window layers, then one full-attention layer, repeated
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=14, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=256),
    "t5": dict(d_model=64, d_ff=128, d_kv=16, num_layers=5, num_decoder_layers=4, num_heads=4, vocab_size=256,
               decoder_start_token_id=0),
    "bert": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4, vocab_size=256),
}


def tiny(model_type: str, **change) -> dict:
    return {"model_type": model_type, **TINY[model_type], **change}


def _own_count(config: dict) -> int:
    """The model's own count, built at full depth on the meta device."""
    task = hfconfig.task_of(config)
    with torch.device("meta"):
        model = task.model_class._from_config(task.config, dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_reduced_depth_counts_the_full_model_exactly(model_type):
    config = tiny(model_type)
    depth = hfconfig.plan_depth(hfconfig.task_of(config))
    assert depth.reduced
    task = hfconfig.task_of(depth.config)
    with torch.device("meta"):
        reduced = task.model_class._from_config(task.config, dtype=torch.bfloat16)
    assert sum(p.numel() for p in reduced.parameters()) < _own_count(config)
    assert hfconfig.full_param_count(reduced, depth) == _own_count(config)


def test_depth_holds_one_layer_of_every_kind():
    # DeepSeek-V3: dense layers first, then MoE; Gemma 3: five sliding-window layers per full one
    assert hfconfig.plan_depth(hfconfig.task_of(tiny("deepseek_v3"))).depth == 4
    assert hfconfig.plan_depth(hfconfig.task_of(tiny("gemma3_text"))).depth == 6
    assert hfconfig.plan_depth(hfconfig.task_of(tiny("llama"))).depth == 2
    t5 = hfconfig.plan_depth(hfconfig.task_of(tiny("t5")))
    assert hfconfig.layer_counts(t5.config) == {"num_layers": 2, "num_decoder_layers": 2}


def test_a_wrong_count_is_refused():
    depth = hfconfig.plan_depth(hfconfig.task_of(tiny("llama")))
    task = hfconfig.task_of(depth.config)
    with torch.device("meta"):
        reduced = task.model_class._from_config(task.config, dtype=torch.bfloat16)
    wrong = hfconfig.Depth(depth.config, depth.depth, depth.full_counts, depth.full_layers, depth.own_params + 1)
    with pytest.raises(SetupError, match="not counted exactly"):
        hfconfig.full_param_count(reduced, wrong)


@pytest.mark.parametrize("config, reason", [
    ({"model_type": "qwen", "hidden_size": 64}, "does not ship model type 'qwen'"),
    ({"hidden_size": 64}, "no model_type"),
    ({"model_type": "vit"}, "no causal-LM, seq2seq-LM or masked-LM class"),
    ({"model_type": "llama", "num_attention_heads": "many"}, "cannot read this llama config"),
])
def test_what_transformers_cannot_build_is_refused_with_the_reason(config, reason):
    with pytest.raises(SetupError, match=reason):
        hfconfig.task_of(config)


def test_multimodal_config_builds_its_language_model():
    task = hfconfig.task_of({"model_type": "llava", "text_config": {"model_type": "llama", **TINY["llama"]}})
    assert task.kind == hfconfig.CAUSAL and task.model_class.__name__ == "LlamaForCausalLM"
    assert "language model of llava" in task.notes[0]


def _build(config: dict, setup: TrainingSetup) -> hf.HFModel:
    depth = hfconfig.plan_depth(hfconfig.task_of(config))
    with torch.device("meta"):
        return hf.build_hf(None, setup, "meta", False, depth=depth)


def _adapted(model: hf.HFModel) -> list[str]:
    return sorted({n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A" in n})


@pytest.mark.parametrize("model_type, targets, adapted", [
    ("gpt_neox", "query_key_value", ["query_key_value"]),
    ("gpt_neox", "q_proj,v_proj", ["query_key_value"]),  # the fused module, as peft's defaults adapt it
    ("gpt2", "c_attn,c_proj", ["c_attn", "c_proj"]),
    ("gpt2", "o_proj", ["c_proj"]),  # the attention's c_proj only
    ("falcon", "query_key_value,dense_4h_to_h", ["dense_4h_to_h", "query_key_value"]),
    ("bloom", "query_key_value", ["query_key_value"]),
    ("llama", "all-linear", ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]),
    ("gpt2", "all-linear", ["c_attn", "c_fc", "c_proj"]),
])
def test_lora_on_the_models_own_names(model_type, targets, adapted):
    model = _build(tiny(model_type), TrainingSetup(method="lora", lora_targets=targets))
    assert _adapted(model) == adapted


def test_gpt2_o_proj_adapts_the_attention_output_not_the_mlp():
    model = _build(tiny("gpt2"), TrainingSetup(method="lora", lora_targets="o_proj"))
    paths = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert paths and all(".attn." in p for p in paths)


def test_a_target_the_model_lacks_is_refused_with_its_own_names():
    with pytest.raises(SetupError, match="query_key_value"):
        _build(tiny("gpt_neox"), TrainingSetup(method="lora", lora_targets="gate_proj"))


def test_all_linear_refuses_a_router_peft_cannot_wrap():
    cfg = {"model_type": "llama4_text", **TINY["llama"], "num_local_experts": 2, "intermediate_size_mlp": 128,
           "head_dim": 16}
    with pytest.raises(SetupError, match="Llama4Router"):
        _build(cfg, TrainingSetup(method="lora", lora_targets="all-linear"))


@pytest.mark.parametrize("model_type", ["gpt2", "bert", "llama"])
def test_freeze_trains_the_last_layers_and_only_the_extras_named(model_type):
    """As LLaMA-Factory's freeze step and a plain requires_grad freeze (issue 29): the last layers train, the head
    stays frozen unless freeze_extra names it, and a tied head stays frozen with the embedding."""
    for extra in ((), ("lm_head",)):
        model = _build(tiny(model_type), TrainingSetup(method="freeze", trainable_layers=1, freeze_extra=extra))
        inner = model.inner
        (name, stack), *_ = hfconfig.layer_stacks(inner)
        trainable = {id(p) for p in inner.parameters() if p.requires_grad}
        assert all(id(p) in trainable for p in stack[-1].parameters())
        assert not any(id(p) in trainable for layer in stack[:-1] for p in layer.parameters())
        tied = {id(p) for p in inner.get_input_embeddings().parameters()}
        own_head = [p for p in inner.get_output_embeddings().parameters() if id(p) not in tied]
        assert all((id(p) in trainable) == bool(extra) for p in own_head)
        assert not any(id(p) in trainable for p in tied)


@pytest.mark.parametrize("model_type", ["gpt2", "bert", *(pytest.param(t, marks=SLOW)
                                                         for t in ("llama", "mixtral", "t5", "bloom"))])
def test_one_training_step_of_any_type(model_type):
    setups = [TrainingSetup(seq_len=32), TrainingSetup(method="lora", lora_targets="all-linear", seq_len=32,
                                                       grad_ckpt=True)]
    full, lora = (hf.measure_config(tiny(model_type), s) for s in setups)
    own = _own_count(tiny(model_type))
    assert full.params == lora.params == own
    assert full.depth == 2 and full.built_params < own
    assert lora.trainable_params < full.trainable_params == full.built_params
    assert lora.peak_bytes < full.peak_bytes
    if model_type == "bloom":
        assert any("no SDPA path" in n for n in full.notes)


def test_a_sequence_beyond_learned_positions_is_refused():
    with pytest.raises(SetupError, match="learned positions for 512 tokens"):
        hf.measure_config(tiny("gpt2"), TrainingSetup(seq_len=513))
    with pytest.raises(SetupError, match="learned positions for 510 tokens"):  # RoBERTa: 512 from padding_idx 1
        _build({"model_type": "roberta", **TINY["bert"], "max_position_embeddings": 512, "pad_token_id": 1},
               TrainingSetup(seq_len=511))


LLAMA_SPEC = dict(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=1000)


@pytest.mark.parametrize("setup", [
    TrainingSetup(method="qlora", seq_len=64),
    pytest.param(TrainingSetup(method="qlora", lora_targets="all-linear", seq_len=64, double_quant=False),
                 marks=SLOW),
    pytest.param(TrainingSetup(method="qlora", weights="int8", seq_len=64), marks=SLOW),
], ids=["nf4", "nf4-all-linear-no-dq", "int8"])
def test_quantized_storage_on_the_hf_path_matches_the_builder(setup):
    # bitsandbytes needs a GPU: the HF path swaps each Linear for the storage the builder models
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.spec.model import ModelSpec

    spec = ModelSpec(**LLAMA_SPEC)
    ours, ref = simulate(spec, setup), simulate(spec, setup, hf=True)
    assert abs(ours.peak_allocated_bytes - ref.peak_allocated_bytes) <= 8 * 1024
    assert (ours.total_params, ours.trainable_params) == (ref.total_params, ref.trainable_params)
    assert any("emulated" in w for w in ref.warnings)


@pytest.mark.parametrize("model_type", ["gpt2", pytest.param("mixtral", marks=SLOW)])
def test_qlora_of_any_type_counts_the_full_model(model_type):
    run = hf.measure_config(tiny(model_type), TrainingSetup(method="qlora", lora_targets="all-linear", seq_len=32))
    assert run.params == _own_count(tiny(model_type))
    bf16 = hf.measure_config(tiny(model_type), TrainingSetup(method="lora", lora_targets="all-linear", seq_len=32))
    assert run.trainable_params == bf16.trainable_params


@pytest.mark.parametrize("setup", [
    TrainingSetup(weights="fp32", seq_len=64, grad_ckpt=True),
    TrainingSetup(method="lora", weights="fp32", seq_len=64),
], ids=["full-fp32-amp-ckpt", "lora-fp32-amp"])
def test_autocast_builder_estimate_and_transformers_agree_in_every_phase(setup):
    # CUDA autocast's weight cache holds each trainable fp32 parameter's bf16 copy to the end of the
    # forward: under checkpointing nothing else does (the forward phase was one layer set of copies short)
    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.spec.model import ModelSpec

    spec = ModelSpec(**LLAMA_SPEC)
    ours, ref = simulate(spec, setup), simulate(spec, setup, hf=True)
    for p, q in zip(ours.phases, ref.phases):
        # transformers' checkpointing keeps the position ids and rotary tables (fp32 here): 33 KB at 64 tokens
        assert p.key == q.key and abs(p.bytes - q.bytes) <= 34 * 1024
    est = estimate(spec, setup, match_simulation=True)
    assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in ours.phases}


MATRIX_SETUPS = {
    "full bf16": TrainingSetup(seq_len=64),
    "LoRA all-linear": TrainingSetup(method="lora", lora_targets="all-linear", lora_rank=16, seq_len=64),
    "QLoRA NF4 all-linear": TrainingSetup(method="qlora", lora_targets="all-linear", lora_rank=16, seq_len=64),
    "full + checkpointing": TrainingSetup(seq_len=64, grad_ckpt=True),
    # held since the builder frees peft's LoRA outputs as peft's one expression does (24 KB apart before)
    "LoRA all-linear + checkpointing": TrainingSetup(method="lora", lora_targets="all-linear", lora_rank=16,
                                                     seq_len=64, grad_ckpt=True),
}


@pytest.mark.parametrize("recipe", sorted(MATRIX_SETUPS))
@pytest.mark.parametrize("config", [
    tiny("llama"),
    pytest.param({"model_type": "qwen3", **TINY["llama"], "head_dim": 16}, marks=SLOW, id="qwen3"),
    pytest.param({"model_type": "mistral", **TINY["llama"], "sliding_window": 32}, marks=SLOW, id="mistral"),
], ids=lambda c: c["model_type"] if isinstance(c, dict) else None)
def test_the_matrix_in_small_hand_written_equals_transformers(config, recipe):
    # the architecture matrix (benchmarks/architectures.py) at tiny width: where a family is hand-written,
    # its estimate of the reduced config predicts simulate --hf of the same config
    from vramlab.core.estimate import estimate
    from vramlab.core.sources.hf_config import spec_from_hf_config

    setup = MATRIX_SETUPS[recipe]
    run = hf.measure_config(config, setup)
    reduced = hfconfig.plan_depth(hfconfig.task_of(config)).config.to_dict()
    spec = spec_from_hf_config(reduced, id="m", name="M")
    est = estimate(spec, setup, match_simulation=True)
    assert abs(est.peak_allocated_bytes - run.peak_bytes) <= 8 * 1024
    assert spec_from_hf_config(config, id="m", name="M").param_count == run.params


@pytest.mark.parametrize("model_type, attention", [("bloom", "eager"), ("gpt2", "sdpa"), ("llama", "sdpa")])
def test_classes_without_an_sdpa_path_run_eager_and_say_so(model_type, attention):
    chosen, notes = hf._attention(hfconfig.task_of(tiny(model_type)), TrainingSetup())
    assert chosen == attention
    assert bool(notes) == (attention == "eager") and all("no SDPA path" in n for n in notes)
