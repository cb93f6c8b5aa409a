"""TRL's fused-head objectives (DPO, IPO, KTO) on transformers' own classes (issue 28: every objective on every
path). The references of core/objectives/ ran on the built-in builder only, so a traced architecture refused
them; now transformers' class (+ peft) runs the same step (``add_fused_lm_head``'s backbone and head, peft's
``disable_adapter`` for a LoRA policy's reference, the trainer's autocast around the loss, the shards of a
reference copy), which also holds the builder's objective steps to transformers' classes, and the trace of a
traced architecture records it.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests.test_objectives import FAMILIES
from vramlab.core.checks import SetupError
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


@pytest.mark.parametrize("objective", ["orpo", "grpo"])
def test_the_objectives_that_need_the_builder_are_refused_on_transformers_classes(objective: str) -> None:
    more = dict(num_generations=2) if objective == "grpo" else {}
    setup = TrainingSetup(objective=objective, seq_len=96, completion_len=32, micro_batch=2, **more, **LORA)
    with pytest.raises(SetupError, match=f"--objective {objective} is not modelled on transformers' own classes"):
        simulate(FAMILIES["llama"], setup, hf=True)


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
