"""Liger's SwiGLU on a mixture of experts (issue 29, "options people turn on"): liger-kernel 0.8.5's patch binds
``LigerExperts.forward`` on the experts of Mixtral, Qwen3-MoE and the other types whose patch has it, and its
forward is ``LigerFusedMoEFunction`` (a fused grouped GEMM with its own routing metadata). It was refused; it is
modelled (core/simulation/liger_moe.py).

Held three ways. The reference function against liger's own Python code on CPU tensors, its Triton kernels as no-ops
but its routing's two sizes (read off the routing in its kernels) written as the kernels would: alloc for alloc.
transformers' MoE classes patched by liger's own ``apply_liger_kernel_to_<type>(model=...)`` against the same classes
patched by the reference (the hand-written families' patch and the recorded one): alloc for alloc. The estimate
(a hand-written family traced, a traced type) against transformers' classes patched, with the routing's bound named
in the note. And peft's LoRA on the experts' tensors, under which liger's own forward fails, refused with its error.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from tests.support import liger_library
from tests.support.step_timeline import step_timeline, tiny_model
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec import liger as spec_liger
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation import liger, liger_moe  # noqa: E402
from vramlab.core.simulation.simulate import simulate  # noqa: E402
from vramlab.core.simulation.tracker import MemoryTracker  # noqa: E402


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """liger-kernel 0.8.5 over a no-op triton, but for the two routing kernels whose values its Python reads: the
    histogram's launch tells its token tiles (``n_tiles``), and the prefix sum writes the M tiles' count
    (``sum_e ceil(tokens_e / 64)`` of the routing, or ``seen["tiles"]`` where a test sets it) where ``.item()``
    reads it. The reference takes the same two sizes (``seen``)."""
    gen = liger_library.imported(monkeypatch)
    next(gen)
    monkeypatch.setattr(spec_liger, "LIGER_SM_COUNT", 1)
    from liger_kernel.ops import fused_moe

    seen: dict[str, int] = {}

    class Histogram:
        def __getitem__(self, _grid: object):  # noqa: ANN204
            def run(topk, *_a: object, **k: object) -> None:  # noqa: ANN001
                seen["n_tiles"] = int(k["n_tiles"])
                counts = Counter(topk.numpy().ravel().tolist())  # no torch op: nothing counted
                seen["routed"] = sum(-(-c // fused_moe.BLOCK_M_TOKEN) for c in counts.values())
            return run

    class PrefixSum:
        def __getitem__(self, _grid: object):  # noqa: ANN204
            def run(_count, _start, tile_offset, **_k: object) -> None:  # noqa: ANN001
                tile_offset.numpy()[-1] = seen.get("tiles", seen["routed"])
            return run

    monkeypatch.setattr(fused_moe, "_moe_router_histogram_kernel", Histogram())
    monkeypatch.setattr(fused_moe, "_moe_router_prefix_sum_kernel", PrefixSum())
    bound = liger_moe.routing_tiles
    monkeypatch.setattr(liger_moe, "routing_tiles",
                        lambda t, k, e: (seen["n_tiles"], seen.get("tiles", seen["routed"])))
    yield seen, bound
    next(gen, None)


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(200, 2, 4), (90, 8, 16)])
@pytest.mark.parametrize("grads", [(True, True, True, True), (True, False, False, True),
                                   (False, False, False, True)], ids=["full", "frozen-experts", "frozen-input"])
def test_the_fused_moe_reference_allocates_what_liger_allocates(library, tokens: int, top_k: int,  # noqa: ANN001
                                                                experts: int, grads: tuple) -> None:
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    seen, bound = library
    h, inter = 48, 80
    torch.manual_seed(0)
    x = torch.randn(tokens, h, dtype=torch.bfloat16)
    gate_up = torch.randn(experts, 2 * inter, h, dtype=torch.bfloat16)
    down = torch.randn(experts, h, inter, dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, top_k, dtype=torch.bfloat16)

    def timeline(fn) -> tuple[list[int], list[int]]:  # noqa: ANN001
        tracker = MemoryTracker(block=1)
        with tracker:
            xs = [t.detach().clone().requires_grad_(g) for t, g in zip((x, gate_up, down, weights), grads)]
            y = fn(xs[0], xs[1], xs[2], index, xs[3])
            y.backward(torch.ones_like(y))
            sizes = [t.grad.numel() * t.grad.element_size() for t in xs if t.grad is not None]
            del y, xs
        return [c for _, c in tracker.timeline], sizes

    lib = timeline(LigerFusedMoEFunction.apply)
    assert lib == timeline(liger_moe.LigerFusedMoEFunction.apply)
    # the reference's own sizes (no routing known) bound this routing's
    n_tiles, tiles = bound(tokens, top_k, experts)
    assert n_tiles >= seen["n_tiles"] and tiles >= seen["routed"]


SIZE = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "mixtral": dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(moe_intermediate_size=48, intermediate_size=128, num_experts=8, num_experts_per_tok=4,
                      head_dim=16, norm_topk_prob=True),
}


def _model(model_type: str):  # noqa: ANN202
    return tiny_model(model_type, **SIZE, **FAMILIES[model_type])


@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize("lora", [False, True])
def test_transformers_moe_classes_patched_as_liger_patches_them(library, model_type: str, lora: bool) -> None:  # noqa: ANN001
    """liger's own ``apply_liger_kernel_to_<type>(model=...)`` (its norms and its experts; RoPE and losses off),
    the hand-written families' patch (:func:`liger.patch_model`) and the recorded one (:func:`liger.patch_recorded`)
    on the same class, full or LoRA on the attention: the same tensors, alloc for alloc."""
    import peft
    from liger_kernel.transformers import monkey_patch as mp

    seen, _bound = library
    make = _model(model_type)
    ids = torch.randint(0, 64, (2, 24))
    seen["tiles"] = 2 * 24 * FAMILIES[model_type]["num_experts_per_tok"]  # the reference's bound, written by liger

    def run(patcher) -> list[int]:  # noqa: ANN001
        torch.manual_seed(0)
        model = make()
        if lora:
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        patcher(model)
        return step_timeline(model, ids)

    lib = run(lambda model: liger_library.apply_own(mp.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type], model, lora=lora))
    hand = run(lambda model: liger.patch_model(model, spec_liger.LigerPatch(True, False, True, True)))
    recorded = run(lambda model: liger.patch_recorded(model, spec_liger.recorded_patch(model_type, ("rms_norm",
                                                                                                     "glu"))))
    assert lib == hand == recorded
    assert recorded != run(lambda model: liger.patch_recorded(model, spec_liger.recorded_patch(model_type,
                                                                                               ("rms_norm",))))


def test_lora_on_the_experts_tensors_is_refused_with_ligers_error(library) -> None:  # noqa: ANN001
    """peft's LoRA on the experts' fused tensors puts a ParamWrapper in their place; HF Trainer applies liger after
    peft, and liger's forward bound on the wrapper fails on its first call: refused, with that error."""
    import peft
    from liger_kernel.transformers import monkey_patch as mp

    def adapted():  # noqa: ANN202
        model = _model("mixtral")()
        return peft.get_peft_model(model, peft.LoraConfig(
            r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))

    model = adapted()
    liger_library.apply_own(mp.apply_liger_kernel_to_mixtral, model, lora=True)
    with pytest.raises(AttributeError, match="'ParamWrapper' object has no attribute 'hidden_dim'"):
        model(torch.randint(0, 64, (1, 8)))
    for patch in (lambda m: liger.patch_recorded(m, spec_liger.recorded_patch("mixtral", ("glu",))),
                  lambda m: liger.patch_model(m, spec_liger.LigerPatch(False, False, True, True))):
        with pytest.raises(SetupError, match="'ParamWrapper' object has no attribute 'hidden_dim'"):
            patch(adapted())


def _small(preset: str) -> object:
    from vramlab.core.catalog import find_model

    return dataclasses.replace(find_model(preset), num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                               head_dim=32, intermediate_size=256, vocab_size=4000,
                               moe_intermediate_size=find_model(preset).moe_intermediate_size and 64)


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_the_estimate_of_a_hand_written_moe_is_its_classes_patched(preset: str) -> None:
    """Mixtral and Qwen3-MoE with liger's SwiGLU (refused before): auto answers them from the trace of transformers'
    classes patched (LigerExperts reads their fused expert tensors), the routing's bound named in the note."""
    spec = _small(preset)
    setup = TrainingSetup(method="lora", lora_targets="q_proj,v_proj", seq_len=128, liger_kernels="rms_norm,glu")
    est = estimate(spec, setup, match_simulation=True)
    ref = simulate(spec, setup, hf=True)
    assert est.source.startswith("traced")
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= 1024
    assert est.peak_phase == ref.peak_phase
    assert spec_liger.EXPERTS_NOTE in est.warnings
    plain = simulate(spec, setup.replace(liger_kernels="rms_norm"), hf=True)
    assert plain.peak_allocated_bytes != ref.peak_allocated_bytes


@pytest.mark.parametrize(("model_type", "extra"), [
    ("hunyuan_v1_moe", dict(intermediate_size=96, num_experts=4, moe_topk=2, head_dim=16)),
    ("deepseek_v3", dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1)),
])
def test_a_traced_moe_type_gets_ligers_experts(model_type: str, extra: dict) -> None:
    """A type only the trace answers whose liger patch has LigerExperts (HunYuan-MoE, DeepSeek-V3): the recorded
    patch binds it; the estimate is transformers' class patched so, and the experts' kernel changes it."""
    from vramlab.core.sources.hf_config import spec_from_hf_config

    spec = spec_from_hf_config({"model_type": model_type, **SIZE, **extra}, id=model_type, name=model_type)
    assert spec.transformers_config
    setup = TrainingSetup(method="lora", lora_targets="o_proj", seq_len=64, liger_kernels="all")
    est = estimate(spec, setup, match_simulation=True)
    ref = simulate(spec, setup, hf=True)
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= 1024
    assert spec_liger.EXPERTS_NOTE in est.warnings
    no_glu = estimate(spec, setup.replace(liger_kernels="rms_norm"), match_simulation=True)
    assert no_glu.peak_allocated_bytes != est.peak_allocated_bytes


def test_the_hand_written_program_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the trace (the estimator-only build, or --source hand-written) the experts' kernel is refused with
    the reason, never estimated as transformers' experts."""
    from vramlab.core import traced

    spec = _small("mixtral-8x7b")
    setup = TrainingSetup(method="lora", lora_targets="q_proj,v_proj", seq_len=128, liger_kernels="rms_norm,glu")
    with pytest.raises(SetupError, match="LigerExperts"):
        estimate(dataclasses.replace(spec, tape="hand-written"), setup)
    monkeypatch.setattr(traced, "installed", lambda: False)
    with pytest.raises(SetupError, match="vramlab\\[hf\\]"):
        estimate(spec, setup)
