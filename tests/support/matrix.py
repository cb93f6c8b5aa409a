"""A deterministic matrix of setups over preset models: every method, precision, optimizer and
implementation, checkpointing on and off, batch 1-8, sequence 128-8192.

Every ``FULL_DEPTH_EVERY``-th setup keeps the preset's full depth; the others keep every width of the
preset (hidden size, heads, vocabulary, MLP, experts, biases, norms) but ``SHALLOW_LAYERS`` decoder layers.
A fake-tensor step costs ~0.1 ms per op, so depth is what a simulation's time is made of, while the
estimator replays one layer and multiplies it: a shallow model still has a first, a middle and a last
layer (where checkpointing, sharding units and the start of backward differ), and the full-depth setups
hold the multiplication to the simulation."""

from __future__ import annotations

import dataclasses
import itertools
import random

from vramlab.core.catalog import find_model
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

MODELS = ("qwen2.5-0.5b", "smollm2-135m", "llama-3.2-1b", "tinyllama-1.1b", "gemma-2-2b", "phi-1.5",
          "qwen3-0.6b", "gpt2", "pythia-160m", "llama-2-7b", "mistral-7b-v0.1", "mixtral-8x7b")
PRECISIONS = (
    {"weights": "bf16", "compute": "bf16"},
    {"weights": "fp32", "compute": "bf16"},
    {"weights": "fp32", "compute": "fp32"},
    {"weights": "fp32", "compute": "fp16"},
    {"weights": "bf16", "compute": "bf16", "master_weights": True},
)
OPTIMIZERS = (
    {"optimizer": "adamw", "optimizer_impl": "foreach"}, {"optimizer": "adamw", "optimizer_impl": "fused"},
    {"optimizer": "adamw", "optimizer_impl": "single"}, {"optimizer": "adamw8bit"},
    {"optimizer": "paged_adamw8bit"}, {"optimizer": "sgd"}, {"optimizer": "sgd_momentum"},
    {"optimizer": "adafactor"}, {"optimizer": "lion"},
)
METHODS = (
    {"method": "full"},
    {"method": "lora", "lora_targets": ("q_proj", "v_proj")},
    {"method": "lora", "lora_targets": "all-linear", "lora_rank": 16},
    {"method": "lora", "lora_dropout": 0.05, "amp": True},
    {"method": "qlora", "lora_targets": "all-linear"},
    {"method": "qlora", "weights": "int8"},
    {"method": "qlora", "kbit_upcast": True, "amp": True, "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj")},
    {"method": "freeze", "trainable_layers": 2},
)
SHARDINGS = (
    {"sharding": "zero1", "gpus": 4}, {"sharding": "zero2", "gpus": 8}, {"sharding": "zero3", "gpus": 4},
    {"sharding": "fsdp", "gpus": 2}, {"sharding": "fsdp", "gpus": 8},
    {"sharding": "zero2", "gpus": 4, "offload": "optimizer"},
    {"sharding": "zero3", "gpus": 4, "offload": "params"},
)
BATCH_SEQ = ((1, 128), (2, 512), (4, 1024), (8, 256), (1, 2048), (1, 4096), (2, 8192))
FULL_DEPTH_EVERY = 8
SHALLOW_LAYERS = 4


def shallow(spec: ModelSpec, layers: int = SHALLOW_LAYERS) -> ModelSpec:
    """``spec`` with ``layers`` decoder layers and every width kept (no published total to match)."""
    if spec.num_layers <= layers:
        return spec
    return dataclasses.replace(spec, id=f"{spec.id}-{layers}l", name=f"{spec.name} ({layers} layers)",
                               num_layers=layers, published_params=None)


def setups(count: int = 110, seed: int = 7) -> list[tuple[ModelSpec, TrainingSetup, str]]:
    rng = random.Random(seed)
    out: list[tuple[ModelSpec, TrainingSetup, str]] = []
    combos = list(itertools.product(range(len(MODELS)), range(len(METHODS))))
    rng.shuffle(combos)
    i = 0
    while len(out) < count:
        mi, me = combos[i % len(combos)]
        i += 1
        spec = find_model(MODELS[mi])
        fields: dict = dict(METHODS[me])
        if fields["method"] in ("full", "freeze"):
            fields.update(rng.choice(PRECISIONS))
        fields.update(rng.choice(OPTIMIZERS))
        b, s = rng.choice(BATCH_SEQ)
        if spec.is_moe and sum(1 for m, _s, _l in out if m.is_moe) >= 2:
            continue  # an MoE simulation takes ~16 s: two of them cover the routing
        if spec.num_layers * spec.hidden_size > 32 * 4096 // 2 or spec.is_moe:
            b, s = rng.choice(BATCH_SEQ[:5])  # big or MoE models: keep the simulation quick
        fields.update(micro_batch=b, seq_len=s, grad_ckpt=rng.random() < 0.4)
        if rng.random() < 0.15:
            fields["grad_accum"] = 2
        if rng.random() < 0.1:
            fields["attention"] = "eager"
            fields["seq_len"] = min(fields["seq_len"], 1024)
        if rng.random() < 0.08:
            fields["chunked_loss"] = True
        if rng.random() < 0.2 and not fields.get("optimizer_in_backward"):
            fields.update(rng.choice(SHARDINGS))
        if len(out) % 10 == 5 and fields["method"] != "qlora" and fields.get("weights", "bf16") == "bf16" \
                and fields.get("compute", "bf16") == "bf16":
            fields.update(weights="fp16", compute="fp16")  # fp16 storage (T4 / V100 users), drawing nothing
        setup = TrainingSetup(**fields)
        try:
            setup.validate(spec)
        except ValueError:
            continue
        index = len(out)
        if index % FULL_DEPTH_EVERY:
            spec = shallow(spec)
            setup.validate(spec)
        label = f"{spec.id}-{index:03d}"
        out.append((spec, setup, label))
    return out
