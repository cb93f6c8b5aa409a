"""The setup model: validation messages, derived precision facts, presets, units."""

from __future__ import annotations

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import DType, Method
from vramlab.core.spec.presets import PRECISION_PRESETS, matching_preset, precision_preset
from vramlab.core.spec.targets import parse_targets
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import GB, GiB, fmt_bytes, parse_size

TINY = ModelSpec(id="tiny", name="Tiny", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, vocab_size=100)


@pytest.mark.parametrize(("changes", "needle"), [
    ({"method": "qlora", "weights": "fp32"}, "--weights nf4"),
    ({"method": "full", "weights": "nf4"}, "--method qlora"),
    ({"method": "lora", "weights": "nf4"}, "QLoRA"),
    ({"micro_batch": 0}, "micro batch must be"),
    ({"seq_len": -3}, "sequence length must be"),
    ({"method": "freeze"}, "--trainable-layers"),
    ({"weights": "bf16", "compute": "fp32"}, "--weights fp32"),
    ({"offload": "optimizer"}, "--sharding"),
    ({"offload": "params", "sharding": "zero2"}, "zero3 or fsdp"),
    ({"optimizer_in_backward": True, "grad_accum": 4}, "--grad-accum 1"),
    ({"method": "lora", "lora_rank": 0}, "LoRA rank must be from 1"),
    ({"method": "lora", "lora_dropout": 1.5}, "dropout"),
    ({"optimizer": "lion", "optimizer_impl": "fused"}, "no fused lion"),
])
def test_invalid_setups_say_what_to_change(changes, needle):
    with pytest.raises(SetupError, match=needle.replace("-", r"\-").replace("(", r"\(")):
        TrainingSetup(**changes).validate(TINY)


def test_freeze_with_more_layers_than_the_model_has():
    with pytest.raises(SetupError, match="has 4 layers"):
        TrainingSetup(method="freeze", trainable_layers=9).validate(TINY)


def test_lora_target_missing_from_a_plain_mlp():
    plain = ModelSpec(id="p", name="Plain", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4,
                      intermediate_size=128, vocab_size=100, mlp_kind="plain")
    with pytest.raises(SetupError, match="no gate_proj"):
        TrainingSetup(method="lora", lora_targets="gate_proj").validate(plain)


def test_targets_parse_aliases_and_all_linear():
    assert parse_targets("v,q") == ("q_proj", "v_proj")
    assert parse_targets("all-linear") == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj")
    # any other module name is the model's to have (DeepSeek-V2's latent attention): kept, after the known ones
    assert parse_targets("kv_b_proj,v,kv_a_proj_with_mqa") == ("v_proj", "kv_b_proj", "kv_a_proj_with_mqa")
    with pytest.raises(SetupError, match="not a module name"):
        parse_targets("q_proj v_proj")


def test_defaults_resolve_per_method():
    assert TrainingSetup().weight_dtype is DType.BF16
    assert TrainingSetup(method="qlora").weight_dtype is DType.NF4
    r = TrainingSetup(micro_batch=4, grad_accum=8, gpus=2).resolved()
    assert r["effective_batch"] == 64
    assert r["optimizer_impl"] == "foreach"
    assert r["lora_rank"] is None  # not a LoRA setup


def test_precision_facts_are_separate():
    amp = TrainingSetup(weights="fp32", compute="bf16")
    assert amp.autocast and amp.grad_dtype is DType.FP32 and amp.state_dtype == "fp32"
    pure = TrainingSetup(weights="bf16", compute="bf16")
    assert not pure.autocast and pure.grad_dtype is DType.BF16 and pure.state_dtype == "bf16"
    master = TrainingSetup(weights="bf16", master_weights=True)
    assert master.has_master_copy and master.state_dtype == "fp32"
    lora = TrainingSetup(method="lora")
    assert lora.grad_dtype is DType.FP32  # peft keeps adapters in fp32
    trainer = TrainingSetup(method="lora", amp=True)
    assert trainer.autocast and trainer.precision_label() == "bf16 + autocast"


def test_presets_apply_and_are_recognised():
    for p in PRECISION_PRESETS:
        s = p.apply(TrainingSetup())
        s.validate(TINY)
        assert matching_preset(s) == p
    edited = precision_preset("qlora-nf4").apply(TrainingSetup()).replace(double_quant=False)
    assert matching_preset(edited) is None
    assert precision_preset("QLoRA - NF4").fields["method"] is Method.QLORA


def test_units_at_the_edge():
    assert fmt_bytes(13.5 * GB) == "12.57 GiB"
    assert fmt_bytes(24 * GiB, "GB") == "25.77 GB"
    assert parse_size("24GiB") == 24 * GiB
    assert parse_size("80 GB") == 80 * GB
    with pytest.raises(ValueError, match="24GiB"):
        parse_size("lots")


def test_setup_round_trips_through_resolved():
    s = TrainingSetup(method="lora", lora_rank=16, lora_targets="q,k,v", micro_batch=2, grad_ckpt=True)
    assert TrainingSetup.from_dict(s.resolved()).resolved() == s.resolved()


@pytest.mark.parametrize("s", [
    TrainingSetup(),
    TrainingSetup(method="lora", lora_rank=16, lora_targets="q,k,v", micro_batch=2, grad_ckpt=True),
    TrainingSetup(method="qlora", weights="nf4", amp=True, kbit_upcast=True),
    TrainingSetup(method="freeze", trainable_layers=3, optimizer="sgd_momentum"),
    TrainingSetup(optimizer="adamw8bit", sharding="zero3", gpus=4, offload="optimizer"),
])
def test_setup_round_trips_exactly_through_to_dict(s):
    """Unset fields stay unset: an edited, saved and reloaded setup keeps following the defaults."""
    import json

    back = TrainingSetup.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s


def test_precision_label_names_fp32_adapters():
    assert "fp32 adapters" in TrainingSetup(method="lora").precision_label()
    assert "adapters" not in TrainingSetup(method="lora", adapter_dtype="bf16").precision_label()
    assert "adapters" not in TrainingSetup().precision_label()


def test_lora_modules_are_the_same_kept_or_not_and_for_a_spec_that_cannot_be_kept():
    """lora_modules is kept per (spec, targets); a spec holding an unhashable value (a list read from a file)
    is answered without being kept, and any iterable of targets gives the same answer as a tuple."""
    import dataclasses

    from vramlab.core.catalog import find_model

    spec = find_model("phi-3-mini-4k")  # fused qkv and gate_up: q_proj names qkv_proj
    unhashable = dataclasses.replace(spec, notes=["read from a file"])
    for targets in (("q_proj", "v_proj"), ("gate_proj", "down_proj", "lm_head"), ("nope",)):
        kept = spec.lora_modules(targets)
        assert spec.lora_modules(list(targets)) == kept == spec.lora_modules(iter(targets))
        assert unhashable.lora_modules(targets) == kept
    assert spec.lora_modules(("q_proj", "v_proj")) == ("qkv_proj",)


def test_spec_hash_is_kept_per_spec_and_follows_its_fields():
    """A spec keeps its hash once made (the estimate looks it up many times): specs that are equal hash alike
    however they were made, a changed copy is not found under the original, and a copy made after the hash
    was kept is still equal to and found as the original."""
    import copy
    import dataclasses

    spec = dataclasses.replace(TINY, name="Tiny (hashed)")
    kept = {spec: "original"}
    changed = dataclasses.replace(spec, num_layers=spec.num_layers + 1)
    assert changed != spec and changed not in kept
    back = dataclasses.replace(changed, num_layers=spec.num_layers)  # hashed as changed first, then back
    hash(changed)
    assert back == spec and hash(back) == hash(spec) and kept[back] == "original"
    rebuilt = ModelSpec.from_dict(spec.to_dict())
    assert rebuilt == spec and kept[rebuilt] == "original"
    assert kept[copy.copy(spec)] == "original" and kept[copy.deepcopy(spec)] == "original"


def test_spec_hash_is_not_carried_to_another_process(tmp_path):
    """A string's hash differs between processes (hash randomization): a pickled spec must not bring the hash
    its first process kept, or a spec equal to it in the second would not be found under it."""
    import os
    import pickle
    import subprocess
    import sys

    spec = TINY
    hash(spec)  # kept in this process
    path = tmp_path / "spec.pickle"
    path.write_bytes(pickle.dumps(spec))
    code = ("import pickle, sys; from vramlab.core.spec.model import ModelSpec; "
            "s = pickle.loads(open(sys.argv[1], 'rb').read()); fresh = ModelSpec.from_dict(s.to_dict()); "
            "print(s == fresh and hash(s) == hash(fresh) and {fresh: 1}.get(s) == 1)")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed, "VRAMLAB_BLOCK_QT": "1"})
        assert out.stdout.strip() == "True", out.stderr


@pytest.mark.parametrize(("batch", "accum", "gens", "gpus"), [(3, 1, 8, 1), (2, 3, 4, 1), (2, 1, 6, 1), (5, 2, 4, 1)])
def test_grpos_divisibility_error_names_changes_that_each_fix_it(batch, accum, gens, gpus):
    """Each change the message names, applied alone, gives a generation batch TRL accepts."""
    import re

    setup = TrainingSetup(objective="grpo", method="lora", micro_batch=batch, grad_accum=accum, num_generations=gens,
                          gpus=gpus, sharding="zero2" if gpus > 1 else "none")
    with pytest.raises(SetupError) as e:
        setup.validate()
    fixes = re.findall(r"--(batch|steps-per-generation|num-generations) (\d+)", str(e.value).split("TRL's check")[1])
    assert {f for f, _ in fixes} == {"batch", "steps-per-generation", "num-generations"}
    field = {"batch": "micro_batch", "steps-per-generation": "steps_per_generation",
             "num-generations": "num_generations"}
    for flag, value in fixes:
        setup.replace(**{field[flag]: int(value)}).validate()
