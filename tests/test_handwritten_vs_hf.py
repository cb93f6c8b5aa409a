"""The hand-written program held to transformers' own classes where the architecture matrix found them apart
(issue 12: "CI holds hand-written == traced == simulate --hf on a matrix").

Each case is a published config's layout at tiny widths and two layers, read as users read it
(``spec_from_hf_config``) and estimated by the hand-written program (the variant that predicts the
simulation), against ``simulate --hf`` of the same config (``measure_config``: transformers + peft under
fake tensors). Within 8 KiB, as the builder is held in ``tests/test_hf_reference.py`` (HF keeps a few small
tensors the builder lacks, such as the position ids under checkpointing). Each case names the mechanism it holds:

* peft's ``lora.Linear.forward`` frees A's output once B has run and B's once it is scaled, and the decoder
  layer frees each block's output at its residual add (Mistral, LoRA + checkpointing: 2.5 % high before);
* Gemma 2: no SDPA path in transformers (attention-logit softcapping), so eager attention with one mask per
  layer type; GemmaRMSNorm's fp32 ``(1 + weight)``; the capped logits held through the loss (9 % low before);
* Gemma 3: past its sliding window the five windowed layers of six take the mask (SDPA's additive copy saved,
  k and v repeated to every head) and the sixth attends causally without one; the full-attention layers have
  their own RoPE tables (0.54 % low for Gemma 3 4B at 1 x 1024 before, a b x s x hidden tensor a layer);
* GPT-2: no rotary embedding (learned positions), transformers' NewGELUActivation op by op (four tensors of
  the MLP's width kept per layer), and its dropouts as CUDA runs them (the fused kernel's 1-byte mask; SDPA's
  fused kernels draw their dropout from a seed), which the reference emulates (13.5 % low at real width
  against the CPU's dispatch before; 11 % low at this width);
* GPT-2 with LoRA: ``c_attn`` is one Conv1D computing q, k and v (``fused_qkv``), so peft adapts it whole (peft's
  defaults and ``all-linear``): one fp32 copy of its input and one B of 3 x hidden, not a q and a v adapter each
  with its own copy (2.9 % high at this width, all linear layers' trainable parameters 12 % high before); under
  checkpointing ``enable_input_require_grads`` marks the embedding's output, before the positions are added and
  the embedding dropout runs, so the dropout keeps its mask (1.4 % low before); GPT-2's own names c_attn, c_proj
  and c_fc are its linear layers (c_attn was refused);
* GPT-2 and phi under autocast: NewGELUActivation's ``pow`` is on CUDA autocast's fp32 list, so it takes (and saves)
  an fp32 copy of its input, and type promotion carries fp32 through the tanh, ``1 + tanh`` and the product (three
  of the four tensors it keeps are fp32, and its output; 16 % low for GPT-2 and 10 % for phi at this width before);
  ``layer_norm`` is on the fp32 list too, so a 16-bit LayerNorm's weight and bias are cast to fp32 at each call
  and saved for backward (not autocast's cached casts): two hidden-size fp32 copies per LayerNorm (StableLM,
  GPT-2 and phi alike; 10 KiB low at this width before, whatever the sequence length);
* StableLM and phi: a share of each head rotated and the rest concatenated back, the rotated parts kept to the
  attention's return (StableLmConfig's default 0.25 was read as every dim rotated where a config leaves it out;
  phi's was traced).

Cases the hand-written program hands to the trace (an MoE with LoRA on its MLP; a type read generically)
are checked for that choice here and for their figures in ``tests/test_trace.py`` and
``benchmarks/architectures.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from vramlab.core import traced
from vramlab.core.estimate import estimate
from vramlab.core.families.registry import TEXT_DEFAULTS
from vramlab.core.sources.hf_config import spec_from_hf_config
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.tracing import hf, hfconfig  # noqa: E402

TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
            num_hidden_layers=2, max_position_embeddings=4096)
MISTRAL = {"model_type": "mistral", **TINY, "sliding_window": 4096}
GEMMA2 = {"model_type": "gemma2", **TINY, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 4096,
          "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
# seven layers: six sliding-window ones and the full-attention one (the sixth), past a 64-token window
GEMMA3 = {"model_type": "gemma3_text", **TINY, "num_hidden_layers": 7, "head_dim": 64, "query_pre_attn_scalar": 64,
          "sliding_window": 64}
GPT2 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 1024}
# phi-1.5's layout (a parallel block, half of each head rotated: PhiConfig's default) and StableLM-2's (qkv biases,
# LayerNorms, a quarter of each head rotated: StableLmConfig's default)
PHI = {"model_type": "phi", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
       "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048}
STABLELM = {"model_type": "stablelm", **TINY, "num_key_value_heads": 4, "use_qkv_bias": True}
STARCODER2 = {"model_type": "starcoder2", **TINY}  # a plain MLP: c_fc, c_proj

FULL = TrainingSetup(seq_len=128)
LORA = TrainingSetup(method="lora", lora_targets="all-linear", lora_rank=16, seq_len=128)
# checkpointing in both of torch's modes: transformers' default (non-reentrant, whose recompute stops at a layer's
# last saved tensor) and the reentrant one
LORA_CKPT = dataclasses.replace(LORA, grad_ckpt=True)
LORA_CKPT_REENTRANT = dataclasses.replace(LORA_CKPT, ckpt_reentrant=True)
GPT2_CKPT = TrainingSetup(seq_len=256, grad_ckpt=True)
GPT2_LINEARS = ("c_attn", "c_proj", "c_fc")

CASES = [
    ("mistral-lora-checkpointing", MISTRAL, LORA_CKPT),
    ("mistral-lora-checkpointing-reentrant", MISTRAL, LORA_CKPT_REENTRANT),
    ("gemma2-full", GEMMA2, FULL),
    ("gemma2-lora-batch2", GEMMA2, dataclasses.replace(LORA, micro_batch=2)),
    ("gemma2-lora-checkpointing", GEMMA2, LORA_CKPT),
    ("gemma2-lora-checkpointing-reentrant", GEMMA2, LORA_CKPT_REENTRANT),
    ("gemma3-full-past-its-window", GEMMA3, FULL),
    ("gemma3-lora-within-its-window", {**GEMMA3, "sliding_window": 4096}, LORA),
    ("gpt2-full", GPT2, TrainingSetup(seq_len=256)),
    ("gpt2-full-checkpointing", GPT2, GPT2_CKPT),
    ("gpt2-full-checkpointing-reentrant", GPT2, dataclasses.replace(GPT2_CKPT, ckpt_reentrant=True)),
    ("gpt2-lora", GPT2, TrainingSetup(method="lora", seq_len=128)),  # peft's default target on GPT-2: c_attn
    # no adapter on c_attn: the embedding dropout's mask alone (1.4 % low before)
    ("gpt2-lora-checkpointing", GPT2, dataclasses.replace(LORA_CKPT, lora_targets=("o_proj", "down_proj"))),
    # every linear layer by GPT-2's own names (c_attn was refused: no qkv_proj module)
    ("gpt2-lora-own-names", GPT2, dataclasses.replace(LORA, lora_targets=GPT2_LINEARS, lora_dropout=0.05)),
    pytest.param("gpt2-lora-own-names-checkpointing-reentrant", GPT2,
                 dataclasses.replace(LORA_CKPT_REENTRANT, lora_targets=GPT2_LINEARS), marks=pytest.mark.slow),
    pytest.param("gpt2-qlora", GPT2, TrainingSetup(method="qlora", lora_targets=GPT2_LINEARS, seq_len=128,
                                                   micro_batch=2), marks=pytest.mark.slow),
    pytest.param("gpt2-qlora-autocast-checkpointing", GPT2,
                 TrainingSetup(method="qlora", amp=True, grad_ckpt=True, seq_len=128), marks=pytest.mark.slow),
    # all-linear as peft resolves it on the model (its Linear and Conv1D layers but the head): GPT-2's c_attn, c_proj,
    # c_fc and the MLP's c_proj, phi's and StarCoder2's plain MLPs; refused before ("no gate_proj module")
    ("gpt2-lora-all-linear", GPT2, LORA),
    ("gpt2-qlora-all-linear-autocast", GPT2, TrainingSetup(method="qlora", lora_targets="all-linear", amp=True,
                                                           seq_len=128)),
    ("phi-lora-all-linear-checkpointing", PHI, LORA_CKPT),
    ("starcoder2-lora-all-linear-checkpointing", STARCODER2, LORA_CKPT),
    # StableLM rotates a quarter of each head and concatenates the rest back, as Phi-3 does (it was read as
    # rotating every dim where its config leaves the factor out, and traced where the config names it)
    ("stablelm-full", STABLELM, FULL),
    ("gpt2-full-autocast", GPT2, TrainingSetup(seq_len=256, amp=True)),
    ("phi-lora-autocast", PHI, TrainingSetup(method="lora", seq_len=256, amp=True)),
    ("stablelm-full-autocast", STABLELM, TrainingSetup(seq_len=256, amp=True)),
    # under non-reentrant checkpointing a recomputed saved tensor is freed when its node's function returns, before
    # autograd casts a gradient back to its input's dtype: the product in NewGELUActivation (0.5 * x, 16-bit, times
    # the fp32 1 + tanh) lets both operands go before its 16-bit gradient is cast (one b x s x intermediate 16-bit
    # tensor high before: 1.6 % for phi, 2.2 % for GPT-2, 3.2 % for phi with LoRA)
    ("phi-full-autocast-checkpointing", PHI, TrainingSetup(seq_len=256, amp=True, grad_ckpt=True)),
    pytest.param("gpt2-full-autocast-checkpointing", GPT2, TrainingSetup(seq_len=256, amp=True, grad_ckpt=True),
                 marks=pytest.mark.slow),
    pytest.param("phi-lora-autocast-checkpointing", PHI,
                 TrainingSetup(method="lora", seq_len=256, amp=True, grad_ckpt=True), marks=pytest.mark.slow),
    ("phi-lora-checkpointing", PHI, dataclasses.replace(LORA_CKPT, lora_targets=("q_proj", "v_proj", "up_proj"))),
    ("stablelm-lora-checkpointing", STABLELM, LORA_CKPT),
    # peft 0.21.2's bnb Linear4bit casts the adapters' input and output only outside autocast (it was 8.9 % high on
    # a Llama QLoRA under autocast when the estimate cast them always)
    ("mistral-qlora-autocast", MISTRAL, TrainingSetup(method="qlora", lora_targets="all-linear", amp=True,
                                                      micro_batch=2, seq_len=128)),
    ("gemma2-qlora-autocast", GEMMA2, TrainingSetup(method="qlora", lora_targets="all-linear", amp=True,
                                                    micro_batch=2, seq_len=128)),
    ("mistral-qlora", MISTRAL, TrainingSetup(method="qlora", lora_targets="all-linear", micro_batch=2, seq_len=128)),
]


def _case(c):  # noqa: ANN001, ANN202
    if hasattr(c, "marks"):  # a pytest.param (a slow case)
        return pytest.param(*c.values[1:], id=c.values[0], marks=c.marks)
    return pytest.param(*c[1:], id=c[0])


@pytest.mark.parametrize(("config", "setup"), [_case(c) for c in CASES])
def test_hand_written_equals_transformers(config, setup):
    spec = spec_from_hf_config(config, id="m", name="M")
    assert not traced.uses_trace(spec, setup)  # the hand-written program answers these
    ours = estimate(spec, setup, match_simulation=True)
    ref = hf.measure_config(config, setup, reduce_depth=False)
    assert abs(ours.peak_allocated_bytes - ref.peak_bytes) <= 8 * 1024, (ours.peak_allocated_bytes, ref.peak_bytes)
    assert ours.peak_phase == ref.peak_phase
    assert ours.trainable_params == ref.trainable_params  # GPT-2: one adapter on c_attn, not three on q, k, v
    if config["model_type"] == "gemma2":  # asked for SDPA, it runs (and is estimated) eager, and says so
        assert any("eager" in w for w in ours.warnings)


MOE = [
    {"model_type": "mixtral", **TINY, "num_local_experts": 4, "num_experts_per_tok": 2},
    {"model_type": "qwen2_moe", **TINY, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 512,
     "num_experts": 4, "num_experts_per_tok": 2},
    {"model_type": "qwen3_moe", **TINY, "head_dim": 64, "moe_intermediate_size": 128, "num_experts": 4,
     "num_experts_per_tok": 2, "norm_topk_prob": True},
]


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_ATTENTION = dataclasses.replace(LORA, lora_targets=ATTENTION)
# Every recipe the experts run in: trained (full; the last layer's under freeze) or frozen under a trained
# attention (LoRA, QLoRA), with and without checkpointing, at sizes where the backward's peak holds the MoE's
# saved tensors. transformers 5.25 holds the experts as two fused 3-D tensors and runs them through grouped_mm (its
# default experts implementation, core/simulation/moe.py): the program wrote transformers 4's per-expert loop, a
# routed-tokens x hidden tensor a layer high with frozen experts, 3 % high with trained ones at 1 x 1024, 9 % low
# under checkpointing, and QLoRA's experts quantized where bitsandbytes leaves the fused tensors in 16 bits (33 % low
# here). Its memory does not depend on the routing (every grouped matmul covers all the routed tokens).
MOE_RECIPES = [
    ("lora-attention", LORA_ATTENTION),
    ("lora-attention-checkpointing", dataclasses.replace(LORA_ATTENTION, grad_ckpt=True)),
    ("qlora-attention", TrainingSetup(method="qlora", lora_targets=ATTENTION, seq_len=128)),
    ("qlora-attention-checkpointing", TrainingSetup(method="qlora", lora_targets=ATTENTION, seq_len=128,
                                                    grad_ckpt=True)),
    ("freeze-last-layer", TrainingSetup(method="freeze", trainable_layers=1, seq_len=1024)),
    ("full", TrainingSetup(seq_len=1024)),
    ("full-checkpointing", TrainingSetup(seq_len=1024, grad_ckpt=True)),
]


# in CI: each family once, frozen experts under LoRA and QLoRA, trained ones under checkpointing; the rest slow
MOE_FAST = {"mixtral-lora-attention", "qwen3_moe-qlora-attention", "qwen2_moe-full-checkpointing",
            "mixtral-freeze-last-layer"}


def _moe_case(name: str, setup: TrainingSetup, config: dict) -> object:
    case = f"{config['model_type']}-{name}"
    return pytest.param(config, setup, id=case, marks=() if case in MOE_FAST else (pytest.mark.slow,))


@pytest.mark.parametrize(("config", "setup"), [_moe_case(n, s, c) for n, s in MOE_RECIPES for c in MOE])
def test_a_mixture_of_experts_equals_transformers(config, setup):
    from vramlab.core.simulation.simulate import simulate

    spec = spec_from_hf_config(config, id="m", name="M")
    assert not traced.uses_trace(spec, setup)  # the hand-written program answers these
    ref = hf.measure_config(config, setup, reduce_depth=False)
    for ours in (estimate(spec, setup, match_simulation=True), simulate(spec, setup)):  # the program, the builder
        assert (ours.peak_allocated_bytes, ours.peak_phase) == (ref.peak_bytes, ref.peak_phase), ours.source
        assert ours.trainable_params == ref.trainable_params


@pytest.mark.parametrize("config", MOE, ids=[c["model_type"] for c in MOE])
def test_moe_with_mlp_lora_is_traced_as_its_own_family(config, monkeypatch: pytest.MonkeyPatch):
    spec = spec_from_hf_config(config, id="m", name="M")
    assert traced.uses_trace(spec, LORA)  # peft's fused-expert adapters: the trace answers
    assert not traced.uses_trace(spec, FULL)
    assert not traced.uses_trace(spec, dataclasses.replace(LORA, lora_targets=("q_proj", "v_proj")))
    # traced as its own model type (it was Mixtral's shape for every MoE spec): peft adapts each differently
    assert hfconfig.hf_config(spec, LORA.attention).model_type == config["model_type"]
    assert not any("mixture of experts" in w for w in LORA.warnings(dataclasses.replace(spec, tape="traced")))
    # the estimator-only build: the hand-written program, with the warning that says what it leaves out
    monkeypatch.setattr(traced, "installed", lambda: False)
    assert not traced.uses_trace(spec, LORA)
    result = estimate(spec, LORA)
    assert result.source == "hand-written"
    assert any("mixture of experts" in w and "vramlab[hf]" in w for w in result.warnings)


def test_a_type_transformers_ships_is_not_read_as_llama():
    # Granite multiplies its embeddings, each block's output and its logits by constants (full-size temporaries
    # a Llama-style reading lacks: 0.5 % low with LoRA and checkpointing); transformers ships it, so its own
    # class is traced
    config = {"model_type": "granite", **TINY, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
              "logits_scaling": 8.0, "attention_multiplier": 0.015625, "tie_word_embeddings": True}
    spec = spec_from_hf_config(config, id="m", name="M")
    assert spec.transformers_config and traced.uses_trace(spec)


def test_the_logits_before_gemma2s_softcap_are_freed() -> None:
    """transformers' Gemma2ForCausalLM rebinds ``logits`` at each step of its softcap (``/ cap``, ``tanh``, ``* cap``),
    so of the head's output only tanh's saved output is extra while the loss runs: the forward's peak is one
    16-bit logits tensor above the same model without a softcap. The HF path's head hook held the head's output to
    the end of the forward, and the builder and the program kept it to the end of the loss: two (15.4 MB more at
    2 x 96 tokens on a 40k vocabulary), on all three."""
    from tests.test_objectives import PAIR_FAMILIES
    from vramlab.core.simulation.simulate import simulate

    capped = dataclasses.replace(PAIR_FAMILIES["gemma2"], vocab_size=40_000)
    plain = dataclasses.replace(capped, final_logit_softcap=0.0)
    setup = TrainingSetup(method="lora", lora_targets=("q_proj", "v_proj"), seq_len=96, micro_batch=2)
    simulate(plain, setup, hf=True)  # the first class built in a process keeps a 1 KiB buffer more

    def forward(r) -> int:  # noqa: ANN001
        return {p.key: p.bytes for p in r.phases}["forward@2"]

    one = setup.micro_batch * setup.seq_len * capped.vocab_size * 2  # bf16 logits
    assert forward(simulate(capped, setup, hf=True)) - forward(simulate(plain, setup, hf=True)) == one
    est = [forward(estimate(s, setup, match_simulation=True)) for s in (capped, plain)]
    assert est[0] - est[1] == one


# A decoder layer's Python locals that live to its return, past the MLP: GPT-2's ``attn_output`` (GPT2Block binds
# the attention's output and adds it to the residual under another name), StableLM's sequential block's
# ``self_attn_output`` and its first norm's ``hidden_states``, a parallel block's two outputs (transformers 5.25's
# modeling_gpt2.py / modeling_stablelm.py), and StableLM's RoPE locals. A 64-token vocabulary puts the forward's
# peak inside the last layer, where they show (GPT-2 was one b x s x hidden tensor low there, StableLM two).
_SMALL_VOCAB = {"vocab_size": 64}
LOCALS = [
    ("gpt2-full", {**GPT2, **_SMALL_VOCAB}, TrainingSetup(seq_len=256)),
    ("stablelm-sequential-checkpointing", {**STABLELM, **_SMALL_VOCAB}, TrainingSetup(seq_len=256, grad_ckpt=True)),
    # a parallel block keeps both outputs beside their first sum (98 KiB low before); under checkpointing the
    # forward's peak is in the attention, where StableLM's RoPE keeps q's and k's rotated parts and the projections'
    # outputs (their pass-through views) to the return (288 KiB low before, with the first)
    ("stablelm-parallel-lora", {**STABLELM, "use_parallel_residual": True, "intermediate_size": 128, **_SMALL_VOCAB},
     TrainingSetup(method="lora", lora_targets=("q_proj", "v_proj"), seq_len=256)),
    ("stablelm-parallel-checkpointing", {**STABLELM, "use_parallel_residual": True, "intermediate_size": 128,
                                         **_SMALL_VOCAB}, TrainingSetup(seq_len=256, grad_ckpt=True)),
    # under autocast NewGELUActivation's pow takes an fp32 copy of its input inside the op, which a checkpointed
    # forward (nothing saved) frees as pow returns: the builder held it in a local through the chain (one
    # b x s x intermediate fp32 tensor high in each layer's forward; the program and the classes agreed)
    ("gpt2-full-autocast-checkpointing", GPT2, TrainingSetup(seq_len=256, amp=True, grad_ckpt=True)),
]


@pytest.mark.parametrize(("config", "setup"), [pytest.param(*c[1:], id=c[0]) for c in LOCALS])
def test_the_layers_locals_at_the_forwards_peak(config, setup) -> None:
    from transformers import AutoConfig

    from vramlab.core.simulation.simulate import simulate

    spec = spec_from_hf_config(config, id="m", name="M")
    assert not traced.uses_trace(spec, setup)
    ref = simulate(spec, setup, hf=True, hf_config=AutoConfig.for_model(**config))
    forward = {p.key: p.bytes for p in ref.phases if p.key.startswith("forward")}
    for ours in (estimate(spec, setup, match_simulation=True), simulate(spec, setup)):  # the program, the builder
        assert forward == {p.key: p.bytes for p in ours.phases if p.key.startswith("forward")}, ours.source


def test_gpt2s_c_attn_is_one_module_for_lora() -> None:
    """peft's default target on GPT-2 is its fused c_attn: q and v named adapt it whole, with the name peft needs
    said; c_attn itself is a target (it was refused: the q, k and v were read as three modules)."""
    spec = spec_from_hf_config(GPT2, id="m", name="M")
    setup = TrainingSetup(method="lora", seq_len=128)  # q_proj, v_proj
    assert spec.lora_modules(setup.lora_targets) == ("qkv_proj",)
    assert any("c_attn" in w for w in setup.warnings(spec))
    own = TrainingSetup(method="lora", lora_targets=GPT2_LINEARS, seq_len=128)
    own.validate(spec)
    assert set(spec.lora_modules(own.lora_targets)) == {"qkv_proj", "o_proj", "up_proj", "down_proj"}


DENSE = [t for t in TEXT_DEFAULTS if t not in ("mixtral", "qwen2_moe", "qwen3_moe")]


@pytest.mark.parametrize("model_type", DENSE)
def test_all_linear_is_what_peft_picks_on_the_model(model_type: str) -> None:
    """``all-linear`` on a hand-written family adapts the layers' modules that peft's own rule picks on
    transformers' class (peft 0.21.2 ``_maybe_include_all_linear_layers``: every Linear and Conv1D but the output
    head), and is accepted (GPT-2, phi and StarCoder2 were refused: "no gate_proj module")."""
    import torch
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers
    from transformers import AutoConfig, AutoModelForCausalLM

    from vramlab.core.tracing.hflora import _roles

    config = GPT2 if model_type == "gpt2" else {**TINY, "model_type": model_type, "head_dim": 64, "pad_token_id": 0}
    spec = spec_from_hf_config(config, id="m", name="M")
    setup = TrainingSetup(method="lora", lora_targets="all-linear")
    setup.validate(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    picked = _maybe_include_all_linear_layers(LoraConfig(target_modules="all-linear"), model).target_modules
    roles = {r for path in picked for r in _roles(path)}
    assert roles and set(spec.lora_modules(setup.lora_targets)) == roles, sorted(picked)


@pytest.mark.parametrize("config", MOE, ids=[c["model_type"] for c in MOE])
def test_a_quantized_moe_says_its_experts_stay_16_bit_as_transformers_holds_them(config):
    """transformers 5's experts are fused 3-D parameters, not nn.Linear layers bitsandbytes' quantization
    replaces: the weights note counts them apart, as many as transformers' class holds."""
    import torch
    import transformers

    spec = spec_from_hf_config(config, id="m", name="M")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    fused = sum(p.numel() for m in model.modules() if type(m).__name__.endswith("Experts")
                for p in m.parameters(recurse=False) if p.dim() == 3)
    assert fused and not any(isinstance(m, torch.nn.Linear) for m in model.modules()
                             if type(m).__name__.endswith("Experts"))
    qlora = dataclasses.replace(LORA_ATTENTION, method="qlora")
    note = next(n for n in estimate(spec, qlora).notes if n.startswith("weights:"))
    assert spec.fused_expert_params == fused
    assert f"the routed experts ({fused / 1e9:.2f}B) stay in bf16" in note
    assert note.startswith(f"weights: {(spec.param_count - fused) / 1e9:.2f}B parameters in nf4")
