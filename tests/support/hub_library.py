"""The kernels library's own ``kernelize`` under transformers' own kernel mapping, as a model's ``train()`` calls it
on CUDA (transformers >= 5.25, core/spec/hub_kernels.py), for the tests that hold VRAM Lab's Hub-kernel swap
(core/simulation/liger.py ``kernelize_hub``) to the library."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def kernelize_as_transformers(model: nn.Module, monkeypatch: pytest.MonkeyPatch,
                              stand_ins: tuple[str, ...] = ("LigerRMSNorm", "apply_rotary_transformers")) -> int:
    """The kernels library's ``kernelize(model, device="cuda", mode=Mode.TRAINING, use_fallback=ALL)`` under
    transformers' own mapping, as ``train()`` calls it. The Hub is not reachable here: the repo kernels-community/
    liger-kernels stands in by its ``LigerRMSNorm`` layer as its ``torch-ext/liger_kernels/layers.py`` writes it
    (over liger-kernel 0.8.5's ``LigerRMSNormFunction``, imported when a swapped norm first runs), checked by the
    library's own ``_validate_layer``; kernels-community/rotary by its ``apply_rotary_transformers`` layer as its
    ``torch-ext/rotary/layers.py`` writes it (version 2), over :func:`rotary_op`; every other repo cannot load, so
    the library keeps the torch forward there. Returns how many modules the library swapped (those it left a
    ``_kernel_repo`` on). ``stand_ins``: the layers that stand in (the others cannot load either)."""
    import kernels._internals.layer.layer as layer_mod
    from kernels import KernelizeFallback, Mode, kernelize, use_kernel_mapping
    from kernels._internals.layer import repos
    from transformers.integrations.hub_kernels import get_kernel_mapping_transformers

    class LigerRMSNorm(nn.Module):
        weight: nn.Parameter
        variance_epsilon: float

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return LigerRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, 0, "llama", True,
                                              None)

    ops = rotary_op()

    class apply_rotary_transformers(nn.Module):  # noqa: N801 (the repo's name)
        can_torch_compile = True

        def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
            cos = cos.unsqueeze(unsqueeze_dim)
            sin = sin.unsqueeze(unsqueeze_dim)
            q_rotated = q.clone()
            k_rotated = k.clone()
            half_dim = q.shape[-1] // 2
            q1 = q_rotated[..., :half_dim]
            q2 = q_rotated[..., half_dim:]
            k1 = k_rotated[..., :half_dim]
            k2 = k_rotated[..., half_dim:]
            if cos.shape[-1] != half_dim:
                cos = cos[..., :half_dim]
                sin = sin[..., :half_dim]
            ops.apply_rotary(q1, q2, cos, sin, q1, q2, False)
            ops.apply_rotary(k1, k2, cos, sin, k1, k2, False)
            return q_rotated, k_rotated

    layers = {"LigerRMSNorm": LigerRMSNorm, "apply_rotary_transformers": apply_rotary_transformers}

    def load(repo, module_class):  # noqa: ANN001, ANN202
        if repo.layer_name not in layers or repo.layer_name not in stand_ins:
            raise FileNotFoundError(repo)
        layer_mod._validate_layer(check_cls=module_class, cls=layers[repo.layer_name], repo=repo)
        return layers[repo.layer_name]

    monkeypatch.setattr(layer_mod, "_get_layer_memoize", load)
    monkeypatch.setattr(repos, "_find_capability", lambda *a, **k: 90)  # an H100 (the CPU build has no CUDA)
    with use_kernel_mapping(get_kernel_mapping_transformers(), inherit_mapping=False):
        kernelize(model, device="cuda", mode=Mode.TRAINING, use_fallback=KernelizeFallback.ALL)
    return len(swapped_by_library(model))


def rotary_op():  # noqa: ANN201
    """kernels-community/rotary's ``ops`` with its one op registered as ``torch_binding.cpp`` registers it: the same
    schema (``Tensor! out1, Tensor! out2 ... -> ()``), a backend kernel and no autograd kernel, so autograd takes
    torch's own fallback for it, as on CUDA. The CPU kernel is the CUDA kernel's arithmetic (``rotary_cuda.cu``,
    in float, written in place) run below autograd and ADInplaceOrView, as a compiled kernel runs: it records
    nothing and bumps no version."""
    if not hasattr(torch.ops, "vramlab_rotary_test") or not hasattr(torch.ops.vramlab_rotary_test, "apply_rotary"):
        lib = torch.library.Library("vramlab_rotary_test", "DEF")
        lib.define("apply_rotary(Tensor x1, Tensor x2, Tensor cos, Tensor sin, Tensor! out1, Tensor! out2, "
                   "bool conj) -> ()")

        def cpu(x1, x2, cos, sin, out1, out2, conj):  # noqa: ANN001, ANN202
            with torch._C._AutoDispatchBelowADInplaceOrView():
                a, b, c, s = x1.float(), x2.float(), cos.float(), sin.float()
                o1, o2 = (a * c + b * s, -a * s + b * c) if conj else (a * c - b * s, a * s + b * c)
                out1.copy_(o1)
                out2.copy_(o2)

        lib.impl("apply_rotary", cpu, "CPU")
        _LIBRARIES.append(lib)  # a Library deregisters its op when collected
    return torch.ops.vramlab_rotary_test


_LIBRARIES: list = []


def swapped_by_library(model: nn.Module) -> list[str]:
    """The modules of ``model`` whose forward the kernels library replaced with a Hub layer's."""
    return [name for name, m in model.named_modules() if "_kernel_repo" in vars(m)]
