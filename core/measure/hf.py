"""The real Hugging Face model class as the measured model (optional: ``pip install vramlab[hf]``).

``simulate(..., hf=True)`` / ``vramlab simulate --hf`` builds ``transformers``' own model class from the
spec (or from the user's ``config.json``) with random weights and, for LoRA, wraps it with ``peft``; the
same instrumented step then measures it. This checks our builder against the reference implementation
and measures architectures the builder does not know. Never ``trust_remote_code``: only model classes
shipped in ``transformers`` are used.

Under fake tensors two things are guarded: transformers' packed-sequence check reads ``position_ids``
values (fake tensors have none) and would otherwise switch to a 4-D mask and another attention path; and
dtypes are set at construction (``Module.to(dtype)`` fails on fake tensors). Quantized bases
(bitsandbytes needs a GPU), sharding and autocast are not available on this path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..kinds import Kind
from ..spec import Activation, Attention, DType, Method, ModelSpec, NormKind, SetupError, Sharding, TrainingSetup
from . import context

DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def available() -> bool:
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_config(spec: ModelSpec, attention: Attention):  # noqa: ANN201
    """A transformers config equivalent to ``spec`` (the family chosen by its distinguishing features)."""
    import transformers as tf

    act = {Activation.SILU: "silu", Activation.GELU: "gelu", Activation.GELU_TANH: "gelu_pytorch_tanh",
           Activation.RELU: "relu"}[spec.activation]
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
                  tie_word_embeddings=spec.tie_embeddings, hidden_act=act,
                  attn_implementation="eager" if attention is Attention.EAGER else "sdpa")
    if spec.fused_qkv or spec.fused_gate_up:
        if not (spec.fused_qkv and spec.fused_gate_up and spec.rope_pass_cat) or spec.qkv_bias or spec.mlp_bias:
            raise SetupError(f"{spec.name}: fused projections are modelled as Phi-3 has them (qkv_proj, gate_up_proj, "
                             "no biases)")
        rope = {"rope_type": "default", "rope_theta": 10000.0,
                "partial_rotary_factor": spec.rope_dim / spec.head_dim}
        return tf.Phi3Config(**common, head_dim=spec.head_dim, pad_token_id=None, bos_token_id=None,
                             eos_token_id=None, sliding_window=spec.sliding_window or None, rope_parameters=rope)
    if spec.is_moe and not spec.shared_expert_intermediate_size:
        return tf.MixtralConfig(**common, num_local_experts=spec.num_experts,
                                num_experts_per_tok=spec.experts_per_token, head_dim=spec.head_dim)
    if spec.qk_norm:
        return tf.Qwen3Config(**common, head_dim=spec.head_dim, attention_bias=spec.qkv_bias)
    if spec.norms_per_layer == 4:
        return tf.Gemma2Config(**common, head_dim=spec.head_dim,
                               final_logit_softcapping=spec.final_logit_softcap or None,
                               attn_logit_softcapping=spec.attn_logit_softcap or None)
    if spec.parallel_block or spec.norm_kind is NormKind.LAYERNORM or spec.learned_positions:
        raise SetupError(f"{spec.name}: the HF reference path covers Llama-style decoders (Llama, Mistral, Qwen2/3, "
                         "Gemma-2, Mixtral); use the built-in simulation for this architecture")
    if spec.sliding_window:
        if spec.qkv_bias or spec.o_bias or spec.mlp_bias:
            raise SetupError(f"{spec.name}: sliding-window attention is modelled as Mistral has it (no biases)")
        return tf.MistralConfig(**common, head_dim=spec.head_dim, sliding_window=spec.sliding_window)
    if spec.qkv_bias and not spec.o_bias:
        return tf.Qwen2Config(**common)
    return tf.LlamaConfig(**common, head_dim=spec.head_dim, attention_bias=spec.qkv_bias, mlp_bias=spec.mlp_bias)


def check(spec: ModelSpec, setup: TrainingSetup) -> None:
    if not available():
        raise SetupError("the HF reference path needs transformers and peft: pip install 'vramlab[hf]'")
    if setup.weight_dtype.is_quantized:
        raise SetupError("quantized bases need bitsandbytes on a GPU: use the built-in simulation for QLoRA")
    if setup.sharding is not Sharding.NONE:
        raise SetupError("sharding is simulated by the built-in model only")
    if setup.autocast:
        raise SetupError("autocast cannot run on fake tensors here: use pure precision on the HF path")
    if setup.chunked_loss or not setup.loss_fp32:
        raise SetupError("the HF path uses transformers' own loss")


@dataclass(frozen=True)
class _Plan:
    """What the step driver reads from a model (see measure.model.Plan)."""

    spec: ModelSpec
    setup: TrainingSetup
    device: torch.device
    real: bool
    sharder: None = None


class HFModel(nn.Module):
    """An HF causal LM (optionally peft-wrapped) with the builder's ``forward(ids, labels) -> loss``."""

    def __init__(self, inner: nn.Module, plan: _Plan) -> None:
        super().__init__()
        self.inner = inner
        self.plan = plan
        head = inner.get_output_embeddings()
        self._cm: list[contextlib.AbstractContextManager] = []
        head.register_forward_pre_hook(self._enter_logits)
        head.register_forward_hook(self._head_out)
        self._head_out_tensor: torch.Tensor | None = None

    def _enter_logits(self, _mod, _args) -> None:  # noqa: ANN001
        cm = context.region(Kind.LOGITS)
        cm.__enter__()
        self._cm.append(cm)

    def _head_out(self, _mod, _args, out) -> None:  # noqa: ANN001
        self._head_out_tensor = out

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        try:
            out = self.inner(input_ids=ids, labels=labels, use_cache=False)
            loss = out.loss
            if self._head_out_tensor is not None:
                context.label_backward(loss, self._head_out_tensor, Kind.LOGITS)
        finally:
            while self._cm:
                self._cm.pop().__exit__(None, None, None)
            self._head_out_tensor = None
        del out  # HF Trainer keeps only the loss
        return loss


@contextlib.contextmanager
def no_packed_sequence_check() -> Iterator[None]:
    """transformers reads position_ids values to detect packed sequences; fake tensors have no values."""
    try:
        import transformers.masking_utils as mu
    except ImportError:
        yield
        return
    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    mu.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


@contextlib.contextmanager
def _moves_that_change_nothing_are_skipped() -> Iterator[None]:
    """``Module.to()`` swaps every fake parameter even when the device and dtype already match, and the
    swap fails on fake tensors; peft calls it on freshly created adapters. Skip such no-op moves."""
    original = nn.Module._apply

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        tensors = [t for t in (*self.parameters(recurse=recurse), *self.buffers(recurse=recurse))]
        if tensors and all(_same(t, fn) for t in tensors):
            return self
        return original(self, fn, recurse)

    nn.Module._apply = _apply
    try:
        yield
    finally:
        nn.Module._apply = original


def _same(t: torch.Tensor, fn) -> bool:  # noqa: ANN001
    with torch.no_grad():
        try:
            return fn(t) is t
        except Exception:  # noqa: BLE001
            return False


def build_hf(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str = "cpu", real: bool = True,
             config=None) -> HFModel:  # noqa: ANN001
    check(spec, setup)
    with _moves_that_change_nothing_are_skipped():
        return _build_hf(spec, setup, device, real, config)


def _build_hf(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str, real: bool, config) -> HFModel:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    cfg = config if config is not None else hf_config(spec, setup.attention)
    if config is not None:
        cfg._attn_implementation = "eager" if setup.attention is Attention.EAGER else "sdpa"
    dtype = DTYPES[setup.weight_dtype]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    tracker = context.current()
    if tracker is not None and getattr(model.config, "tie_word_embeddings", False):
        # from_config allocates the output head and only then ties it to the embedding; from_pretrained
        # builds on the meta device and never holds both, so that transient is not part of a real load
        tracker.restart_phase_peak()
    model.config.use_cache = False
    if setup.method is Method.LORA:
        from peft import LoraConfig, get_peft_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        lcfg = LoraConfig(r=setup.lora_rank, lora_alpha=setup.alpha, lora_dropout=setup.lora_dropout,
                          target_modules=list(spec.lora_modules(setup.lora_targets)), bias="none",
                          task_type="CAUSAL_LM")
        # peft moves each new adapter with Module.to(), which cannot swap fake tensors: create the
        # adapters directly in their dtype on the device instead
        move = BaseTunerLayer._move_adapter_to_device_of_base_layer
        old_default = torch.get_default_dtype()
        BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
        torch.set_default_dtype(DTYPES[setup.adapter_dtype])
        try:
            with torch.device(device):
                model = get_peft_model(model, lcfg, autocast_adapter_dtype=setup.adapter_dtype is DType.FP32)
        finally:
            BaseTunerLayer._move_adapter_to_device_of_base_layer = move
            torch.set_default_dtype(old_default)
    elif setup.method is Method.FREEZE:
        n = spec.num_layers - int(setup.trainable_layers or spec.num_layers)
        for name, p in model.named_parameters():
            layer = _layer_index(name)
            p.requires_grad = layer is not None and layer >= n or "norm.weight" in name and layer is None \
                or "lm_head" in name
    if setup.grad_ckpt:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        if not model.get_input_embeddings().weight.requires_grad:
            base.enable_input_require_grads()
    return HFModel(model, _Plan(spec, setup, torch.device(device), real))


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None
