"""NF4 / int8 weights on transformers' own classes, emulated with bitsandbytes' storage layout (the fake-tensor
path has no bitsandbytes kernels): which modules transformers keeps in 16 bits, the quantized load, and the
LoRA layer peft puts on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vramlab.core.simulation.model import TORCH_DTYPES
from vramlab.core.spec.training import TrainingSetup

if TYPE_CHECKING:
    from vramlab.core.tracing.hfconfig import Task

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

if TYPE_CHECKING:
    from vramlab.core.tracing.hfconfig import Task


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


def load_quantized(task: Task, cfg: Any, setup: TrainingSetup, device: torch.device | str) -> nn.Module:
    """Build on the meta device, then load module by module as transformers' loader does with a
    bitsandbytes config: 16-bit parameters as they are, each linear weight quantized on arrival."""
    from torch.utils._python_dispatch import _disable_current_modes
    from transformers.pytorch_utils import Conv1D

    compute = TORCH_DTYPES[setup.compute]
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
    if setup.kbit_upcast:  # --kbit-prepare: peft's own, every 16-bit parameter left unquantized cast to fp32
        from peft import prepare_model_for_kbit_training

        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


QUANT_SKIP_NOTE = "16-bit, not {weights}: "


def not_quantized_note(model: nn.Module, setup: TrainingSetup) -> tuple[str, ...]:
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


def quantized_notes(model: nn.Module, setup: TrainingSetup) -> tuple[str, ...]:
    """What a result of a quantized base loaded by :func:`load_quantized` says of it."""
    return (f"{setup.weight_dtype.value} storage emulated as bitsandbytes lays it out (bitsandbytes needs a GPU)",
            *not_quantized_note(model, setup))


def lora_layer_for_emulated_quant() -> type:
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
