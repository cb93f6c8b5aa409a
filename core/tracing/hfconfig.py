"""From a spec or a ``config.json`` to transformers' own class, at reduced depth.

:func:`hf_config` writes a hand-written family's spec as its transformers config; :func:`task_of` picks the
class any config transformers ships is built as (a causal LM, the language model of a multimodal config, a
seq2seq LM trained with decoder labels, or a masked-LM encoder; anything else is refused with the reason).
:func:`plan_depth` cuts the layer stacks to the fewest layers that hold one layer of every kind the full model
has, and :func:`full_param_count` counts the full model exactly from them (checked against the model's own
count, built at full depth on the meta device). Never ``trust_remote_code``: only the config and model classes
shipped in ``transformers``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import QWEN2_MOE, QWEN3_MOE
from vramlab.core.spec.model import Activation, ModelSpec, NormKind
from vramlab.core.spec.options import Attention
from vramlab.core.tracing.hfquant import EmulatedQuantLinear


def available() -> bool:
    """Whether transformers imports and peft is installed. peft is not imported here: a step without LoRA never
    needs it, and one with LoRA imports it before the fake-tensor mode starts
    (:func:`vramlab.core.simulation.step.preload`), not inside it, where its import-time tensors would be
    recorded as the step's."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return importlib.util.find_spec("peft") is not None


def hf_config(spec: ModelSpec, attention: Attention):  # noqa: ANN201
    """A transformers config equivalent to ``spec`` (the family chosen by its distinguishing features)."""
    import transformers as tf

    act = {Activation.SILU: "silu", Activation.GELU: "gelu", Activation.GELU_TANH: "gelu_pytorch_tanh",
           Activation.GELU_NEW: "gelu_new",
           Activation.RELU: "relu"}[spec.activation]
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
                  tie_word_embeddings=spec.tie_embeddings, hidden_act=act,
                  attn_implementation="eager" if attention is Attention.EAGER else "sdpa")
    if (spec.fused_qkv or spec.fused_gate_up) and not spec.learned_positions:  # GPT-2 is refused below
        if not (spec.fused_qkv and spec.fused_gate_up and spec.rope_pass_cat) or spec.qkv_bias or spec.mlp_bias:
            raise SetupError(f"{spec.name}: fused projections are modelled as Phi-3 has them (qkv_proj, gate_up_proj, "
                             "no biases)")
        rope = {"rope_type": "default", "rope_theta": 10000.0,
                "partial_rotary_factor": spec.rope_dim / spec.head_dim}
        return tf.Phi3Config(**common, head_dim=spec.head_dim, pad_token_id=None, bos_token_id=None,
                             eos_token_id=None, sliding_window=spec.sliding_window or None, rope_parameters=rope)
    if spec.is_moe:  # the MoE family the spec's features say (each its own model_type, as peft treats it)
        moe = dict(num_experts_per_tok=spec.experts_per_token,
                   moe_intermediate_size=spec.moe_intermediate_size or spec.intermediate_size)
        if spec.moe_family == QWEN2_MOE:  # Qwen1.5-MoE / Qwen2-MoE: a gated shared expert
            return tf.Qwen2MoeConfig(**common, **moe, num_experts=spec.num_experts, qkv_bias=spec.qkv_bias,
                                     shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
        if spec.moe_family == QWEN3_MOE:  # Qwen3-MoE (its released models normalise the top-k weights)
            return tf.Qwen3MoeConfig(**common, **moe, num_experts=spec.num_experts, head_dim=spec.head_dim,
                                     attention_bias=spec.qkv_bias, norm_topk_prob=True)
        return tf.MixtralConfig(**common, num_local_experts=spec.num_experts,
                                num_experts_per_tok=spec.experts_per_token, head_dim=spec.head_dim)
    if spec.full_attention_every:  # Gemma 3's text model (its q/k norms are Gemma's, not Qwen 3's)
        gemma = {k: v for k, v in common.items() if k != "hidden_act"}
        return tf.Gemma3TextConfig(**gemma, hidden_activation=act, head_dim=spec.head_dim,
                                   query_pre_attn_scalar=spec.head_dim,
                                   sliding_window=spec.sliding_window or spec.max_position_embeddings,
                                   final_logit_softcapping=spec.final_logit_softcap or None,
                                   attn_logit_softcapping=spec.attn_logit_softcap or None)
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


# ---- any config transformers ships -------------------------------------------------------------------------

CAUSAL, SEQ2SEQ, MASKED = "causal", "seq2seq", "masked"


@dataclass(frozen=True)
class Task:
    """What is built from a config: the transformers class, the config it is built from, and notes for people."""

    kind: str  # CAUSAL | SEQ2SEQ | MASKED
    config: Any  # the transformers config the class is built from (a multimodal config's text config)
    model_class: type
    notes: tuple[str, ...] = ()

    @property
    def model_type(self) -> str:
        return str(self.config.model_type)


def transformers_config(config: Any) -> Any:
    """A transformers config object from a ``config.json`` dict or a config object, built only from the
    config classes transformers ships (``model_type`` looked up in ``CONFIG_MAPPING``; never remote code)."""
    from transformers import PretrainedConfig, __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(config, PretrainedConfig):
        model_type = getattr(config, "model_type", "")
        if model_type not in CONFIG_MAPPING or type(config) is not CONFIG_MAPPING[model_type]:
            raise SetupError(f"config class {type(config).__name__} is not one transformers {__version__} ships "
                             "(only remote code could build it)")
        return config
    if not isinstance(config, Mapping):
        raise SetupError(f"a transformers config must be a config.json mapping (got {type(config).__name__})")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise SetupError("config.json has no model_type: transformers cannot tell which model class it describes")
    if model_type not in CONFIG_MAPPING:
        raise SetupError(f"transformers {__version__} does not ship model type {model_type!r}: only its remote code "
                         "could build it, and VRAM Lab never runs a model's own code")
    data = {k: v for k, v in config.items() if k not in ("auto_map", "model_type")}
    try:
        return CONFIG_MAPPING[model_type].from_dict(data)
    except Exception as e:  # noqa: BLE001 - any failure to read the user's file is a refusal with its reason
        raise SetupError(f"transformers cannot read this {model_type} config: {_first_line(e)}") from e


def task_of(config: Any) -> Task:
    """Which of transformers' training heads a config is built with: a causal LM, the language model of a
    multimodal config, a seq2seq LM with its decoder labels, or a masked LM; anything else is refused."""
    from transformers.models.auto import modeling_auto as ma

    cfg = transformers_config(config)
    mt = cfg.model_type
    if getattr(cfg, "is_encoder_decoder", False):
        if mt in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
            return Task(SEQ2SEQ, cfg, ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING[type(cfg)],
                        (f"{mt} is an encoder-decoder: trained with decoder labels and its own loss",))
        raise SetupError(f"{mt} is an encoder-decoder without a seq2seq language-model head in transformers")
    if mt in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return Task(MASKED, cfg, ma.MODEL_FOR_MASKED_LM_MAPPING[type(cfg)],
                    (f"{mt} is an encoder: trained with its own masked-LM loss over every position",))
    text = _text_config(cfg)
    if text is not None:
        if text.model_type not in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise SetupError(f"{mt}'s language model ({text.model_type}) has no causal-LM class in transformers")
        return Task(CAUSAL, text, ma.MODEL_FOR_CAUSAL_LM_MAPPING[type(text)],
                    (f"the language model of {mt} ({text.model_type}); its vision / audio parts are not built",))
    if mt in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return Task(CAUSAL, cfg, ma.MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)])
    raise SetupError(f"transformers ships {mt} but no causal-LM, seq2seq-LM or masked-LM class for it "
                     "(not a language model VRAM Lab can train)")


def chunk_periods(config: Mapping[str, Any]) -> tuple[int, ...]:
    """The chunks along the sequence of a ``config.json``'s chunked kernels, read from transformers' own code:
    the torch paths of chunked linear attention (``torch_chunk_gated_delta_rule``, its ``chunk_size`` default)
    and of Mamba-2's state-space scan (the modeling module's ``reshape_into_chunks``; the chunk from the config,
    else its config class's default) pad the sequence to a multiple of their chunk, so their tensors grow a
    chunk at a time. Read from the mapping, not a config object, so that a value the config class would reject
    does not hide the chunk (the trace reports that itself)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name

    found: set[int] = set()
    text = config.get("text_config")
    for part in (config, text if isinstance(text, Mapping) else {}):
        model_type = part.get("model_type")
        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            continue
        name = model_type_to_module_name(model_type)
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        default = _arg_default(module, "torch_chunk_gated_delta_rule", "chunk_size")
        if isinstance(default, int) and default > 1:
            found.add(default)
        if hasattr(module, "reshape_into_chunks"):
            cls = CONFIG_MAPPING[model_type]
            values = [part.get(k) for k in ("mamba_chunk_size", "chunk_size")]
            values += [getattr(cls, k, None) for k in ("mamba_chunk_size", "chunk_size")]
            chunk = next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 1), None)
            if chunk is not None:
                found.add(chunk)
    return tuple(sorted(found))


def _arg_default(module: Any, function: str, arg: str) -> Any:
    """The default of ``function``'s argument ``arg`` as ``module``'s source writes it (None: no such function or
    default). Read from the source: transformers wraps such functions in a module that dispatches to a Hub kernel
    (``use_kernel_func_from_hub_with_fallback``), whose signature no longer shows the torch path's."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            args = node.args.args
            for a, d in zip(args[len(args) - len(node.args.defaults):], node.args.defaults):
                if a.arg == arg and isinstance(d, ast.Constant):
                    return d.value
    return None


def _text_config(cfg: Any) -> Any | None:
    """A multimodal config's language-model config (``text_config``), when it has one of its own type."""
    sub = getattr(cfg, "sub_configs", None) or {}
    if "text_config" not in sub:
        return None
    text = getattr(cfg, "text_config", None)
    if text is None or getattr(text, "model_type", cfg.model_type) == cfg.model_type:
        return None
    return text


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ---- reduced depth, exact parameter counts -------------------------------------------------------------------

# the names transformers configs give their layer counts (an attribute_map may alias them)
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers",
                    "decoder_layers", "encoder_layers", "num_encoder_layers")


def layer_counts(cfg: Any) -> dict[str, int]:
    """The config's own layer-count attributes (aliases resolved through its ``attribute_map``)."""
    amap = getattr(cfg, "attribute_map", {}) or {}
    out: dict[str, int] = {}
    for key in LAYER_COUNT_KEYS:
        real = amap.get(key, key)
        value = cfg.__dict__.get(real)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and real not in out:
            out[real] = value
    return out


def with_depth(cfg: Any, depth: int) -> Any:
    """A copy of ``cfg`` whose every layer stack has at most ``depth`` layers; per-layer lists (``layer_types``,
    ``no_rope_layers``, ...) are cut to the same length."""
    counts = layer_counts(cfg)
    data = cfg.to_dict()
    for key, n in counts.items():
        if depth < n:
            data[key] = depth
    lengths = set(counts.values())
    for key, value in list(data.items()):
        if isinstance(value, list) and len(value) in lengths and len(value) > depth:
            data[key] = value[:depth]
    data.pop("model_type", None)
    new = type(cfg).from_dict(data)
    new._attn_implementation = cfg._attn_implementation
    return new


def layer_stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's repeated layers: the outermost ModuleLists of one block class (``model.layers``,
    ``transformer.h``, ``encoder.block`` and ``decoder.block`` ...)."""
    out: list[tuple[str, nn.ModuleList]] = []
    inside: list[str] = []
    for name, mod in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and len({type(m) for m in mod}) == 1 \
                and _count(mod[0]) > 0:
            out.append((name, mod))
            inside.append(name)
    return out


def wrapped_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP makes units of in the user's run: accelerate 1.x's transformer auto-wrap policy (Trainer's
    default with FSDP) wraps every module whose class the model names in ``_no_split_modules`` (transformers 5
    gathers its children's there: a VLM's decoder layers and vision blocks), innermost first. Falls back to the
    repeated layers (:func:`layer_stacks`) when the model names none it holds."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    return found or [layer for _name, stack in layer_stacks(model) for layer in stack]


def _shapes(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter's name and shape, in ``named_parameters`` order, with an emulated quantized weight
    listed as the weight it stores (so a quantized model counts and compares like the 16-bit one)."""
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[int] = set()
    for prefix, mod in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(mod, EmulatedQuantLinear):
            out.append((f"{dot}weight", mod.weight_shape))
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((f"{dot}{name}", tuple(p.shape)))
    return out


def _count(module: nn.Module) -> int:
    total = 0
    for _name, shape in _shapes(module):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def _layer_signature(layer: nn.Module, layer_type: str | None) -> tuple:
    return (type(layer).__name__, layer_type, tuple(_shapes(layer)))


def _signatures(model: nn.Module, cfg: Any) -> dict[str, list[tuple]]:
    types = getattr(cfg, "layer_types", None)
    out = {}
    for name, stack in layer_stacks(model):
        lt = types if isinstance(types, list) and len(types) == len(stack) else None
        out[name] = [_layer_signature(layer, lt[i] if lt else None) for i, layer in enumerate(stack)]
    return out


@dataclass(frozen=True)
class Depth:
    """A config cut to fewer layers, with what the full-depth model is made of.

    ``full_layers``: per layer stack, the signature (class, layer type, parameter shapes) of every layer of
    the full model; ``own_params``: the full model's own parameter count, from a build on the meta device
    (which allocates nothing)."""

    config: Any  # the reduced config (the full one when nothing repeats)
    depth: int  # layers per stack in the reduced model
    full_counts: dict[str, int]
    full_layers: dict[str, list[tuple]]
    own_params: int
    notes: tuple[str, ...] = ()  # the task's notes (the language model of a multimodal config, ...)

    @property
    def reduced(self) -> bool:
        return any(self.depth < n for n in self.full_counts.values())


def plan_depth(task: Task, dtype: torch.dtype = torch.bfloat16, min_depth: int = 2) -> Depth:
    """The smallest depth whose first layers hold one layer of every kind the full model has (dense and
    MoE layers, sliding and full attention, ...), at least ``min_depth``. Builds the full model on the meta
    device (no memory) for its own parameter count and its layer kinds; call outside any dispatch mode."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.device("meta"):
        full = task.model_class._from_config(task.config, dtype=dtype)
    own = sum(p.numel() for p in full.parameters())
    layers = _signatures(full, task.config)
    del full
    counts = layer_counts(task.config)
    if not layers or not counts:
        return Depth(task.config, max(counts.values(), default=0), counts, layers, own, task.notes)
    depth = min_depth
    for sigs in layers.values():
        kinds = set(sigs)
        seen: set[tuple] = set()
        for i, sig in enumerate(sigs):
            seen.add(sig)
            if seen == kinds:
                depth = max(depth, i + 1)
                break
    depth = min(depth, max(counts.values()))
    cfg = with_depth(task.config, depth) if depth < max(counts.values()) else task.config
    return Depth(cfg, depth, counts, layers, own, task.notes)


def full_param_count(model: nn.Module, depth: Depth) -> int:
    """The full model's parameter count from the reduced one: each layer kind's count x its layers in the
    full model, plus everything outside the layer stacks; refused unless it equals the model's own count."""
    reduced = _signatures(model, depth.config)
    stacks = dict(layer_stacks(model))
    total = _count(model)
    per_kind: dict[tuple, int] = {}
    for name, sigs in reduced.items():
        full = depth.full_layers.get(name)
        if full is None or sigs != full[: len(sigs)]:
            raise SetupError(f"{depth.config.model_type}: the first {len(sigs)} layers of {name} differ from the full "
                             "model's, so its depth cannot be reduced")
        for layer, sig in zip(stacks[name], sigs):
            n = _count(layer)
            total -= n
            per_kind[sig] = n
    for name, full in depth.full_layers.items():
        missing = [sig for sig in full if sig not in per_kind]
        if missing:
            raise SetupError(f"{depth.config.model_type}: a kind of layer of {name} is missing at depth {depth.depth}")
        total += sum(per_kind[sig] for sig in full)
    if total != depth.own_params:
        raise SetupError(f"{depth.config.model_type}: {total:,} parameters counted per layer, but the model has "
                         f"{depth.own_params:,}: not counted exactly")
    return total


def default_device(device: torch.device | str) -> contextlib.AbstractContextManager:
    """``with torch.device(device)``, or nothing where ``device`` is the default device already (the CPU of a
    trace or a simulation): the context is a torch-function mode that sees every call of the build, a tenth of a
    build's time under fake tensors, to add the device that tensors get anyway."""
    d = torch.device(device)
    return contextlib.nullcontext() if d == torch.get_default_device() else d
