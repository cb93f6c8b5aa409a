"""LoRA and freezing on transformers' own module names: ``all-linear`` as peft resolves it, the attention and
MLP roles read from the module paths, peft's ParamWrapper (LoRA on a parameter, fused experts) and the last
layers of the model's own stack trained, whatever it is called.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from vramlab.core.checks import SetupError
from vramlab.core.simulation import context
from vramlab.core.simulation.model import TORCH_DTYPES
from vramlab.core.spec.options import DType
from vramlab.core.spec.targets import ALL_TARGETS, names_all_linear, parse_targets
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.tracing.hfconfig import CAUSAL, SEQ2SEQ, Task, default_device, layer_stacks
from vramlab.core.tracing.hfquant import EmulatedQuantLinear, lora_layer_for_emulated_quant

# ---- LoRA on the model's own module names ----------------------------------------------------------------

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
    if names_all_linear(targets):
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


def apply_lora(model: nn.Module, setup: TrainingSetup, task: Task, device: torch.device | str) -> nn.Module:
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
        lcfg._register_custom_module({EmulatedQuantLinear: lora_layer_for_emulated_quant()})
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
    torch.set_default_dtype(TORCH_DTYPES[setup.adapter_dtype])
    try:
        with default_device(device), _param_wrappers_without_dropout():
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


def freeze_all_but_last(model: nn.Module, n: int, extra: tuple[str, ...] = (),
                        layers: tuple[str, nn.ModuleList] | None = None) -> None:
    """Train the last ``n`` of the model's repeated layers (whatever they are called; ``layers``, a name and a
    stack, where given: a vision-language model's language model) and nothing else, as a plain ``requires_grad``
    freeze and LLaMA-Factory's freeze step (``freeze_trainable_layers``) do; ``extra`` (``FREEZE_EXTRAS``) also
    trains the input embedding, the modules after the layers (the final norm) or the output head, as
    LLaMA-Factory's ``freeze_extra_modules`` names them (a head tied to the embedding trains with it)."""
    stacks = [layers] if layers is not None else layer_stacks(model)
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


def upcast_trainable(model: nn.Module) -> None:
    """The parameters that train cast to fp32, the frozen ones left as loaded (``TrainingSetup.trainable_fp32``):
    LLaMA-Factory 0.9.5's ``init_adapter`` with ``cast_trainable_params_to_fp32``, which ``_setup_full_tuning``,
    ``_setup_freeze_tuning`` and ``_setup_lora_tuning`` apply as ``param.data = param.data.to(torch.float32)``,
    one parameter at a time (peft's adapters are fp32 already)."""
    for p in model.parameters():
        if p.requires_grad and p.dtype.is_floating_point and p.dtype != torch.float32:
            p.data = p.data.to(torch.float32)
