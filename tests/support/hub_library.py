"""The kernels library's own ``kernelize`` under transformers' own kernel mapping, as a model's ``train()`` calls it
on CUDA (transformers >= 5.25, core/spec/hub_kernels.py), for the tests that hold VRAM Lab's Hub-kernel swap
(core/simulation/liger.py ``kernelize_hub``) to the library."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def kernelize_as_transformers(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> int:
    """The kernels library's ``kernelize(model, device="cuda", mode=Mode.TRAINING, use_fallback=ALL)`` under
    transformers' own mapping, as ``train()`` calls it. The Hub is not reachable here: the repo kernels-community/
    liger-kernels stands in by its ``LigerRMSNorm`` layer as its ``torch-ext/liger_kernels/layers.py`` writes it
    (over liger-kernel 0.8.5's ``LigerRMSNormFunction``, imported when a swapped norm first runs), checked by the
    library's own ``_validate_layer``; every other repo cannot load, so the library keeps the torch forward there.
    Returns how many modules the library swapped (those it left a ``_kernel_repo`` on)."""
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

    def load(repo, module_class):  # noqa: ANN001, ANN202
        if repo.layer_name != "LigerRMSNorm":
            raise FileNotFoundError(repo)
        layer_mod._validate_layer(check_cls=module_class, cls=LigerRMSNorm, repo=repo)
        return LigerRMSNorm

    monkeypatch.setattr(layer_mod, "_get_layer_memoize", load)
    monkeypatch.setattr(repos, "_find_capability", lambda *a, **k: 90)  # an H100 (the CPU build has no CUDA)
    with use_kernel_mapping(get_kernel_mapping_transformers(), inherit_mapping=False):
        kernelize(model, device="cuda", mode=Mode.TRAINING, use_fallback=KernelizeFallback.ALL)
    return len(swapped_by_library(model))


def swapped_by_library(model: nn.Module) -> list[str]:
    """The modules of ``model`` whose forward the kernels library replaced with a Hub layer's."""
    return [name for name, m in model.named_modules() if "_kernel_repo" in vars(m)]
