"""TRL's objectives on transformers' own classes (issue 28: every objective on every path). The references of
core/objectives/ ran on the built-in builder only, so a traced architecture refused them; now transformers' class
(+ peft) runs the same step: for DPO, IPO and KTO ``add_fused_lm_head``'s backbone and head, peft's
``disable_adapter`` for a LoRA policy's reference, the trainer's autocast around the loss, the shards of a reference
copy; for ORPO, CPO and SimPO the model's own forward without labels (its full logits, fp32 under autocast as
accelerate converts them); for GRPO its own forward and DynamicCache for the generation. This also holds the
builder's objective steps to transformers' classes, and the trace of a traced architecture records it.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests.test_objectives import FAMILIES, PAIR_FAMILIES
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation.simulate import simulate  # noqa: E402

LORA = dict(method="lora", lora_targets=("q_proj", "v_proj"))
CASES = {
    "dpo-lora": ("llama", dict(objective="dpo", **LORA)),
    "kto-lora": ("llama", dict(objective="kto", **LORA)),
    "ipo-qlora": ("llama", dict(objective="ipo", method="qlora", weights="nf4")),
    "dpo-lora-checkpointing-fp32-autocast": ("llama", dict(objective="dpo", grad_ckpt=True, weights="fp32",
                                                            amp=True, **LORA)),
    "dpo-full-reference-copy-zero3": ("llama", dict(objective="dpo", method="full", weights="bf16", sharding="zero3",
                                                    gpus=4)),
    "dpo-lora-checkpointing-qwen2": ("qwen2", dict(objective="dpo", grad_ckpt=True, **LORA)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_transformers_classes_run_the_objectives_step_as_the_builder_does(name: str) -> None:
    family, kw = CASES[name]
    spec = FAMILIES[family]
    setup = TrainingSetup(**{**dict(seq_len=96, completion_len=32, micro_batch=2), **kw})
    builder = simulate(spec, setup)
    hf = simulate(spec, setup, hf=True)  # refused before: "the dpo step runs on the built-in builder only"
    assert hf.source == "simulated (transformers + peft)"
    assert hf.peak_phase == builder.peak_phase
    assert abs(hf.peak_allocated_bytes - builder.peak_allocated_bytes) <= 4096
    # every phase within 0.2 % or 8 KiB, as tests/test_sharding_hf.py allows the SFT step: the emulated quantized
    # load's transients (QLoRA's load phase, 8.5 KiB of 5.2 MB) and autocast's casts in the forward (12 KiB of 23.8 MB)
    ours = {p.key: p.bytes for p in builder.phases}
    off = {p.key: p.bytes - ours[p.key] for p in hf.phases}
    assert all(abs(v) <= max(0.002 * ours[k], 8192) for k, v in off.items()), off


# ORPO / CPO / SimPO (trl.experimental): the model's own forward without labels and its full logits. The default
# run keeps one case per mechanism: the forward itself, accelerate's fp32 copy of the logits under autocast (with
# checkpointing), the root unit gathered under ZeRO-3, Gemma 2's softcap (the head's output not held past it)
PAIR_CASES = {
    "orpo-lora": ("llama", dict(objective="orpo", **LORA)),
    "orpo-lora-checkpointing-fp32-autocast": ("llama", dict(objective="orpo", grad_ckpt=True, weights="fp32",
                                                             amp=True, **LORA)),
    "cpo-full-zero3": ("llama", dict(objective="cpo", method="full", weights="bf16", sharding="zero3", gpus=4)),
    "simpo-lora-gemma2-softcap": ("gemma2", dict(objective="simpo", **LORA)),
}
SLOW_PAIR_CASES = {
    "simpo-qlora": ("llama", dict(objective="simpo", method="qlora", weights="nf4")),
    "simpo-qlora-autocast": ("llama", dict(objective="simpo", method="qlora", weights="nf4", amp=True)),
    "orpo-full-qwen2": ("qwen2", dict(objective="orpo", method="full")),
    "simpo-lora-dropout-accumulation": ("qwen2", dict(objective="simpo", method="lora", lora_dropout=0.1,
                                                      grad_accum=2)),
    "orpo-full-fsdp-mixed-precision": ("qwen2", dict(objective="orpo", method="full", weights="fp32", amp=True,
                                                     sharding="fsdp", gpus=2)),
    "orpo-full-zero3-offload": ("qwen2", dict(objective="orpo", method="full", sharding="zero3", offload="params",
                                              gpus=2)),
    "orpo-full-zero2": ("qwen2", dict(objective="orpo", method="full", sharding="zero2", gpus=2)),
    "orpo-qlora-fsdp": ("llama", dict(objective="orpo", method="qlora", weights="nf4", sharding="fsdp", gpus=2)),
    "cpo-lora-chunked-loss": ("llama", dict(objective="cpo", chunked_loss=True, **LORA)),  # the step without it
}


@pytest.mark.parametrize("name", [*PAIR_CASES, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_PAIR_CASES)])
def test_orpo_cpo_simpo_run_on_transformers_classes_as_the_builder_and_the_estimate_do(name: str) -> None:
    """Refused before ("not modelled on transformers' own classes yet"). Held three ways: the estimate equals the
    builder phase by phase, and transformers' class is within 2 KiB of both (the first HF build of a process keeps
    one 1 KiB buffer more; a quantized load's emulated transients are in the load phase only)."""
    _spec, _setup, off = _held_three_ways(*{**PAIR_CASES, **SLOW_PAIR_CASES}[name])
    assert all(abs(v) <= 2048 for k, v in off.items() if k != "load"), off


def _held_three_ways(family: str, kw: dict) -> tuple[object, TrainingSetup, dict[str, int]]:
    """Run ``kw`` three ways; assert the estimate equals the builder phase by phase and transformers' class is
    within 2 KiB of it at the same peak; return the class's offset from the builder per phase."""
    from vramlab.core.estimate import estimate

    spec = PAIR_FAMILIES[family]
    setup = TrainingSetup(**{**dict(seq_len=96, micro_batch=2), **kw})
    builder = simulate(spec, setup)
    hf = simulate(spec, setup, hf=True)
    est = estimate(spec, setup, match_simulation=True)
    assert hf.source == "simulated (transformers + peft)"
    assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in builder.phases}
    assert hf.peak_phase == builder.peak_phase
    assert abs(hf.peak_allocated_bytes - builder.peak_allocated_bytes) <= 2048
    ours = {p.key: p.bytes for p in builder.phases}
    return spec, setup, {p.key: p.bytes - ours[p.key] for p in hf.phases}


# GRPO: transformers' class generates with its own forward and DynamicCache (the loop of GenerationMixin._sample
# written out: its stopping checks read the sampled tokens), then scores and steps as DPO does. Default: LoRA with
# the adapters' reference under autocast; the rest slow
GRPO = dict(objective="grpo", num_generations=2, completion_len=8)
GRPO_CASES = {
    "grpo-lora-adapters-reference-autocast": ("qwen2", dict(**GRPO, weights="fp32", amp=True, beta=0.1, **LORA)),
}
SLOW_GRPO_CASES = {
    "grpo-lora-llama": ("llama", dict(**GRPO, **LORA)),
    "grpo-full-reference-copy-fsdp": ("qwen2", dict(**GRPO, method="full", beta=0.1, reference="copy",
                                                    sharding="fsdp", gpus=2)),
    "grpo-full-zero3-gathered-generation": ("qwen2", dict(**GRPO, method="full", sharding="zero3", gpus=2)),
    "grpo-full-two-iterations-accumulation": ("qwen2", dict(**GRPO, method="full", beta=0.04, num_iterations=2,
                                                            grad_accum=2)),
    "grpo-qlora-checkpointing": ("llama", dict(**GRPO, method="qlora", weights="nf4", grad_ckpt=True)),
    "grpo-lora-gemma2": ("gemma2", dict(**GRPO, **LORA)),
    "grpo-lora-vllm-colocate": ("llama", dict(**GRPO, generation_backend="vllm-colocate", **LORA)),
}


@pytest.mark.parametrize("name", [*GRPO_CASES, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_GRPO_CASES)])
def test_grpo_runs_on_transformers_classes_as_the_builder_and_the_estimate_do(name: str) -> None:
    """Refused before ("not modelled on transformers' own classes yet"). The estimate equals the builder phase by
    phase; transformers' class is within 2 KiB of both at the peak and in every phase but the load, the generation
    included: transformers' base model holds its input embeddings (``inputs_embeds``) to the end of its forward,
    and so do the builder and the estimate (under no_grad nothing else keeps them: a generation whose peak is inside
    the prompts' prefill, with a small vocabulary, was 44 KiB low here when they were freed after the first
    layer)."""
    offsets = _held_three_ways(*{**GRPO_CASES, **SLOW_GRPO_CASES}[name])[2]
    for key, off in offsets.items():
        if key != "load":
            assert abs(off) <= 2048, (key, off)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("VRAMLAB_TRACE_MATRIX"), reason="fitted traces (10-40 s on two cores): "
                    "set VRAMLAB_TRACE_MATRIX=1")
def test_a_traced_architecture_estimates_dpo_from_its_trace(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore

    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec = dataclasses.replace(FAMILIES["llama"], tape="traced")
    base = TrainingSetup(seq_len=96, completion_len=32, micro_batch=2, objective="dpo", **LORA)
    for b, s in ((2, 96), (3, 160)):  # the second from the first's fitted tape
        setup = base.replace(micro_batch=b, seq_len=s)
        est = estimate(spec, setup, match_simulation=True)
        assert est.source.startswith("traced")
        assert est.peak_allocated_bytes == simulate(spec, setup, hf=True).peak_allocated_bytes


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("VRAMLAB_TRACE_MATRIX"), reason="fitted traces (10-40 s on two cores): "
                    "set VRAMLAB_TRACE_MATRIX=1")
@pytest.mark.parametrize("objective", ["orpo", "simpo", "grpo"])
def test_a_traced_architecture_estimates_orpo_simpo_and_grpo_from_its_trace(objective: str, tmp_path,  # noqa: ANN001
                                                                       monkeypatch) -> None:  # noqa: ANN001
    """ORPO's labels are its ids, CPO / SimPO's the collator's; GRPO generates (the trace records every decoding
    step, 60-90 s): each traced, the second size answered from the first size's fitted tape (refused before: "not
    modelled on transformers' own classes yet")."""
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore

    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec = dataclasses.replace(FAMILIES["llama"], tape="traced")
    more = dict(num_generations=2, completion_len=8) if objective == "grpo" else {}
    base = TrainingSetup(seq_len=96, micro_batch=2, objective=objective, **more, **LORA)
    for b, s in ((2, 96), (4, 160)):  # the second from the first's fitted tape
        setup = base.replace(micro_batch=b, seq_len=s)
        est = estimate(spec, setup, match_simulation=True)
        assert est.source.startswith("traced")
        assert est.peak_allocated_bytes == simulate(spec, setup, hf=True).peak_allocated_bytes
