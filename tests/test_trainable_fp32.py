"""``trainable_fp32`` (``--trainable-fp32``): the trainable parameters upcast to fp32 beside 16-bit frozen ones,
trained under autocast, as LLaMA-Factory 0.9.5's ``init_adapter`` leaves a freeze run. The estimate equals the
built-in builder to the byte (every phase, every component) and transformers' own classes within the tolerance
the other references keep; full fine-tuning with it is the fp32-weights run it amounts to."""

from __future__ import annotations

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("torch")

from vramlab.core.simulation.simulate import simulate  # noqa: E402

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, vocab_size=300)
TIED = ModelSpec(id="tied", name="Tied", num_layers=3, hidden_size=96, num_heads=3, num_kv_heads=1,
                 intermediate_size=192, vocab_size=257, tie_embeddings=True, qkv_bias=True)
PHI = ModelSpec(id="phi", name="Phi", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=4,
                intermediate_size=256, vocab_size=200, parallel_block=True, norms_per_layer=1,
                norm_kind="layernorm", mlp_kind="plain", activation="gelu_tanh", qkv_bias=True, o_bias=True,
                mlp_bias=True, lm_head_bias=True, learned_positions=True, max_position_embeddings=512)
BASE = {"weights": "bf16", "compute": "bf16", "trainable_fp32": True, "micro_batch": 2, "seq_len": 64}
FREEZE = {"method": "freeze", "trainable_layers": 2}

CASES = [
    (LLAMA, FREEZE),
    (LLAMA, {**FREEZE, "grad_ckpt": True}),
    (LLAMA, {**FREEZE, "grad_ckpt": True, "ckpt_reentrant": True}),
    (LLAMA, {**FREEZE, "freeze_extra": ("embed_tokens",)}),
    (LLAMA, {**FREEZE, "freeze_extra": ("norm", "lm_head"), "chunked_loss": True}),
    (LLAMA, {**FREEZE, "weights": "fp16", "compute": "fp16", "attention": "eager"}),
    (LLAMA, {**FREEZE, "gpus": 2, "sharding": "zero2", "optimizer": "adamw8bit"}),
    (TIED, {**FREEZE, "freeze_extra": ("lm_head",)}),
    (TIED, {**FREEZE, "freeze_extra": ("embed_tokens",)}),
    (PHI, {**FREEZE, "trainable_layers": 1}),
    (LLAMA, {"method": "full"}),
]


def _setup(change: dict) -> TrainingSetup:
    return TrainingSetup(**{**BASE, **change})


def _levels(r) -> tuple:  # noqa: ANN001 - a MemoryResult
    return r.peak_allocated_bytes, dict(r.components), [(p.key, p.bytes) for p in r.phases]


@pytest.mark.parametrize(("spec", "change"), CASES, ids=range(len(CASES)))
def test_the_estimate_equals_the_builder_to_the_byte(spec, change):
    setup = _setup(change)
    assert setup.autocast  # fp32 parameters in a 16-bit model: torch AMP without asking
    assert _levels(estimate(spec, setup, match_simulation=True, calibration=None)) == _levels(simulate(spec, setup))


@pytest.mark.parametrize(("spec", "change"), [CASES[0], CASES[1], CASES[4], CASES[7], CASES[10]], ids=range(5))
def test_the_builder_is_held_to_transformers_classes(spec, change):
    """Every phase within 8 KiB but the load, where transformers' build is cast as LLaMA-Factory casts it, one
    parameter at a time (``param.data = param.data.to(torch.float32)``): its 16-bit copy lives beside its fp32
    one for a moment, which the builder and the estimate (each parameter made fp32) leave out; under the peak,
    which holds every trained parameter's fp32 gradient or state (4 bytes each or more)."""
    setup = _setup(change)
    ours, ref = simulate(spec, setup), simulate(spec, setup, hf=True)
    assert abs(ours.peak_allocated_bytes - ref.peak_allocated_bytes) <= 8 * 1024
    largest = max(spec.vocab_size * spec.hidden_size, spec.intermediate_size * spec.hidden_size)
    for p, q in zip(ours.phases, ref.phases, strict=True):
        assert p.key == q.key
        if p.key == "load":
            assert 0 <= q.bytes - p.bytes <= 2 * largest
        else:
            assert abs(p.bytes - q.bytes) <= 8 * 1024


def test_the_trained_layers_hold_fp32_weights_and_states_the_frozen_ones_do_not():
    # every tensor a multiple of CUDA's 512-byte block in bf16, so that the rounding hides no byte
    spec = ModelSpec(id="llama", name="Llama-ish", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                     intermediate_size=512, vocab_size=512)
    setup = _setup(FREEZE)
    up, pure = estimate(spec, setup, calibration=None), estimate(spec, setup.replace(trainable_fp32=False, amp=True),
                                                                 calibration=None)
    trained = up.trainable_params
    assert 0 < trained < up.total_params
    load = {p.key: p.bytes for p in up.phases}["load"] - {p.key: p.bytes for p in pure.phases}["load"]
    assert load == 2 * trained  # two more bytes for each trained weight, none for the frozen ones
    assert up.peak_allocated_bytes > pure.peak_allocated_bytes


def test_full_fine_tuning_upcast_is_the_fp32_weights_run():
    up = estimate(LLAMA, _setup({"method": "full"}), calibration=None)
    fp32 = estimate(LLAMA, TrainingSetup(**{**BASE, "trainable_fp32": False, "weights": "fp32"}), calibration=None)
    assert up.peak_allocated_bytes == fp32.peak_allocated_bytes and up.components == fp32.components


def test_lora_adapters_are_fp32_already():
    lora = TrainingSetup(**{**BASE, "method": "lora", "trainable_fp32": False})
    assert _levels(estimate(LLAMA, lora.replace(trainable_fp32=True), calibration=None)) == \
        _levels(estimate(LLAMA, lora, calibration=None))


@pytest.mark.parametrize(("change", "needle"), [
    ({**FREEZE, "gpus": 2, "sharding": "zero3"}, "ZeRO-3"),
    ({**FREEZE, "amp": False}, "autocast"),
    ({"method": "lora", "adapter_dtype": "bf16"}, "adapters"),
])
def test_what_is_not_modelled_is_refused_with_its_reason(change, needle):
    with pytest.raises(SetupError, match=needle):
        _setup(change).validate(LLAMA)


def test_the_cli_flag_and_the_label(capsys):
    import json

    from vramlab.core.cli import main

    assert main(["estimate", "-m", "llama-2-7b", "--fast", "--json", "--method", "freeze", "--trainable-layers", "2",
                 "--trainable-fp32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["trainable_fp32"] is True and out["setup"]["amp"] is True
    assert main(["estimate", "-m", "llama-2-7b", "--fast", "--method", "freeze", "--trainable-layers", "2",
                 "--trainable-fp32"]) == 0
    assert "fp32 trainable, bf16 frozen" in capsys.readouterr().out
