"""peft's LoRA variants (issue 29, item 5): DoRA and rsLoRA, held to peft 0.21.2 itself under fake tensors.

DoRA (``LoraConfig(use_dora=True)``, peft's ``tuners/lora/dora.py`` and ``variants.py``) keeps a magnitude vector
per adapted module and, in every forward, builds the adapter's full weight through an input-width identity, the
base weight in the adapter dtype and the weight norm of their sum, and keeps the base output for backward. The
estimate (the hand-written program) and the builder model it; ``simulate --hf`` runs peft's own layer. They agree
within the 8 KiB the plain LoRA comparison allows (HF's few small tensors), phase by phase, except
the load phase: peft adds the magnitudes after the model is built (its three weight-sized temporaries then sit
on all the weights), which the note names and which stays below the training peak.

rsLoRA changes only the scaling: peft's own run keeps the same bytes, and so does the estimate.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=1000)
QWEN2 = ModelSpec(id="qwen2", name="Qwen2-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=1000, qkv_bias=True, tie_embeddings=True)
DORA = TrainingSetup(method="lora", use_dora=True)
CASES = [
    ("llama-qv", LLAMA, DORA),
    ("qwen2-bias-all-linear", QWEN2, DORA.replace(lora_targets="all-linear")),
    ("llama-dropout-batch2", LLAMA, DORA.replace(lora_dropout=0.1, micro_batch=2, seq_len=256)),
    ("llama-amp-fp32-dropout", LLAMA, DORA.replace(weights="fp32", lora_dropout=0.1, lora_targets="all-linear")),
    ("llama-reentrant-ckpt", LLAMA, DORA.replace(grad_ckpt=True, ckpt_reentrant=True)),
    # under autocast ``m / norm * lora_result`` promotes the 16-bit adapter output to the fp32 magnitude's dtype:
    # MulBackward returns both full-size fp32 gradients before autograd sums the magnitude's and casts the adapter
    # output's (a 64-token vocabulary leaves the backward's peak there: one b x s x out fp32 tensor low before)
    ("llama-amp-fp32-small-vocab", dataclasses.replace(LLAMA, vocab_size=64),
     DORA.replace(weights="fp32", amp=True, lora_targets="all-linear", seq_len=512)),
]
SLACK = 8 * 1024


@pytest.mark.parametrize("spec,setup", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_dora_estimate_matches_peft_under_fake_tensors(spec, setup):
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    ref = simulate(spec, setup, hf=True)
    est = estimate(spec, setup, match_simulation=True)
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= SLACK
    assert est.peak_phase == ref.peak_phase
    for p, q in zip(est.phases, ref.phases, strict=True):
        assert p.key == q.key
        if p.key == "load":  # peft's magnitudes come after the build: its temporaries on top of all weights
            assert 0 <= q.bytes - p.bytes
            continue
        assert abs(p.bytes - q.bytes) <= SLACK, p.key
    # the builder (simulate without --hf) is the program's mirror, to the byte
    assert simulate(spec, setup).peak_allocated_bytes == est.peak_allocated_bytes
    assert est.trainable_params == ref.trainable_params


def test_dora_at_a_short_sequence_peaks_in_its_forward_temporaries_within_one_hidden_state():
    """At a short sequence the peak is DoRA's forward temporaries inside a layer; there transformers' decoder layer
    holds one more hidden-state tensor (b x s x hidden, compute dtype) than the hand-written layer at that moment
    (left to find: the same moment without DoRA is never the peak)."""
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    setup = DORA.replace(lora_targets="all-linear", seq_len=64)
    ref = simulate(LLAMA, setup, hf=True)
    est = estimate(LLAMA, setup, match_simulation=True)
    assert ref.peak_phase == est.peak_phase == "forward@2"
    hidden = setup.micro_batch * setup.seq_len * LLAMA.hidden_size * setup.compute.itemsize
    assert 0 <= ref.peak_allocated_bytes - est.peak_allocated_bytes <= hidden + SLACK


def test_dora_costs_what_peft_adds_over_lora():
    """DoRA's extra bytes are peft's, not a constant: the difference to plain LoRA at the peak matches peft's."""
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    setup = DORA.replace(lora_targets="all-linear")
    plain = setup.replace(use_dora=False)
    ref = simulate(LLAMA, setup, hf=True).peak_allocated_bytes - simulate(LLAMA, plain, hf=True).peak_allocated_bytes
    ours = estimate(LLAMA, setup, match_simulation=True).peak_allocated_bytes \
        - estimate(LLAMA, plain, match_simulation=True).peak_allocated_bytes
    assert ref > 0
    assert abs(ours - ref) <= SLACK


def test_rslora_changes_no_bytes_in_peft_or_the_estimate():
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    setup = TrainingSetup(method="lora", lora_targets="all-linear", lora_rank=16)
    rs = setup.replace(use_rslora=True)
    assert simulate(LLAMA, rs, hf=True).peak_allocated_bytes == simulate(LLAMA, setup, hf=True).peak_allocated_bytes
    est = estimate(LLAMA, rs)
    assert est.peak_allocated_bytes == estimate(LLAMA, setup).peak_allocated_bytes
    assert any("rsLoRA" in n for n in est.notes)


def test_dora_is_named_and_refused_where_not_modelled():
    est = estimate(LLAMA, DORA)
    assert any(n.startswith("DoRA (peft 0.21.2)") for n in est.notes)
    assert est.setup.resolved()["use_dora"] is True
    with pytest.raises(SetupError, match="--dora"):
        TrainingSetup(use_dora=True).validate()
    with pytest.raises(SetupError, match="quantized base"):
        TrainingSetup(method="qlora", use_dora=True).validate()
    assert TrainingSetup().resolved()["use_dora"] is None


def test_cli_flags_and_training_configs_turn_them_on(tmp_path):
    from vramlab.core.sources.training import read_training_configs

    files = {
        "axolotl.yaml": "base_model: x\nadapter: lora\nlora_r: 8\npeft_use_dora: true\npeft_use_rslora: true\n",
        "llamafactory.yaml": "model_name_or_path: x\nstage: sft\nfinetuning_type: lora\nuse_dora: true\n"
                             "use_rslora: true\n",
    }
    trl = (Path(__file__).parent / "fixtures" / "training" / "trl_sft_qlora.yaml").read_text()
    files["trl.yaml"] = trl + "\nuse_dora: true\nuse_rslora: true\n"
    files["swift.sh"] = ("swift sft --model Qwen/Qwen2.5-7B --tuner_type lora --max_length 1024 --use_dora true "
                         "--use_rslora true\n")
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text)
        src = read_training_configs([path])
        assert src.changes.get("use_dora") is True and src.changes.get("use_rslora") is True, name

    from vramlab.core.cli import main

    assert main(["estimate", "--model", "llama-3.2-1b", "--method", "lora", "--dora", "--rslora", "--json"]) == 0
    assert main(["estimate", "--model", "llama-3.2-1b", "--dora"]) == 2
    assert main(["estimate", "--model", "llama-3.2-1b", "--method", "lora", "--lora-fa", "--json"]) == 0
    assert main(["estimate", "--model", "llama-3.2-1b", "--method", "lora", "--lora-fa", "--optimizer", "lion"]) == 2


def test_the_trace_follows_peft_dora_at_fitted_sizes(tmp_path):
    """The traced tape runs peft's own DoRA layer: equal to simulate --hf at a point off the fitted ones."""
    pytest.importorskip("peft")
    import dataclasses

    from tests.support.trace_cache import isolated_traces
    from vramlab.core.simulation.simulate import simulate

    setup = DORA.replace(lora_targets="all-linear", seq_len=256)
    with isolated_traces(tmp_path):
        traced = estimate(dataclasses.replace(LLAMA, tape="traced"), setup.replace(lora_rank=32, micro_batch=2),
                          match_simulation=True)
    assert traced.peak_allocated_bytes == simulate(LLAMA, setup.replace(lora_rank=32, micro_batch=2),
                                                   hf=True).peak_allocated_bytes


FA = TrainingSetup(method="lora", lora_fa=True)
LORA_FA = [("llama-all-linear", LLAMA, FA.replace(lora_targets="all-linear", seq_len=64)),
           ("qwen2-qv-rslora-batch2", QWEN2, FA.replace(use_rslora=True, micro_batch=2, seq_len=128, lora_rank=16))]


@pytest.mark.parametrize("spec,setup", [c[1:] for c in LORA_FA], ids=[c[0] for c in LORA_FA])
def test_lora_fa_matches_peft_own_optimizer_under_fake_tensors(spec, setup):
    """LoRA-FA: A frozen (no gradient, no state, no input kept for it) and peft's own LoraFAOptimizer stepping each B,
    run under fake tensors in the reference, phase by phase; the trainable count is B's alone."""
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    ref = simulate(spec, setup, hf=True)
    est = estimate(spec, setup, match_simulation=True)
    plain = estimate(spec, setup.replace(lora_fa=False), match_simulation=True)
    assert est.peak_allocated_bytes < plain.peak_allocated_bytes
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= SLACK
    for p, q in zip(est.phases, ref.phases, strict=True):
        assert p.key == q.key and abs(p.bytes - q.bytes) <= SLACK, p.key
    assert simulate(spec, setup).peak_allocated_bytes == est.peak_allocated_bytes
    assert est.trainable_params == ref.trainable_params < plain.trainable_params
    assert any(n.startswith("LoRA-FA (peft 0.21.2") for n in est.notes)


def test_lora_fa_is_refused_where_peft_cannot_run_it():
    with pytest.raises(SetupError, match="magnitude"):
        TrainingSetup(method="lora", lora_fa=True, use_dora=True).validate()
    with pytest.raises(SetupError, match="own optimizer"):
        TrainingSetup(method="lora", lora_fa=True, optimizer="adamw8bit").validate()
    with pytest.raises(SetupError, match="--lora-fa"):
        TrainingSetup(lora_fa=True).validate()
