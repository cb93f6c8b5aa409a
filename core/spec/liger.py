"""Liger Kernel's other kernels (``TrainingSetup.liger_kernels``): what liger-kernel 0.8.5's patch for a model's
family swaps in besides its loss (``apply_liger_kernel_to_<family>`` in ``liger_kernel/transformers/monkey_patch.py``,
which HF Trainer's ``use_liger_kernel``, LLaMA-Factory's ``enable_liger_kernel`` and axolotl's LigerPlugin call).

The families are told apart by the features of their :class:`ModelSpec`, as ``core/tracing/hfconfig.py`` tells
them apart for transformers' classes:

Its plain cross-entropy (off in every family's patch unless asked for) goes with the family's patch too.

* every family below whose patch has it (all of the hand-written ones): ``liger_rotary_pos_emb`` in place of the
  modeling module's ``apply_rotary_pos_emb`` (``rope``; not modelled on a vision-language model, refused for the
  RoPE functions of Llama 4 and the Qwen-VL towers);
* Llama, Mistral, Qwen 2, Qwen 3: ``LigerRMSNorm`` (casting mode "llama", offset 0, ``in_place`` True) on every
  RMSNorm (Qwen 3's q / k norms too) and ``LigerSwiGLUMLP``;
* Gemma 1: ``LigerRMSNormForGemma`` (casting mode "gemma", offset 1, ``in_place`` True) and ``LigerGEGLUMLP``;
* Gemma 2 and Gemma 3's text model: the Gemma norm with ``in_place`` False (their sandwich norms' residual needs the
  incoming gradient whole) on every norm (Gemma 3's q / k norms too) and ``LigerGEGLUMLP``;
* families liger-kernel 0.8.5 does not patch (LayerNorm or parallel blocks: Phi-1/2, GPT-2, StarCoder 2,
  StableLM; Qwen 2 MoE): nothing is swapped in (``_apply_liger_kernel_to_instance`` logs "no Liger kernels
  supported" and goes on), so the option changes nothing there;
* Phi-3: ``LigerRMSNorm`` and ``LigerPhi3SwiGLUMLP`` (its fused ``gate_up_proj`` chunked, the two halves handed
  to ``LigerSiLUMulFunction``, which copies each to a contiguous tensor and saves the copies);
* Mixtral and Qwen3-MoE (and, recorded, every type whose patch has it): ``LigerExperts`` on the experts module
  (``LigerFusedMoEFunction``, a fused MoE kernel with its own routing metadata: core/simulation/liger_moe.py), answered
  by the trace of transformers' classes, whose experts hold the fused tensors it reads (:data:`EXPERTS_NOTE` says
  what it assumes of the routing).

Every other model (a family only the trace answers, a vision-language model) is patched as liger's own
``apply_liger_kernel_to_<type>(model=...)`` patches transformers' class of its type: which modules it rebinds, to
which Liger module, is read off liger itself (``tools/liger_map.py`` runs each apply function on the class built on
the meta device and records the modules whose ``forward`` it rebound) into ``resources/liger_patches.json``, and
:func:`recorded_patch` reads it: a type liger's table adds is patched with no line of its own. Where liger's patch
itself fails on the transformers modelled (its Qwen2-VL / Qwen2.5-VL / Qwen3-VL patches import output classes
transformers 5 renamed), the option is refused with liger's error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from vramlab.core.checks import SetupError, short_repr
from vramlab.core.spec.model import ModelSpec, NormKind

# the kernels modelled, by the name of liger's own switch: its RMSNorm, its SwiGLU / GeGLU MLP ("glu": swiglu=
# for the SwiGLU families, geglu= for Gemma's), its plain cross-entropy (transformers' loss with liger's
# cross_entropy in place of torch's, where its fused linear cross-entropy is off)
LIGER_KERNELS = ("rms_norm", "glu", "cross_entropy", "layer_norm", "rope")
# "all": the ones every family's patch turns on by default (its cross-entropy is off unless asked for; its LayerNorm,
# the layer_norm switch of the vision-language patches, is on by default; its RoPE, liger_rotary_pos_emb in the
# modeling module's apply_rotary_pos_emb, where the type's apply function defaults rope=True)
LIGER_DEFAULT = ("rms_norm", "glu", "layer_norm", "rope")
# liger's RoPE functions modelled (core/simulation/liger.py LigerRopeFunction): the plain one and GPT-OSS's, which
# passes its rotary width (its cos / sin hold half a head); the same tensors
ROPE_MODELLED = ("liger_rotary_pos_emb", "liger_rotary_pos_emb_gpt_oss")
# streaming multiprocessors of the GPU modelled (H100 SXM): LigerRMSNorm's backward gathers the weight's gradient in
# an fp32 (multi_processor_count, hidden) buffer (rms_norm_backward's _dW)
LIGER_SM_COUNT = 132


@dataclass(frozen=True)
class LigerPatch:
    """What liger-kernel 0.8.5's patch swaps in for one model, of the kernels asked for."""

    rms_norm: bool  # every RMSNorm is LigerRMSNormFunction's
    # Gemma's norm: casting mode "gemma" and offset 1 (its 1 + weight), else casting mode "llama" and offset 0; both
    # modes keep an fp32 RSTD per row, and the offset is an argument of the kernel: the same tensors
    gemma: bool
    in_place: bool  # backward writes the input's gradient into the incoming one (Gemma 2 / 3: a new zeros_like)
    glu: bool  # the MLP is LigerSiLUMulFunction's (SwiGLU) or LigerGELUMulFunction's (GeGLU): a and b saved
    cross_entropy: bool = False  # transformers' loss calls LigerCrossEntropyFunction in torch's cross_entropy's place
    layer_norm: bool = False  # a vision tower's LayerNorms are LigerLayerNormFunction's (liger's layer_norm switch)
    rope: bool = False  # apply_rotary_pos_emb is liger_rotary_pos_emb (LigerRopeFunction: q and k rotated in place)


def parse_liger_kernels(value: Any) -> tuple[str, ...]:
    """``liger_kernels`` as a setup holds it: some of :data:`LIGER_KERNELS` in that order (a comma-separated
    string or a list, "all" standing for :data:`LIGER_DEFAULT`; "none")."""
    if isinstance(value, str):
        text = value.strip().lower()
        value = () if text in ("", "none") else [x.strip() for x in text.split(",") if x.strip()]
    if isinstance(value, (list, tuple)) and "all" in value:  # all,cross_entropy: the defaults and its cross-entropy
        value = [*LIGER_DEFAULT, *(x for x in value if x != "all")]
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) and x in LIGER_KERNELS for x in value):
        raise SetupError(f"Liger kernels must be some of {', '.join(LIGER_KERNELS)} (or all / none; got "
                         f"{short_repr(value)})")
    return tuple(k for k in LIGER_KERNELS if k in value)


def liger_patch(spec: ModelSpec, kernels: tuple[str, ...]) -> LigerPatch | None:
    """The kernels of ``kernels`` that liger-kernel 0.8.5's patch for ``spec``'s family swaps in; None where it
    swaps in none of them. Refuses, with that reason, a patch it makes that is not modelled."""
    if not kernels:
        return None
    if spec.vision is not None:  # liger's RoPE on a vision-language model is not modelled (its torch RoPE runs)
        kernels = tuple(k for k in kernels if k != "rope")
    if (model_type := liger_model_type(spec)) is not None:  # liger's own patch of the type, recorded
        record = recorded_patch(model_type, kernels)
        return None if record is None else _language_model(record)
    patched = not (spec.norm_kind is NormKind.LAYERNORM or spec.parallel_block or spec.learned_positions
                   or spec.shared_expert_intermediate_size)
    if not patched:
        return None
    glu = "glu" in kernels  # on a mixture of experts: LigerExperts on its experts (core/simulation/liger_moe.py)
    gemma = spec.gemma_norm
    return LigerPatch(rms_norm="rms_norm" in kernels, gemma=gemma, in_place=not (gemma and spec.norms_per_layer == 4),
                      glu=glu, cross_entropy="cross_entropy" in kernels, rope="rope" in kernels)


# the Liger modules modelled (core/simulation/liger.py), by the forward liger binds, and the switch that turns each on
# (LigerQwen3MoeSwiGLUMLP's and LigerHunyuanV1SwiGLUMLP's forward are LigerSwiGLUMLP's, line for line)
MODELLED = {"LigerRMSNorm.forward": "rms_norm", "LigerSwiGLUMLP.forward": "glu", "LigerGEGLUMLP.forward": "glu",
            "LigerLayerNorm.forward": "layer_norm", "LigerQwen3MoeSwiGLUMLP.forward": "glu",
            "LigerHunyuanV1SwiGLUMLP.forward": "glu", "LigerPhi3SwiGLUMLP.forward": "glu",
            "LigerExperts.forward": "glu"}
# the forwards that replace a mixture of experts' experts module (LigerFusedMoEFunction: core/simulation/liger_moe.py)
EXPERTS = ("LigerExperts.forward",)
# what the estimate assumes of the routing under LigerExperts (its two routing-sized int32 arrays), for the note
EXPERTS_NOTE = ("liger's LigerFusedMoEFunction sizes its tile metadata from the routing (.item()); counted at the "
                "bound over every routing, one 64-row tile per routed token (8 bytes per routed token per layer, "
                "saved) and one histogram tile per token (4 x experts bytes per token, for a moment), a little above "
                "any real run")
# the forwards whose MLP computes gate and up in one gate_up_proj, chunked in two (LigerPhi3SwiGLUMLP's)
FUSED_GATE_UP = ("LigerPhi3SwiGLUMLP.forward",)


@dataclass(frozen=True)
class RecordedModule:
    """One module liger's patch rebinds: the path under the model (layer numbers as ``*``), its class, the kernel."""

    path: str
    cls: str
    kernel: str  # "rms_norm" | "glu" | "layer_norm"
    in_place: bool = True  # LigerRMSNorm's in_place
    base_path: str = ""  # the path under the type's base model (where a composite model holds the type as its part)
    fused: bool = False  # the MLP's gate and up are one gate_up_proj, chunked (LigerPhi3SwiGLUMLP)
    experts: bool = False  # a mixture of experts' experts module: LigerExperts (LigerFusedMoEFunction)

    def matches(self, name: str, module_class: str, base: bool = False) -> bool:
        path = self.base_path if base else self.path
        return module_class == self.cls and re.fullmatch(re.escape(path).replace(r"\*", r"\d+"), name) is not None


@dataclass(frozen=True)
class RecordedPatch:
    """What liger-kernel 0.8.5's patch for a model type swaps into transformers' class of it, of the kernels asked."""

    model_type: str
    modules: tuple[RecordedModule, ...]
    cross_entropy: bool  # transformers' loss calls liger's cross-entropy in torch's place
    kernels: tuple[str, ...] = ()  # the kernels asked (a composite model's parts get the same)
    # the modeling modules whose apply_rotary_pos_emb liger's RoPE replaces, with its function's name
    rope: tuple[tuple[str, str], ...] = ()


@cache
def _records() -> dict[str, Any]:
    return json.loads(resources.files("vramlab.resources").joinpath("liger_patches.json").read_text(encoding="utf-8"))


def _switch(liger: str) -> str:
    """The switch of liger's apply functions that turns a Liger module on: its norms' or its MLP's."""
    return "layer_norm" if "LayerNorm" in liger else "rms_norm" if "Norm" in liger else "glu"


def recorded_patch(model_type: str, kernels: tuple[str, ...]) -> RecordedPatch | None:
    """What liger-kernel 0.8.5's patch for ``model_type`` swaps in of ``kernels`` (``resources/liger_patches.json``,
    recorded off liger itself); None where it swaps in none of them, or liger has no patch for the type. Refuses a
    type whose patch liger itself cannot run, and a Liger module it swaps in that is not modelled."""
    record = _records()["types"].get(model_type)
    if not kernels or record is None:
        return None
    if record.get("error"):
        raise SetupError(f"liger-kernel {_records()['liger-kernel']}'s patch for {model_type} fails under "
                         f"transformers {_records()['transformers']}: {record['error']}: drop --liger-kernels")
    rows = [m for m in record.get("modules", ()) if MODELLED.get(m["forward"], _switch(m["liger"])) in kernels]
    unmodelled = sorted({m["liger"] for m in rows if m["forward"] not in MODELLED})
    if unmodelled:
        raise SetupError(f"liger-kernel's {', '.join(unmodelled)} (its patch for {model_type}) is not modelled "
                         f"yet: drop {', '.join(sorted({_switch(n) for n in unmodelled}))} from --liger-kernels")
    modules = tuple(RecordedModule(m["path"], m["class"], MODELLED[m["forward"]], bool(m.get("in_place", True)),
                                   m.get("base_path", m["path"]), m["forward"] in FUSED_GATE_UP,
                                   m["forward"] in EXPERTS) for m in rows)
    ce = "cross_entropy" in kernels and record.get("cross_entropy") == "transformers_loss"
    rope = _rope(model_type, record) if "rope" in kernels else ()
    return RecordedPatch(model_type, modules, ce, kernels, rope) if modules or ce or rope else None


def _rope(model_type: str, record: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The RoPE functions liger's patch for ``model_type`` binds as HF Trainer, LLaMA-Factory and axolotl call it
    with its default ``rope`` (True for most types; off where liger's own default is off: DeepSeek, GLM-4, Qwen 3.5,
    Qwen3-Next, Gemma 4); refuses one that is not modelled (Llama 4's, the Qwen-VL towers')."""
    if not record.get("switches", {}).get("rope"):
        return ()
    binds = tuple(sorted((k.rsplit(".", 1)[0], v) for k, v in (record.get("rope_binds") or {}).items()))
    if odd := sorted({f for _, f in binds if f not in ROPE_MODELLED}):
        raise SetupError(f"liger-kernel's {', '.join(odd)} (its RoPE for {model_type}) is not modelled yet: drop "
                         "rope from --liger-kernels")
    return binds


def part_patch(model_type: str, kernels: tuple[str, ...]) -> RecordedPatch | None:
    """liger's patch of ``model_type`` as a composite model's patch applies it to a part of that type (LLaVA's,
    InternVL's and SmolVLM's language model and tower: liger's apply function of the part's own type); None where
    liger has none that runs."""
    record = _records()["types"].get(model_type)
    if record is None or record.get("error") or not record.get("modules"):
        return None
    return recorded_patch(model_type, kernels)


def _language_model(record: RecordedPatch) -> LigerPatch | None:
    """The kernels of ``record`` on the language model's decoder (what a vision-language program's shared decoder
    runs; core/estimator/program.py): its RMSNorms' ``in_place``, its GLU MLPs."""
    text = [m for m in record.modules if ".vision" not in m.path and ".visual" not in m.path]
    norms = [m for m in text if m.kernel == "rms_norm"]
    glu = any(m.kernel == "glu" for m in text)
    layer_norm = any(m.kernel == "layer_norm" for m in record.modules)
    if not (norms or glu or record.cross_entropy or layer_norm or record.rope):
        return None
    return LigerPatch(rms_norm=bool(norms), gemma=False, in_place=all(m.in_place for m in norms), glu=glu,
                      cross_entropy=record.cross_entropy, layer_norm=layer_norm, rope=bool(record.rope))


def liger_model_type(spec: ModelSpec) -> str | None:
    """The model type whose recorded patch applies to ``spec``: its transformers config's (a traced family) or its
    vision-language family's; None for a hand-written text family (:func:`liger_patch` reads its features)."""
    if spec.transformers_config:
        return str(json.loads(spec.transformers_config).get("model_type", ""))
    if spec.vision is not None:
        return str(getattr(spec.vision, "model_type", "") or spec.family)
    return None


def experts_note(spec: ModelSpec, kernels: tuple[str, ...]) -> str | None:
    """:data:`EXPERTS_NOTE` where liger's patch of ``spec`` puts ``LigerExperts`` on its experts; None elsewhere."""
    if "glu" not in kernels:
        return None
    if (model_type := liger_model_type(spec)) is not None:
        record = _records()["types"].get(model_type) or {}
        return EXPERTS_NOTE if any(m["forward"] in EXPERTS for m in record.get("modules", ())) else None
    patch = liger_patch(spec, ("glu",)) if spec.is_moe else None
    return EXPERTS_NOTE if patch is not None and patch.glu else None


def vision_rope_note(spec: ModelSpec, kernels: tuple[str, ...]) -> str | None:
    """What the estimate says where liger's patch of a vision-language model turns its RoPE on (not modelled there:
    the language model's RoPE is counted as transformers' own); None elsewhere."""
    if "rope" not in kernels or spec.vision is None:
        return None
    record = _records()["types"].get(liger_model_type(spec) or "") or {}
    if not record.get("switches", {}).get("rope") or not record.get("rope_binds"):
        return None
    return (f"liger-kernel 0.8.5's patch for {spec.family or spec.name} swaps in its RoPE too: not modelled on a "
            "vision-language model (counted as transformers' own RoPE)")
