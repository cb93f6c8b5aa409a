"""Unsloth's own gradient checkpointing (``--unsloth-gc``, ``use_gradient_checkpointing="unsloth"``; issue 29 item 5).

unsloth_zoo 2026.10.9's ``UnslothCheckpointFunction`` as a transformation of the step's checkpoint function
(core/simulation/unsloth_gc.py; the estimate's core/estimator/unsloth_gc.py): the estimate equals the built-in
builder phase by phase and transformers' classes within their few buffers, and, where unsloth_zoo's wheel is
unpacked (``make conformance``), the builder and transformers' classes with unsloth_zoo's own function in VRAM Lab's
place equal VRAM Lab's to the byte.
"""

from __future__ import annotations

import pytest

from tests.support.three_ways import held_three_ways
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=512, num_heads=4, num_kv_heads=2,
                  intermediate_size=1024, vocab_size=512)
# a layer input of 3 x 1024 x 512 bf16 = 3 MiB: over unsloth_zoo's 2 MiB, offloaded
UNSLOTH = TrainingSetup(method="lora", lora_targets="all-linear", micro_batch=3, seq_len=1024, grad_ckpt=True,
                        unsloth_gc=True, hub_kernels=False)
INPUT = 3 * 1024 * 512 * 2


def _phases(r) -> dict[str, int]:  # noqa: ANN001
    return {p.key: p.bytes for p in r.phases}


def test_the_estimate_matches_unsloths_checkpointing_on_transformers_classes() -> None:
    est, reentrant = held_three_ways(LLAMA, UNSLOTH, UNSLOTH.replace(unsloth_gc=False, ckpt_reentrant=True))
    ours, theirs = _phases(est), _phases(reentrant)
    # what stays on the GPU between steps: the staging buffer grown to one layer input and buffer B at its initial
    # 2 MiB after the first pass; both grown to the input once double buffering is on (the second pass)
    assert ours["optimizer@1"] - theirs["optimizer@1"] == INPUT + 2 * 1024 * 1024
    assert ours["optimizer@2"] - theirs["optimizer@2"] == 2 * INPUT
    assert est.models_versions()["unsloth_gc"] == {"unsloth": "2026.10.9", "unsloth_zoo": "2026.10.9"}


@pytest.mark.slow
def test_the_traced_estimate_is_transformers_classes_at_the_sizes_asked() -> None:
    import dataclasses

    from vramlab.core.simulation.simulate import simulate

    est = estimate(dataclasses.replace(LLAMA, tape="traced"), UNSLOTH, match_simulation=True)
    assert est.source.startswith("traced")  # the layers fitted at the batch and sequence asked (its 2 MiB threshold)
    assert _phases(est) == _phases(simulate(LLAMA, UNSLOTH, hf=True))


def test_what_unsloth_does_not_offload_changes_nothing() -> None:
    reentrant = UNSLOTH.replace(unsloth_gc=False, ckpt_reentrant=True)
    small = {"micro_batch": 1, "seq_len": 512}  # 512 x 512 bf16: not over 2 MiB, kept as the reentrant one keeps it
    assert _phases(estimate(LLAMA, UNSLOTH.replace(**small))) == _phases(estimate(LLAMA, reentrant.replace(**small)))
    short = UNSLOTH.replace(seq_len=256, micro_batch=16)  # below 512 tokens unsloth checkpoints as usual
    result = estimate(LLAMA, short)
    assert _phases(result) == _phases(estimate(LLAMA, short.replace(unsloth_gc=False)))
    assert any("below 512 tokens" in w for w in result.warnings)
    assert UNSLOTH.replace(grad_ckpt=False).resolved()["unsloth_gc"] is None


@pytest.mark.parametrize("change", [{"ckpt_offload": True}, {"sharding": "fsdp", "gpus": 2},
                                    {"offload_activations": "trl"}])
def test_what_unsloth_does_not_run_or_is_not_modelled_is_refused(change: dict) -> None:
    with pytest.raises(SetupError):
        estimate(LLAMA, UNSLOTH.replace(**change))


def test_llamafactorys_use_unsloth_turns_it_on(tmp_path) -> None:  # noqa: ANN001
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / "lf.yaml"
    cfg.write_text("stage: sft\nfinetuning_type: lora\ncutoff_len: 1024\nuse_unsloth: true\n")
    assert read_training_configs([cfg]).changes["unsloth_gc"] is True
    cfg.write_text("stage: sft\nfinetuning_type: lora\ncutoff_len: 1024\nuse_unsloth: true\nuse_unsloth_gc: true\n")
    changes = read_training_configs([cfg]).changes  # LLaMA-Factory's own function replaces unsloth's
    assert changes["ckpt_offload"] is True and "unsloth_gc" not in changes
    cfg.write_text("stage: sft\nfinetuning_type: lora\nuse_unsloth: true\ndisable_gradient_checkpointing: true\n")
    assert "unsloth_gc" not in read_training_configs([cfg]).changes


def test_the_cli_flag(tmp_path, capsys) -> None:  # noqa: ANN001
    import json

    from vramlab.core.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 1024,
                                  "vocab_size": 512}))
    assert main(["estimate", "--model", str(config), "--unsloth-gc"]) == 0
    assert "--unsloth-gc does not apply" in "".join(capsys.readouterr())
    assert main(["estimate", "--model", str(config), "--grad-ckpt", "--unsloth-gc", "--grad-ckpt-offload"]) == 2


# ---- against unsloth_zoo's own function (a conformance check: unsloth_zoo imports only with a GPU, so its
# gradient_checkpointing.py is read from the unpacked wheel named by VRAMLAB_UNSLOTH_SRC and run on CPU under fake
# tensors, its streams and device queries stubbed: tests/support/unsloth_zoo_gc.py)

@pytest.mark.parametrize(("hf", "change"), [
    (True, {}), pytest.param(False, {}, marks=pytest.mark.slow),
    pytest.param(True, {"method": "full", "weights": "fp32"}, marks=pytest.mark.slow)],  # fp32 inputs stored bf16
    ids=["lora_transformers", "lora_builder", "full_fp32_transformers"])
def test_the_checkpointing_is_unsloth_zoos_own(hf: bool, change: dict) -> None:
    from tests.support import unsloth_zoo_gc
    from vramlab.core.simulation.simulate import simulate

    unsloth_zoo_gc.source()
    setup = UNSLOTH.replace(**change)
    ours = simulate(LLAMA, setup, hf=hf)
    with pytest.MonkeyPatch.context() as mp:
        unsloth_zoo_gc.in_place_of_ours(mp)
        theirs = simulate(LLAMA, setup, hf=hf)
    assert _phases(ours) == _phases(theirs)


def test_a_view_input_is_sized_by_its_own_elements_as_unsloth_sizes_it():
    """unsloth sizes an input by ``numel() * itemsize``; a view has no bytes of its own on the engine, so the
    estimator's decision for a 4 MiB view of a larger tensor must be the reference's (offloaded), not size 0."""
    import torch

    from vramlab.core.estimator.engine import Engine
    from vramlab.core.estimator.poly import Poly
    from vramlab.core.estimator.unsloth_gc import UnslothGC
    from vramlab.core.simulation.unsloth_gc import UnslothGC as Reference

    base = torch.empty(2, 2 * 1024 * 1024, dtype=torch.bfloat16)
    reference = Reference().offloads(base[0])
    engine = Engine()
    h = engine.alloc(base.numel() * 2, rg=True)
    h.numel, h.dtype = Poly.of(base.numel()), "bf16"
    view = engine.view(h, numel=Poly.of(base[0].numel()))
    assert reference is True
    assert (UnslothGC(engine).offload(view) is not None) == reference
