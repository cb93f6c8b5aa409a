"""How the references put a kernel in place of transformers' code without a module-level patch: a Hub kernel's
layer forward bound on the private wrappers ``use_kernelized_func`` gives each module (:func:`bind_funcs`, as
``kernelize`` swaps a layer in), and a module's forward rebound with some of its globals replaced (:func:`rebind`,
as liger's and Unsloth's patches replace a modeling module's function): nothing another model or thread sees."""

from __future__ import annotations

import inspect
from types import FunctionType, MethodType

from torch import nn


def bind_funcs(model: nn.Module, layer: str, forward) -> int:  # noqa: ANN001
    """``forward`` bound on every wrapper ``use_kernelized_func`` gave a module of ``model`` (its ``_kernel_funcs``)
    for a function decorated with the Hub layer name ``layer``, as ``kernelize`` swaps the layer's in. Returns how
    many."""
    swapped = 0
    for module in model.modules():
        for func in (vars(module).get("_kernel_funcs") or {}).values():
            if getattr(type(func), "kernel_layer_name", None) == layer:
                func.forward = MethodType(forward, func)
                swapped += 1
    return swapped


def rebind(attn: nn.Module, **names: object) -> None:
    """``attn``'s forward (its own where one was installed, else its class's, unwrapped from transformers'
    ``deprecate_kwarg``) rebound with ``names`` in its globals: no global patch."""
    own = attn.__dict__.get("forward")
    fwd = own.__func__ if isinstance(own, MethodType) else inspect.unwrap(type(attn).forward)
    new = FunctionType(fwd.__code__, dict(fwd.__globals__, **names), fwd.__name__, fwd.__defaults__,
                       fwd.__closure__)
    new.__kwdefaults__ = fwd.__kwdefaults__
    attn.forward = MethodType(new, attn)
