"""mamba-ssm's fused Mamba-2 mixer (``mamba_split_conv1d_scan_combined``), which transformers 5.25.0's Mamba-2
mixers call in training on CUDA (the Hub's kernels-community/mamba-ssm or the installed package): VRAM Lab's
reference Function (core/simulation/mamba.py) held alloc for alloc to mamba-ssm's own ``MambaSplitConv1dScanCombinedFn``
run on the CPU with its Triton / CUDA launches stubbed (only where mamba-ssm's sources, triton and einops import),
and the trace's binding on transformers' classes: the fused path replaces the torch path, and a LoRA on
``out_proj`` gets no gradient (the Function multiplies by the base layer's weight)."""

from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.support.step_timeline import step_timeline
from vramlab.core.simulation.tracker import MemoryTracker

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("kernels")

from vramlab.core.simulation import causal_conv1d, mamba  # noqa: E402


def _library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    """mamba-ssm's ``ssd_combined`` with its kernels stubbed: the compiled extensions as empty modules (the custom
    ops' bodies call nothing), every Triton launch a no-op, the autotuners' best config their first (it only
    bounds the partial sums summed, not what is allocated), and an H100 SXM's SM count."""
    pytest.importorskip("triton")
    pytest.importorskip("einops")
    for name in ("selective_scan_cuda", "causal_conv1d_cuda"):
        stub = types.ModuleType(name)
        stub.causal_conv1d_fwd = stub.causal_conv1d_bwd = lambda *a, **k: None
        monkeypatch.setitem(sys.modules, name, stub)
    pytest.importorskip("mamba_ssm")
    ssd = pytest.importorskip("mamba_ssm.ops.triton.ssd_combined")
    from triton.runtime import autotuner, jit

    monkeypatch.setattr(jit.KernelInterface, "__getitem__", lambda self, grid: lambda *a, **k: None)
    monkeypatch.setattr(autotuner.Autotuner, "best_config", property(lambda self: self.configs[0]), raising=False)
    props = types.SimpleNamespace(multi_processor_count=mamba.SM_COUNT)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())  # CPU tensors: no index
    return ssd.mamba_split_conv1d_scan_combined


def _inputs(nheads: int, dtype: torch.dtype, bias: bool, norm: bool) -> tuple[dict, list[torch.Tensor]]:
    torch.manual_seed(0)
    headdim, ngroups, dstate, hidden = 16, 2, 16, 48
    dim = nheads * headdim
    conv_dim = dim + 2 * ngroups * dstate

    def p(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, dtype=dt).requires_grad_()

    args = dict(zxbcdt=p(2, 40, 2 * dim + 2 * ngroups * dstate + nheads), conv1d_weight=p(conv_dim, 4),
                conv1d_bias=p(conv_dim), dt_bias=p(nheads), A=p(nheads, dt=torch.float32), D=p(nheads),
                chunk_size=16, activation="silu", rmsnorm_weight=p(dim) if norm else None, rmsnorm_eps=1e-6,
                outproj_weight=p(hidden, dim), outproj_bias=p(hidden) if bias else None, headdim=headdim,
                ngroups=ngroups, norm_before_gate=False, dt_limit=(0.0, float("inf")), return_final_states=False)
    return args, [v for v in args.values() if isinstance(v, torch.Tensor)]


def _timeline(fn, *case: object) -> tuple[list[int], list]:  # noqa: ANN001
    args, leaves = _inputs(*case)
    tracker = MemoryTracker(block=1)
    with tracker:
        out = fn(**args)
        out.backward(torch.ones_like(out))
        del out
    # the live bytes at each allocation (the order of the frees between two allocations is the order Python
    # clears a frame's locals in, which changes no peak)
    live = [c for _, c in tracker.timeline]
    return [c for c, before in zip(live, [0, *live]) if c > before], [
        (t.grad.shape, t.grad.dtype) if t.grad is not None else None for t in leaves]


# 8 heads: zxbcdt's row (328) a multiple of 8; 6 heads (262): ensure_stride copies xBC for the conv; without the
# gated RMSNorm (Falcon-H1's mamba_rms_norm False) the scan gates its output itself
@pytest.mark.parametrize(("nheads", "dtype", "bias", "norm"), [(8, torch.bfloat16, False, True),
                                                               (6, torch.float32, True, True),
                                                               (8, torch.bfloat16, True, False)])
def test_the_reference_allocates_what_mamba_ssm_allocates(monkeypatch, nheads: int, dtype: torch.dtype,  # noqa: ANN001
                                                          bias: bool, norm: bool) -> None:
    case = (nheads, dtype, bias, norm)
    assert _timeline(_library(monkeypatch), *case) == _timeline(mamba.split_conv1d_scan_combined, *case)


def test_the_conv_allocates_what_causal_conv1d_allocates(monkeypatch) -> None:  # noqa: ANN001
    """causal-conv1d's own ``CausalConv1dFn`` (its CUDA extension stubbed), channels-first and channels-last (the
    layout transformers' callers hand it: a transposed projection), bias or none, bf16 over an fp32 weight."""
    _library(monkeypatch)
    from causal_conv1d.causal_conv1d_interface import causal_conv1d_fn

    def run(fn, last: bool, bias: bool) -> list[int]:  # noqa: ANN001
        torch.manual_seed(0)
        x = torch.randn(2, 40, 24) if last else torch.randn(2, 24, 40)
        x = (x.transpose(1, 2) if last else x).to(torch.bfloat16).requires_grad_()
        w = torch.randn(24, 4, requires_grad=True)
        b = torch.randn(24, requires_grad=True) if bias else None
        tracker = MemoryTracker(block=1)
        with tracker:
            out = fn(x.transpose(1, 2).transpose(1, 2), w, b, activation="silu")
            out.backward(torch.ones_like(out).transpose(1, 2).contiguous().transpose(1, 2))
            del out
        live = [c for _, c in tracker.timeline]
        return [c for c, before in zip(live, [0, *live]) if c > before]

    for last, bias in ((True, True), (False, False)):
        assert run(causal_conv1d_fn, last, bias) == run(causal_conv1d.causal_conv1d_fn, last, bias)


def _granite(targets: list[str]):  # noqa: ANN202
    import peft
    import transformers as tf

    cfg = tf.GraniteMoeHybridConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention"],
                                    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
                                    mamba_chunk_size=16, mamba_expand=2, num_local_experts=0, use_cache=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets)).train()


def test_the_fused_mixer_replaces_the_torch_path_and_bypasses_a_lora_on_out_proj() -> None:
    """Bound on transformers' own mixer: its training forward takes the fused branch (another timeline than the
    torch path's), and peft's LoRA on out_proj is never applied: its weights get no gradient, in_proj's do."""
    ids = torch.randint(0, 32, (2, 40))
    model = _granite(["in_proj", "out_proj"])
    assert mamba.kernelize_mamba(model) == 1
    assert mamba.bypassed_adapters(model) == ["base_model.model.model.layers.0.mamba"]
    fused = step_timeline(model, ids)
    grads = {n: p.grad is not None for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g == ("in_proj" in n) for n, g in grads.items()), grads
    assert fused != step_timeline(_granite(["in_proj", "out_proj"]), ids)


def _tiny_granite4(tmp_path: Path) -> Path:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("granitemoehybrid", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256, mamba_n_heads=4,
                               mamba_d_state=16, shared_intermediate_size=128, num_local_experts=0,
                               layer_types=["mamba", "attention"])
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string(use_diff=False))
    return path


def test_the_estimate_names_the_bypassed_out_proj_and_refuses_a_quantized_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Granite 4 traced: LoRA on every linear layer says its out_proj adapters are bypassed (not on q / v alone);
    QLoRA, whose out_proj is 4-bit, is refused with the reason (F.linear on the packed codes)."""
    from vramlab.core.cli import main
    from vramlab.core.spec.hub_kernels import MAMBA2_OUT_PROJ, QUANTIZED_OUT_PROJ

    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path / "cache"))
    path = str(_tiny_granite4(tmp_path))
    said = {}
    for targets in ("all-linear", "q_proj,v_proj"):
        assert main(["estimate", "--model", path, "--seq", "64", "--method", "lora", "--lora-targets", targets,
                     "--json"]) == 0
        said[targets] = " ".join(json.loads(capsys.readouterr().out)["notes"])
    assert MAMBA2_OUT_PROJ in said["all-linear"] and MAMBA2_OUT_PROJ not in said["q_proj,v_proj"]
    assert "mamba_split_conv1d_scan_combined" in said["q_proj,v_proj"]
    assert main(["estimate", "--model", path, "--seq", "64", "--method", "qlora"]) != 0
    assert QUANTIZED_OUT_PROJ in capsys.readouterr().err


def test_lfm2s_conv_runs_causal_conv1d_in_the_trace() -> None:
    """LFM2's short conv calls the decorated causal_conv1d_fn: bound, its step is not the torch path's (F.conv1d
    on an fp32 cast, the slice, the activation)."""
    import transformers as tf

    def model():  # noqa: ANN202
        cfg = tf.Lfm2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                            use_cache=False)
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()

    ids = torch.randint(0, 32, (2, 24))
    bound = model()
    assert mamba.kernelize_mamba(bound) == 0  # no Mamba-2 mixer
    assert causal_conv1d.kernelize_conv(bound) == 1  # its one conv layer
    assert step_timeline(bound, ids) != step_timeline(model(), ids)
