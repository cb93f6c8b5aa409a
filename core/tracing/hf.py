"""The real Hugging Face model class as the measured model (optional: ``pip install vramlab[hf]``).

``simulate(..., hf=True)`` / ``vramlab simulate --hf`` builds ``transformers``' own model class from the
spec (or from the user's ``config.json``) with random weights and, for LoRA, wraps it with ``peft``; the
same instrumented step then measures it. This checks our builder against the reference implementation
and measures architectures the builder does not know. Never ``trust_remote_code``: only config and model
classes shipped in ``transformers`` are used.

Any model type the installed transformers ships is built from its config (:func:`task_of`): a causal LM,
the language model of a multimodal config, a seq2seq LM trained with decoder labels, or a masked-LM
encoder, each with its own loss; anything else is refused with the reason. :func:`plan_depth` cuts the
layer stacks to the fewest layers that hold one layer of every kind the full model has, and
:func:`full_param_count` counts the full model exactly from them (checked against the model's own count,
built at full depth on the meta device). LoRA goes on the model's own module names (``all-linear`` as
peft resolves it); freezing trains the last layers of the model's own stack, whatever it is called.

Under fake tensors two things are guarded: transformers' packed-sequence check reads ``position_ids``
values (fake tensors have none) and would otherwise switch to a 4-D mask and another attention path; and
dtypes are set at construction (``Module.to(dtype)`` fails on fake tensors). The options that are not the
model's own apply to it as transformations: a loss kernel (:mod:`.loss`) and sharding (:mod:`.shard`'s
``shard_module``, ZeRO-3 / FSDP applied to the built model as ``fully_shard`` applies it).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramlab.core.checks import SetupError
from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.simulation.loss import apply as loss_kernel
from vramlab.core.simulation.loss import replaces_loss
from vramlab.core.simulation.shard import Sharder, shard_module
from vramlab.core.spec import (
    ALL_TARGETS,
    Activation,
    Attention,
    DType,
    Method,
    ModelSpec,
    NormKind,
    TrainingSetup,
    parse_targets,
)

DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def available() -> bool:
    """Whether transformers imports and peft is installed. peft is not imported here: a step without LoRA never
    needs it, and one with LoRA imports it before the fake-tensor mode starts (:func:`.trace._preload`), not
    inside it, where its import-time tensors would be recorded as the step's."""
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
    if spec.fused_qkv or spec.fused_gate_up:
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
        if spec.shared_expert_intermediate_size:  # Qwen1.5-MoE / Qwen2-MoE: a gated shared expert
            return tf.Qwen2MoeConfig(**common, **moe, num_experts=spec.num_experts, qkv_bias=spec.qkv_bias,
                                     shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
        if spec.qk_norm:  # Qwen3-MoE (its released models normalise the top-k weights)
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


def check(spec: ModelSpec | None, setup: TrainingSetup) -> None:
    if not available():
        raise SetupError("the HF reference path needs transformers and peft: pip install 'vramlab[hf]'")
    from vramlab.core.tracing.requirements import recipe_refusal

    reason = recipe_refusal(setup)
    if reason is not None:
        raise SetupError(reason)


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


@dataclass(frozen=True)
class _Shape:
    """What the step driver reads from a spec when the model comes from a config alone."""

    vocab_size: int
    num_layers: int


@dataclass(frozen=True)
class _Plan:
    """What the step driver reads from a model (see measure.model.Plan)."""

    spec: Any  # a ModelSpec, or a _Shape for a model built from its config alone
    setup: TrainingSetup
    device: torch.device
    real: bool
    sharder: Any = None  # rank 0 of a sharded run (core/simulation/shard.py), or None


class HFModel(nn.Module):
    """An HF language model (optionally peft-wrapped) with the builder's ``forward(ids, labels) -> loss``.

    ``notes``: what the build chose for the user to know (eager attention where the class has no SDPA path,
    the language model of a multimodal config); ``full_params``: the full-depth model's parameter count when
    the model was built at reduced depth (else None)."""

    def __init__(self, inner: nn.Module, plan: _Plan, task: str = CAUSAL, notes: tuple[str, ...] = (),
                 full_params: int | None = None, depth: int | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.plan = plan
        self.task = task
        self.notes = notes
        self.full_params = full_params
        self.depth = depth
        head = inner.get_output_embeddings()
        # another loss than transformers' own (core/simulation/loss.py): the kernel labels its own regions
        self._kernel = task == CAUSAL and replaces_loss(plan.setup)
        if replaces_loss(plan.setup) and task != CAUSAL:
            raise SetupError(f"a {task} model trains with its own loss: a chunked or 16-bit loss kernel patches a "
                             "causal LM's head (as Liger, Cut Cross Entropy and LitGPT do)")
        self._cm: list[contextlib.AbstractContextManager] = []
        head.register_forward_pre_hook(self._enter_logits)
        head.register_forward_hook(self._head_out)
        self._head_out_tensor: torch.Tensor | None = None

    def _enter_logits(self, _mod, _args) -> None:  # noqa: ANN001
        if self._kernel:
            return
        cm = context.region(Kind.LOGITS)
        cm.__enter__()
        self._cm.append(cm)

    def _head_out(self, _mod, _args, out) -> None:  # noqa: ANN001
        if not self._kernel:
            self._head_out_tensor = out

    def _run(self, ids: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> Any:
        """The model's forward with labels, or its base model and the setup's loss kernel (:mod:`.loss`)."""
        if not self._kernel:
            return self.inner(input_ids=ids, labels=labels, **kwargs)
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(loss=loss_kernel(self.inner, self.plan.setup, ids, labels, **kwargs))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        kwargs = {} if self.task == MASKED else {"use_cache": False}
        amp = _AUTOCAST[-1] if self.plan.setup.autocast and _AUTOCAST else None
        try:
            if amp is None:
                out = self._run(ids, labels, kwargs)
            else:
                # HF Trainer's bf16 / fp16: accelerate wraps the forward in autocast and then converts the
                # outputs to fp32 (accelerate ``prepare_model``: ``convert_outputs_to_fp32``): 16-bit logits
                # get an fp32 copy, alive until the Trainer drops the outputs and keeps the loss
                with amp.region():
                    out = self._run(ids, labels, kwargs)
                out = _outputs_to_fp32(out)
            loss = out.loss
            if self._head_out_tensor is not None:
                context.label_backward(loss, self._head_out_tensor, Kind.LOGITS)
        finally:
            while self._cm:
                self._cm.pop().__exit__(None, None, None)
            self._head_out_tensor = None
        del out  # HF Trainer keeps only the loss
        return loss


_AUTOCAST: list = []  # the CUDA autocast emulation of the run in progress (see guard)


def _outputs_to_fp32(out: Any) -> Any:
    """accelerate's ``convert_to_fp32`` on a model output: every fp16 / bf16 tensor in it as an fp32 copy."""
    for key, value in list(out.items()):
        if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
            out[key] = value.float()
    return out


@contextlib.contextmanager
def guard(setup: TrainingSetup) -> Iterator[None]:
    """What the HF path needs around a fake-tensor run: no packed-sequence check, dropout as CUDA dispatches it
    (:mod:`.cuda_dropout`), and CUDA autocast emulated (:mod:`.autocast_cuda`) when the setup trains under
    autocast."""
    from vramlab.core.simulation import (
        autocast_cuda,  # autocast's op lists hold the functions as torch defines them
        cuda_dropout,  # autocast's op lists hold the functions as torch defines them
    )

    with contextlib.ExitStack() as stack:
        stack.enter_context(no_packed_sequence_check())
        stack.enter_context(cuda_dropout.emulating())
        sharder = Sharder.for_setup(setup)
        if setup.autocast and not (sharder is not None and sharder.mixed):  # FSDP mixed precision: no autocast
            mode = autocast_cuda.CudaAutocast(DTYPES[setup.compute])
            _AUTOCAST.append(stack.enter_context(autocast_cuda.emulating(mode)))
            stack.callback(_AUTOCAST.pop)
        yield


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


def build_hf(spec: ModelSpec | None, setup: TrainingSetup, device: torch.device | str = "cpu", real: bool = True,
             config=None, depth: Depth | None = None) -> HFModel:  # noqa: ANN001
    """transformers' own class for ``spec`` (or for ``config``, any model type transformers ships), with the
    recipe applied as users apply it. ``depth`` (from :func:`plan_depth`, computed outside any dispatch
    mode): build the reduced config and count the full model's parameters exactly."""
    check(spec, setup)
    with _moves_that_change_nothing_are_skipped():
        return _build_hf(spec, setup, device, real, config, depth)


def _default_device(device: torch.device | str) -> contextlib.AbstractContextManager:
    """``with torch.device(device)``, or nothing where ``device`` is the default device already (the CPU of a
    trace or a simulation): the context is a torch-function mode that sees every call of the build, a tenth of a
    build's time under fake tensors, to add the device that tensors get anyway."""
    d = torch.device(device)
    return contextlib.nullcontext() if d == torch.get_default_device() else d


def _attention(task: Task, setup: TrainingSetup) -> tuple[str, tuple[str, ...]]:
    want = "eager" if setup.attention is Attention.EAGER else "sdpa"
    if want == "sdpa" and not getattr(task.model_class, "_supports_sdpa", False):
        return "eager", (f"{task.model_class.__name__} has no SDPA path in transformers: eager attention "
                         "(materialised scores) is what it runs",)
    return want, ()



def enable_checkpointing(model: Any, reentrant: bool = False) -> None:
    """Activation checkpointing as transformers' Trainer turns it on: ``activation_checkpointing_enable`` where the
    model has it (transformers 5.x; ``gradient_checkpointing_enable`` is its deprecated alias, which warns), in the
    setup's mode (transformers 5's default is non-reentrant)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

def _build_hf(spec: ModelSpec | None, setup: TrainingSetup, device: torch.device | str, real: bool, config,  # noqa: ANN001
              depth: Depth | None) -> HFModel:
    if config is None and spec is None and depth is None:
        raise SetupError("the HF path needs a model spec or a transformers config")
    if depth is not None:
        task = task_of(depth.config)
        task = Task(task.kind, task.config, task.model_class, (*depth.notes, *task.notes))
    else:
        task = task_of(config if config is not None else hf_config(spec, setup.attention))
    attn, notes = _attention(task, setup)
    notes = (*task.notes, *notes)
    sharder = Sharder.for_setup(setup)
    cfg = task.config
    cfg._attn_implementation = attn
    if setup.weight_dtype.is_quantized:
        if real:
            raise SetupError("quantized bases are emulated under fake tensors only on the HF path (bitsandbytes "
                             "needs a GPU): use the built-in model to run one")
        model = _load_quantized(task, cfg, setup, device)
        notes = (*notes, f"{setup.weight_dtype.value} storage emulated as bitsandbytes lays it out "
                         "(bitsandbytes needs a GPU)", *_not_quantized_note(model, setup))
    else:
        # FSDP mixed precision: the parameters compute in the dtype they are gathered in (shards kept in fp32)
        dtype = DTYPES[setup.compute] if sharder is not None and sharder.mixed else DTYPES[setup.weight_dtype]
        with _default_device(device):
            model = task.model_class._from_config(cfg, dtype=dtype)
    if setup.autocast and not real:
        notes = (*notes, f"CUDA autocast ({setup.compute.value}) emulated: its op lists and weight cache, as on "
                         "the GPU (fake tensors on the CPU cannot run it)")
    tracker = context.current()
    if tracker is not None and getattr(model.config, "tie_word_embeddings", False):
        # from_config allocates the output head and only then ties it to the embedding; from_pretrained
        # builds on the meta device and never holds both, so that transient is not part of a real load
        tracker.restart_phase_peak()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    _check_positions(model, setup.seq_len)
    full_params = full_param_count(model, depth) if depth is not None and depth.reduced else None
    layers = depth.depth if depth is not None else None
    if setup.grad_ckpt and not model.supports_gradient_checkpointing:
        raise SetupError(f"{type(model).__name__} does not support gradient checkpointing in transformers")
    if setup.uses_lora:
        model = _with_lora(model, setup, task, device)
        dropless = param_wrapped(model) if setup.lora_dropout else []
        notes = (*notes, NO_DROPOUT_NOTE.format(", ".join(dropless))) if dropless else notes
    elif setup.method is Method.FREEZE:
        _freeze_all_but_last(model, int(setup.trainable_layers or 0), setup.freeze_extra)
    if setup.grad_ckpt:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        enable_checkpointing(base, reentrant=setup.ckpt_reentrant)
        if not model.get_input_embeddings().weight.requires_grad:
            base.enable_input_require_grads()
    shape = spec if spec is not None else _Shape(int(cfg.vocab_size), max(layer_counts(cfg).values(), default=0))
    out = HFModel(model, _Plan(shape, setup, torch.device(device), real, sharder), task.kind, notes, full_params,
                  layers)
    if sharder is not None and sharder.params_sharded:  # ZeRO-3 / FSDP: the decoder layers are the units
        shard_module(model, sharder, [layer for _name, stack in layer_stacks(model) for layer in stack], out)
    return out


def _check_positions(model: nn.Module, seq_len: int) -> None:
    """A model with a learned position table (GPT-2's ``wpe``, BERT's, OPT's and BART's ``embed_positions``)
    has no position beyond it: a longer sequence is refused here instead of failing inside the step."""
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(mod, nn.Embedding) or not ("pos" in leaf or leaf == "wpe"):
            continue
        usable = mod.num_embeddings - int(getattr(mod, "offset", 0) or 0)
        if mod.padding_idx is not None:  # RoBERTa numbers positions from padding_idx + 1
            usable -= mod.padding_idx + 1
        if seq_len > usable:
            raise SetupError(f"{type(model).__name__} has learned positions for {usable} tokens ({name}): a sequence "
                             f"of {seq_len} does not fit; use --seq-len {usable} or less")


# ---- LoRA on the model's own module names ----------------------------------------------------------------

ALL_LINEAR = parse_targets("all-linear")
_ATTN_PARTS = ("attn", "attention")
_MLP_PARTS = ("mlp", "ffn", "feed_forward", "intermediate", "dense_relu_dense", "densereludense")


class NoTargetModule(SetupError):
    """The model built has no module for a LoRA target (a model cut to fewer layers may lack one the whole
    model has: the trace then runs it whole, core/tracing/trace.py)."""


def linear_modules(model: nn.Module) -> list[str]:
    """Paths of the model's linear layers inside its layer stacks (nn.Linear and GPT-2's Conv1D), in order."""
    return [f"{stack_name}.{name}" for stack_name, stack in layer_stacks(model)
            for name, mod in stack.named_modules() if _is_linear(mod)]


def _is_linear(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))


def _roles(path: str) -> tuple[str, ...]:
    """The canonical roles (q_proj, o_proj, up_proj, ...) of a module by its own leaf name."""
    leaf = path.rsplit(".", 1)[-1]
    try:
        roles = parse_targets((leaf,))
    except SetupError:
        return ()
    if len(roles) > 1:  # GPT-2's c_proj: the attention output or the MLP's down projection, by where it is
        low = path.lower()
        if any(p in low for p in _ATTN_PARTS):
            return tuple(r for r in roles if r == "o_proj")
        if any(p in low for p in _MLP_PARTS):
            return tuple(r for r in roles if r != "o_proj")
    return roles


def lora_target_modules(model: nn.Module, targets: tuple[str, ...]) -> str | list[str]:
    """peft's ``target_modules`` for ``targets``: ``all-linear`` as peft resolves it (every linear layer but
    the output head, fused projections included); otherwise the model's own modules of each named role
    (q/k/v name GPT-NeoX's, Falcon's and BLOOM's ``query_key_value`` and GPT-2's ``c_attn`` where the model
    fuses them, as ``all-linear`` and peft's defaults do). A name the model has no module for is refused."""
    if tuple(t for t in targets if t != "lm_head") == ALL_LINEAR:
        if "lm_head" not in targets:
            return "all-linear"
        return [n for n, m in model.named_modules() if _is_linear(m)]  # every linear layer, the head too
    linears = linear_modules(model)
    by_role: dict[str, list[str]] = {}
    for path in linears:
        for role in _roles(path):
            by_role.setdefault(role, []).append(path)
    chosen: list[str] = []
    missing: list[str] = []
    for t in targets:
        if t == "lm_head":
            head = _module_path(model, model.get_output_embeddings())
            if head:
                chosen.append(head)
            continue
        paths = by_role.get(t) or _named(model, t)
        if paths is None and t in ("q_proj", "k_proj", "v_proj"):
            paths = by_role.get("qkv_proj")
        if paths is None and t in ("gate_proj", "up_proj"):
            paths = by_role.get("gate_up_proj")
        if paths is None:
            missing.append(t)
            continue
        chosen.extend(p for p in paths if p not in chosen)
    if missing:
        leaves = sorted({p.rsplit(".", 1)[-1] for p in linears})
        raise NoTargetModule(f"{type(model).__name__} has no module for LoRA target {', '.join(missing)}: its "
                             f"linear layers are {', '.join(leaves)} (or all-linear)")
    return chosen


def _named(model: nn.Module, target: str) -> list[str] | None:
    """A name that is no role VRAM Lab knows (DeepSeek-V2's ``kv_a_proj_with_mqa``) matched as peft matches a
    target module name: every linear module whose path is it or ends in ``.`` + it (None: none)."""
    if target in ALL_TARGETS:
        return None
    found = [n for n, m in model.named_modules() if (n == target or n.endswith("." + target)) and _is_linear(m)]
    return found or None


def _module_path(model: nn.Module, module: nn.Module | None) -> str:
    for name, mod in model.named_modules():
        if mod is module:
            return name
    return ""


def _with_lora(model: nn.Module, setup: TrainingSetup, task: Task, device: torch.device | str) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    targets = lora_target_modules(model, setup.lora_targets)
    if targets == "all-linear":
        _refuse_wrapped_subclasses(model)
    task_type = {CAUSAL: "CAUSAL_LM", SEQ2SEQ: "SEQ_2_SEQ_LM"}.get(task.kind)
    lcfg = LoraConfig(r=setup.lora_rank, lora_alpha=setup.alpha, lora_dropout=setup.lora_dropout,
                      target_modules=targets, bias="none", task_type=task_type, use_dora=setup.use_dora,
                      use_rslora=setup.use_rslora)
    if any(isinstance(m, EmulatedQuantLinear) for m in model.modules()):
        lcfg._register_custom_module({EmulatedQuantLinear: _lora_layer_for_emulated_quant()})
    # peft moves each new adapter with Module.to(), which cannot swap fake tensors: create the adapters
    # directly in their dtype on the device instead (every tuner layer class that defines its own move,
    # e.g. the ParamWrapper that all-linear puts on MoE expert tensors)
    from peft.tuners.lora import layer as lora_layer

    movers = [BaseTunerLayer, *(c for c in vars(lora_layer).values()
                                if isinstance(c, type) and "_move_adapter_to_device_of_base_layer" in vars(c))]
    saved = [(c, vars(c)["_move_adapter_to_device_of_base_layer"]) for c in dict.fromkeys(movers)]
    old_default = torch.get_default_dtype()
    for c, _ in saved:
        c._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
    torch.set_default_dtype(DTYPES[setup.adapter_dtype])
    try:
        with _default_device(device), _param_wrappers_without_dropout():
            model = get_peft_model(model, lcfg, autocast_adapter_dtype=setup.adapter_dtype is DType.FP32)
        if setup.lora_fa:  # peft's create_lorafa_optimizer freezes every lora_A
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.requires_grad_(False)
        return model
    finally:
        for c, f in saved:
            c._move_adapter_to_device_of_base_layer = f
        torch.set_default_dtype(old_default)


NO_DROPOUT_NOTE = "without LoRA dropout on {}: peft's ParamWrapper (LoRA on a parameter) refuses it"


def param_wrapped(model: nn.Module) -> list[str]:
    """The parameters peft adapts with a ParamWrapper, as ``module.parameter`` by the module's own name."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return []
    out: dict[str, None] = {}
    for name, m in model.named_modules():
        if isinstance(m, ParamWrapper):
            path = name
            while path.endswith(".base_layer"):  # a wrapper nested in another (two parameters of one module)
                path = path.removesuffix(".base_layer")
            out[f"{path.rsplit('.', 1)[-1]}.{m.parameter_name}"] = None
    return list(out)


@contextlib.contextmanager
def _param_wrappers_without_dropout() -> Iterator[None]:
    """peft's ParamWrapper (LoRA on a parameter: MoE experts' fused tensors, Trinity's) refuses ``lora_dropout``
    (``x`` cannot be factored out of ``lora_B(lora_A(dropout(x)))``): those adapters are made without it, the
    others keep it, and the note says so (:data:`NO_DROPOUT_NOTE`) instead of the step failing."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        yield
        return
    init = ParamWrapper.__init__

    def without(self, base_layer, adapter_name, parameter_name, config, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if config.lora_dropout:
            config = copy.copy(config)
            config.lora_dropout = 0.0
        init(self, base_layer, adapter_name, parameter_name, config, *args, **kwargs)

    ParamWrapper.__init__ = without
    try:
        yield
    finally:
        ParamWrapper.__init__ = init


def _refuse_wrapped_subclasses(model: nn.Module) -> None:
    """peft's all-linear wraps every nn.Linear subclass, and its LoRA layer treats the base layer's output as
    one tensor: a subclass whose forward returns something else (Llama 4's and PhiMoE's routers return a
    tuple) fails in the first step. Each such class is called once on one token (not counted) and refused
    here, with its name, instead of failing mid-step."""
    head = model.get_output_embeddings()
    probed: dict[type, nn.Module] = {}
    for m in model.modules():
        if isinstance(m, nn.Linear) and m is not head and not isinstance(m, EmulatedQuantLinear) \
                and type(m).forward is not nn.Linear.forward:
            probed.setdefault(type(m), m)
    bad = []
    for cls, m in probed.items():
        w = m.weight
        with torch.no_grad(), context.host():
            out = m(torch.zeros(1, 1, m.in_features, dtype=w.dtype, device=w.device))
        if not isinstance(out, torch.Tensor):
            bad.append(cls.__name__)
    if bad:
        raise SetupError(f"peft's all-linear would wrap {', '.join(sorted(bad))} (a Linear whose forward returns "
                         f"{type(out).__name__}, which peft's LoRA layer cannot wrap): name the target modules instead")


def _freeze_all_but_last(model: nn.Module, n: int, extra: tuple[str, ...] = ()) -> None:
    """Train the last ``n`` of the model's repeated layers (whatever they are called) and nothing else, as a
    plain ``requires_grad`` freeze and LLaMA-Factory's freeze step (``freeze_trainable_layers``) do; ``extra``
    (``FREEZE_EXTRAS``) also trains the input embedding, the modules after the layers (the final norm) or
    the output head, as LLaMA-Factory's ``freeze_extra_modules`` names them (a head tied to the embedding
    trains with it)."""
    stacks = layer_stacks(model)
    if not stacks:
        raise SetupError(f"{type(model).__name__} has no repeated layers to freeze")
    name, stack = stacks[-1]
    if n > len(stack):
        raise SetupError(f"{type(model).__name__} has {len(stack)} layers in {name}: cannot train the last {n}")
    trainable = {id(p) for layer in list(stack)[len(stack) - n:] for p in layer.parameters()}
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    head_params = {id(p) for p in head.parameters()} if head is not None else set()
    embed_params = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    if "norm" in extra:
        after = False
        stack_params = {id(p) for p in stack.parameters()}
        for _pname, p in model.named_parameters():
            if id(p) in stack_params:
                after = True
            elif after and id(p) not in head_params:
                trainable.add(id(p))
    if "embed_tokens" in extra:
        trainable |= embed_params
    if "lm_head" in extra:
        trainable |= head_params - embed_params  # a tied head trains only with the embedding
    for p in model.parameters():
        p.requires_grad = id(p) in trainable


# ---- NF4 / int8 storage, emulated as bitsandbytes lays it out --------------------------------------------------
#
# bitsandbytes' kernels need a GPU, so a quantized base is emulated here with the storage and temporaries the
# built-in builder models (core/simulation/quant.py, after bitsandbytes 0.50.2): transformers' loader
# (integrations/bitsandbytes.py ``replace_with_bnb_linear``, transformers 5.24) swaps every nn.Linear and
# GPT-2 Conv1D except the modules ``get_keys_to_not_convert`` and ``_keep_in_fp32_modules`` name (the output
# head, tied weights) for a Linear4bit / Linear8bitLt, and loads each weight in 16-bit before quantizing it.

class EmulatedQuantLinear(nn.Linear):
    """Stands in for bitsandbytes' ``Linear4bit`` / ``Linear8bitLt`` (both nn.Linear subclasses, so peft's
    all-linear picks them up): packed storage (:class:`~.quant.QuantWeight`), and ``Linear4bit.forward``'s
    casts: the input and bias to the compute dtype, the weight dequantized for the matmul (a temporary, again
    in backward), the output back to the input dtype."""

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None, kind: str,
                 double_quant: bool, device: torch.device | str, compute_dtype: torch.dtype) -> None:
        from vramlab.core.simulation.quant import QuantWeight

        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.weight_shape = (out_features, in_features)  # as the replaced module held it (Conv1D: transposed)
        self.bias = bias
        self.kind = kind
        self.compute_dtype = compute_dtype
        self.quant = QuantWeight(out_features, in_features, kind, double_quant, torch.device(device),
                                 compute_dtype=compute_dtype)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The stored codes, as bitsandbytes' ``Params4bit`` / ``Int8Params`` weight is (peft reads its device)."""
        return self.quant.packed if self.kind == "nf4" else self.quant.qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from vramlab.core.simulation.quant import QuantLinearFn

        cd = self.compute_dtype
        xc = x.to(cd) if x.dtype != cd else x
        bias = self.bias.to(cd) if self.bias is not None and self.bias.dtype != cd else self.bias
        out = QuantLinearFn.apply(xc, bias, self.quant)
        return out.to(x.dtype) if out.dtype != x.dtype else out


def _modules_not_quantized(model: nn.Module) -> set[str]:
    """What transformers' bitsandbytes quantizer leaves in 16-bit (``get_modules_to_not_convert`` with no
    ``llm_int8_skip_modules``: the output head, tied weights, the last module, ``_keep_in_fp32_modules``)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    keep = set(get_keys_to_not_convert(model)) | set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return keep


def _skipped(name: str, keep: set[str]) -> bool:
    # transformers' should_convert_module: a key matches the module itself or any module below it
    return any(name == k or name.endswith("." + k) or name.startswith(k + ".") or f".{k}." in f".{name}."
               for k in keep)


def _load_quantized(task: Task, cfg: Any, setup: TrainingSetup, device: torch.device | str) -> nn.Module:
    """Build on the meta device, then load module by module as transformers' loader does with a
    bitsandbytes config: 16-bit parameters as they are, each linear weight quantized on arrival."""
    from torch.utils._python_dispatch import _disable_current_modes
    from transformers.pytorch_utils import Conv1D

    compute = DTYPES[setup.compute]
    with _disable_current_modes(), torch.device("meta"):
        model = task.model_class._from_config(cfg, dtype=compute)
    keep = _modules_not_quantized(model)
    kind = setup.weight_dtype.value
    made: dict[int, torch.Tensor] = {}  # tied parameters stay tied

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]

    for name, module in list(model.named_modules()):
        quantize = (type(module) is nn.Linear or isinstance(module, Conv1D)) and not _skipped(name, keep)
        if quantize:
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            out_f, in_f = (module.out_features, module.in_features) if isinstance(module, nn.Linear) \
                else (module.weight.shape[1], module.weight.shape[0])
            bias = real(module.bias) if module.bias is not None else None
            new = EmulatedQuantLinear(in_f, out_f, bias, kind, setup.double_quant, device, compute)
            new.weight_shape = tuple(module.weight.shape)
            setattr(parent, leaf, new)
            continue
        for pname, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                module._parameters[pname] = real(p)
        for bname, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                module._buffers[bname] = real(b)
    return model


QUANT_SKIP_NOTE = "16-bit, not {weights}: "


def _not_quantized_note(model: nn.Module, setup: TrainingSetup) -> tuple[str, ...]:
    """What transformers' quantizer leaves in 16-bit because of its class, said: ``replace_with_bnb_linear``
    (integrations/bitsandbytes.py) converts a module whose type *is* nn.Linear, and GPT-2's Conv1D, so a subclass
    (Falcon's FalconLinear: every projection of the model) keeps its 16-bit weight in the user's run too."""
    import transformers

    kept: dict[str, dict[str, None]] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not isinstance(m, EmulatedQuantLinear) and type(m) is not nn.Linear:
            kept.setdefault(type(m).__name__, {})[name.rsplit(".", 1)[-1]] = None
    if not kept:
        return ()
    shown = "; ".join(f"{cls} ({', '.join(names)})" for cls, names in kept.items())
    return (f"{QUANT_SKIP_NOTE.format(weights=setup.weight_dtype.value)}{shown}: transformers "
            f"{transformers.__version__}'s bitsandbytes quantizer converts only nn.Linear itself and Conv1D, not a "
            "subclass, so these weights load in 16-bit as in your run",)


def _lora_layer_for_emulated_quant() -> type:
    """peft's LoRA layer for bitsandbytes bases (peft 0.21.2 ``tuners/lora/bnb.py``, ``Linear4bit`` and
    ``Linear8bitLt``), for the emulated base: peft imports its own only where bitsandbytes imports."""
    from peft.tuners.lora.layer import LoraLayer

    class LoraOnQuantized(nn.Module, LoraLayer):
        def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, r: int = 0, lora_alpha: int = 1,
                     **kwargs: Any) -> None:
            super().__init__()
            LoraLayer.__init__(self, base_layer)
            self.fan_in_fan_out = False
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = self.base_layer(x, *args, **kwargs)
            if self.get_base_layer().kind == "nf4":
                result = result.clone()  # peft's Linear4bit clones defensively (bitsandbytes views)
            for active in self.active_adapters:
                if active not in self.lora_A.keys():
                    continue
                lora_a, lora_b = self.lora_A[active], self.lora_B[active]
                convert = not torch.is_autocast_enabled()
                if convert:
                    expected = result.dtype
                    x = self._cast_input_dtype(x, lora_a.weight.dtype)
                output = lora_b(lora_a(self.lora_dropout[active](x))) * self.scaling[active]
                if convert:
                    output = output.to(expected)
                result = result + output
            return result

    return LoraOnQuantized


# ---- a config measured on its own (the architecture matrix, the trace) ----------------------------------------

@dataclass(frozen=True)
class ConfigRun:
    """One simulated training step of a transformers config (see :func:`measure_config`)."""

    model_type: str
    model_class: str
    depth: int | None  # layers per stack built (None: the config's own depth)
    peak_bytes: int  # tensor peak (512-byte blocks, as the CUDA caching allocator hands them out)
    peak_phase: str
    params: int  # the full model's parameters (per-layer count x layers + the rest)
    own_params: int  # the full model's own count, built at full depth on the meta device
    built_params: int  # parameters of the model actually built (reduced depth)
    trainable_params: int  # of the model actually built
    notes: tuple[str, ...]
    seconds: float


def measure_config(config: Any, setup: TrainingSetup, reduce_depth: bool = True, steps: int = 2) -> ConfigRun:
    """``simulate --hf`` for a config alone: transformers' own class (any type it ships) under fake tensors,
    at reduced depth where its layers repeat, with the recipe applied as users apply it."""
    import time

    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramlab.core.simulation.step import measure
    from vramlab.core.simulation.tracker import MemoryTracker

    t0 = time.perf_counter()
    setup.validate()
    check(None, setup)
    task = task_of(config)
    depth = plan_depth(task, DTYPES[setup.compute], min_depth=2 if reduce_depth else 10**9)
    tracker = MemoryTracker(record_timeline=False)
    built: list[HFModel] = []

    def builder(spec, setup, device, real):  # noqa: ANN001, ANN202
        model = build_hf(spec, setup, device, real, depth=depth)
        built.append(model)
        return model

    with FakeTensorMode(allow_non_fake_inputs=False), guard(setup):
        run = measure(None, setup, torch.device("cpu"), real=False, tracker=tracker, steps=steps,  # type: ignore[arg-type]
                      builder=builder)
    model = built[0]
    return ConfigRun(task.model_type, task.model_class.__name__, depth.depth if depth.reduced else None,
                     tracker.peak.total_bytes, tracker.peak.phase,
                     model.full_params if model.full_params is not None else depth.own_params, depth.own_params,
                     run.total_params, run.trainable_params, model.notes, time.perf_counter() - t0)
