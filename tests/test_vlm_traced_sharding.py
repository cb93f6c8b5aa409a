"""ZeRO-3 and FSDP on a traced vision-language model (issue 28: "the VLM path refuses ZeRO"): transformers' own
class of any image-text-to-text family is sharded as the text trace's is (core/simulation/shard.py
``shard_module``), with the units FSDP makes in the user's run: accelerate's transformer auto-wrap policy wraps
every module whose class the model names in ``_no_split_modules`` (the tower's blocks and the decoder layers for
most families; SmolVLM names its vision attention), the rest is the root unit. Before, every VLM refused
parameter sharding.

Tiny configs made by transformers' config classes (tests/support/traced_vlm.py)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("PIL")

from tests.support.traced_vlm import generic_configs, tiny_configs  # noqa: E402
from vramlab.core.kinds import Kind  # noqa: E402
from vramlab.core.sources.hf_config import hf_config_to_spec  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402

BASE = TrainingSetup(method="lora", vision_tuning="frozen", images=1, image_width=300, image_height=200, seq_len=64,
                     lora_rank=8, gpus=4)


def _spec(family: str):
    configs = {**tiny_configs(), **generic_configs()}
    return hf_config_to_spec(configs[family], id=family, name=family)[0]


@pytest.mark.parametrize("family", ["qwen2_vl", "smolvlm"])
def test_the_units_are_the_classes_the_model_names_for_fsdp(family):
    """What accelerate wraps: the classes of ``_no_split_modules`` the model holds, not the repeated layers."""
    import torch
    from transformers import CONFIG_MAPPING

    from vramlab.core.tracing.hfconfig import layer_stacks, wrapped_units
    from vramlab.core.tracing.vlm_traced import transformers_class

    cfg = dict(tiny_configs()[family])
    config = CONFIG_MAPPING[cfg.pop("model_type")].from_dict(cfg)
    with torch.device("meta"):
        model = transformers_class(config)._from_config(config)
    units = wrapped_units(model)
    names = set(model._no_split_modules)
    assert units and {type(u).__name__ for u in units} == {n for n in names
                                                           if any(type(m).__name__ == n for m in model.modules())}
    tower = [u for u in units if "Vision" in type(u).__name__]
    assert tower  # the tower's parts are units of their own, gathered around their forward
    stacks = [layer for _name, stack in layer_stacks(model) for layer in stack]
    # SmolVLM names its vision attention, not the encoder layer: FSDP gathers each layer's attention alone
    assert (units == stacks) == (family != "smolvlm")


@pytest.mark.parametrize("family,sharding,offload", [("qwen2_vl", "zero3", "none"), ("gemma4", "fsdp", "params")])
def test_parameter_sharding_on_a_traced_vlm_holds_the_shards(family, sharding, offload):
    from vramlab.core.simulation.simulate import simulate

    spec = _spec(family)
    setup = BASE.replace(sharding=sharding, offload=offload)
    one = simulate(spec, BASE.replace(gpus=1), steps=1)
    sim = simulate(spec, setup, steps=1)  # refused before: "... without parameter sharding ..."
    assert sim.peak_allocated_bytes < one.peak_allocated_bytes
    weights = one.components[Kind.WEIGHTS] + one.components[Kind.VISION_WEIGHTS]
    sharded = sim.components.get(Kind.WEIGHTS, 0) + sim.components.get(Kind.VISION_WEIGHTS, 0)
    # a quarter of every parameter and the units gathered at the peak (the root, most of a tiny model, among them);
    # with the parameters offloaded, the gathered units alone
    assert sharded < weights
    assert (sharded > weights / 4) == (offload == "none")


def test_a_lora_language_model_beside_a_fully_trained_tower_reduces_each_units_own_dtype():
    """LoRA's fp32 adapters on the decoder layers and a bf16 tower trained whole: FSDP2 reduce-scatters each
    unit's gradients in their own dtype (``foreach_reduce``). The sharder reduced every unit in the adapters'
    fp32 and then could not hand the tower's bf16 shards their gradients (a RuntimeError)."""
    from vramlab.core.simulation.simulate import simulate

    spec = _spec("qwen2_vl")
    setup = BASE.replace(vision_tuning="full", sharding="zero3")
    sim = simulate(spec, setup, steps=1)
    frozen = simulate(spec, setup.replace(vision_tuning="frozen"), steps=1)
    assert sim.trainable_params > frozen.trainable_params
    assert sim.peak_allocated_bytes > frozen.peak_allocated_bytes


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("VRAMLAB_TRACE_MATRIX"),
                    reason="fitted traces (30-100 s each on two cores): set VRAMLAB_TRACE_MATRIX=1")
@pytest.mark.parametrize("family,tune,option", [
    ("gemma4", "frozen", dict(sharding="zero3")),
    ("gemma4", "frozen", dict(sharding="fsdp", offload="optimizer", grad_ckpt=True)),
    ("glm4v", "full", dict(sharding="fsdp", method="full")),
    ("glm4v", "full", dict(sharding="zero3", grad_ckpt=True)),
    ("qwen3_5", "lora", dict(sharding="zero3", offload="params", grad_ckpt=True)),
])
def test_a_sharded_traced_vlm_tape_equals_simulate_hf(family, tune, option, tmp_path, monkeypatch):
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec = _spec(family)
    setup = BASE.replace(vision_tuning=tune, micro_batch=3, seq_len=100, lora_rank=16, **option)
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert est.source.startswith("traced")
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
