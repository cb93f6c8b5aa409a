"""The fast simulation (meta tensors, op cache) against the reference (FakeTensorMode): every allocation,
free, timeline point, phase mark and peak equal, over small setups that take the builder's different roads.
The whole accuracy matrix is compared by benchmarks/simulate_identity.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.support import simulate_paths
from vramlab.core.simulation import composite, fakeref, metasim
from vramlab.core.simulation.fakeref import FakeReferences
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

GQA = ModelSpec(id="gqa", name="Gqa", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                intermediate_size=256, vocab_size=300)
WINDOW = dataclasses.replace(GQA, id="window", sliding_window=48)  # SDPA with a boolean mask from s >= window
MOE = ModelSpec(id="moe", name="Moe", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                intermediate_size=128, vocab_size=200, num_experts=4, experts_per_token=2)
GEMMA = ModelSpec(id="gemma", name="Gemma-ish", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1,
                  intermediate_size=128, vocab_size=256, scale_embeddings=True, tie_embeddings=True,
                  activation="gelu_tanh", norms_per_layer=4, final_logit_softcap=30.0, attn_logit_softcap=50.0)
PHI = ModelSpec(id="phi", name="Phi", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4,
                intermediate_size=256, vocab_size=200, parallel_block=True, norms_per_layer=1,
                norm_kind="layernorm", mlp_kind="plain", activation="gelu_tanh", qkv_bias=True, o_bias=True,
                mlp_bias=True, lm_head_bias=True, learned_positions=True, max_position_embeddings=512)

CASES = {
    "full bf16 foreach": (GQA, TrainingSetup(weights="bf16", micro_batch=2, seq_len=64)),
    "full fp32 autocast, checkpointing, single-tensor": (GQA, TrainingSetup(
        weights="fp32", compute="bf16", amp=True, grad_ckpt=True, ckpt_reentrant=True, optimizer_impl="single",
        seq_len=64)),
    "lora with dropout, accumulation": (GQA, TrainingSetup(
        method="lora", lora_targets="all-linear", lora_dropout=0.1, grad_accum=2, seq_len=64)),
    "qlora nf4, double quant, paged 8-bit": (MOE, TrainingSetup(
        method="qlora", lora_targets="all-linear", optimizer="paged_adamw8bit", seq_len=32)),
    "qlora int8, upcast, autocast": (GQA, TrainingSetup(
        method="qlora", weights="int8", kbit_upcast=True, amp=True, seq_len=32)),
    "eager attention, softcaps, scaled embeddings": (GEMMA, TrainingSetup(
        attention="eager", weights="bf16", optimizer="adafactor", seq_len=32)),
    # reentrant checkpoints on the meta path: under transformers' default (non-reentrant) mode its cached ops
    # save fewer tensors on recompute than in the forward (torch's CheckpointError), so simulate runs those steps
    # on the fake path (test_non_reentrant_checkpointing_runs_on_the_fake_path)
    "layernorm, parallel block, chunked loss": (PHI, TrainingSetup(
        weights="bf16", grad_ckpt=True, ckpt_reentrant=True, chunked_loss=True, optimizer="sgd_momentum",
        seq_len=64)),
    "zero3 with parameter offload": (GQA, TrainingSetup(
        weights="bf16", sharding="zero3", gpus=4, offload="params", seq_len=32)),
    "fsdp, freeze": (GQA, TrainingSetup(method="freeze", trainable_layers=1, sharding="fsdp", gpus=2, seq_len=32)),
    "dpo, lora": (GQA, TrainingSetup(method="lora", objective="dpo", seq_len=20)),
    "grpo, generation": (GQA, TrainingSetup(objective="grpo", micro_batch=4, num_generations=4, seq_len=20,
                                            completion_len=6, grad_ckpt=True, ckpt_reentrant=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_fast_simulation_records_the_reference_events(name: str) -> None:
    spec, setup = CASES[name]
    setup.validate(spec)
    reference = simulate_paths.reference(spec, setup)
    fast = simulate_paths.fast(spec, setup)
    assert simulate_paths.first_difference(reference, fast) is None
    assert reference["allocations"]  # something was compared


def test_simulate_takes_the_fast_path_and_gives_the_reference_result(monkeypatch: pytest.MonkeyPatch) -> None:
    spec, setup = CASES["full bf16 foreach"]
    calls = []
    real = metasim.measure_meta

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(metasim, "measure_meta", counted)
    fast = simulate(spec, setup)
    old = simulate(spec, setup, fast=False)
    assert calls == [1]
    assert dataclasses.replace(fast, timing={}) == dataclasses.replace(old, timing={})


@pytest.mark.parametrize(("spec", "setup", "why"), [
    (GQA, TrainingSetup(weights="bf16", optimizer_impl="fused", seq_len=32), "fused"),  # torch refuses meta
    (WINDOW, TrainingSetup(weights="bf16", seq_len=64), "mask"),  # SDPA with a mask: not replayed
], ids=["fused adamw", "sliding window mask"])
def test_a_step_the_meta_path_cannot_run_is_simulated_on_fake_tensors(spec: ModelSpec, setup: TrainingSetup,
                                                                      why: str) -> None:
    with pytest.raises(Exception, match=why):
        metasim.measure_meta(spec, setup)
    fallback = simulate(spec, setup)
    assert dataclasses.replace(fallback, timing={}) == dataclasses.replace(simulate(spec, setup, fast=False),
                                                                           timing={})


def test_the_op_cache_answers_functional_and_in_place_ops_on_meta_tensors_only() -> None:
    x = torch.empty(4, 8, device="meta", dtype=torch.bfloat16)
    mul, add_ = torch.ops.aten.mul.Tensor, torch.ops.aten.add_.Tensor
    assert metasim.op_key(mul, (x, x), {}) is not None
    assert metasim.op_key(torch.ops.aten.t.default, (x,), {}) is None  # a view: aliases its input
    assert metasim.op_key(mul, (torch.empty(2), 2), {}) is None  # a real tensor: its values are read
    # an int and a float scalar promote differently: the key tells them apart
    i = torch.empty(3, device="meta", dtype=torch.long)
    assert metasim.op_key(mul, (i, 2), {}) != metasim.op_key(mul, (i, 2.0), {})
    out = metasim.run_cached(mul, (i, 2.0), {})
    again = metasim.run_cached(mul, (i, 2.0), {})
    assert (again.dtype, again.shape, again.stride()) == (out.dtype, out.shape, out.stride()) == (
        torch.float32, (3,), (1,))
    assert again.untyped_storage() is not out.untyped_storage()
    # in place: the second call returns the argument without running the kernel
    y = torch.empty(4, 8, device="meta", dtype=torch.bfloat16)
    assert metasim.run_cached(add_, (y, x), {}) is y
    assert metasim.run_cached(add_, (y, x), {}) is y
    # an out= op that resizes its output is never answered from the cache
    mm_out = torch.ops.aten.mm.out
    for _ in range(2):
        o = torch.empty(0, device="meta", dtype=torch.bfloat16)
        metasim.run_cached(mm_out, (x, x.t()), {"out": o})
        assert o.shape == (4, 4)


def test_a_later_process_takes_fake_tensor_modes_answers_from_disk_and_records_the_reference_events(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run asks FakeTensorMode and keeps its answers (core/simulation/fakeref.py); a process that starts
    afresh on the same file asks it nothing and records the same events as the reference."""
    spec, setup = CASES["full bf16 foreach"]
    reference = simulate_paths.reference(spec, setup)

    def afresh() -> FakeReferences:  # what a new process has: empty op caches, the file on disk
        store = FakeReferences(tmp_path)
        monkeypatch.setattr(metasim, "STORE", store)
        monkeypatch.setattr(composite, "STORE", store)
        monkeypatch.setattr(metasim, "_OUTPUT_CACHE", {})
        monkeypatch.setattr(composite, "_PROGRAMS", {})
        return store

    first = afresh()
    assert simulate_paths.first_difference(reference, simulate_paths.fast(spec, setup)) is None
    assert first.misses and not first.hits and (tmp_path / fakeref.FILE_NAME).is_file()
    later = afresh()
    asked = []
    monkeypatch.setattr(FakeTensorMode, "__init__", lambda *a, **k: asked.append(1) or 1 / 0)
    assert simulate_paths.first_difference(reference, simulate_paths.fast(spec, setup)) is None
    assert not asked and later.hits and not later.misses


CHILD = r"""
import dataclasses, json, sys
import torch
from vramlab.core.simulation.optim import uncompiled
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

spec, setup = ModelSpec(**json.loads(sys.argv[1])), TrainingSetup(**json.loads(sys.argv[2]))
result = repr(dataclasses.replace(simulate(spec, setup), timing={}))

def steps(cls, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt, hooks = cls(ps, lr=0.1, **kw), []
    opt.register_step_post_hook(lambda *a: hooks.append(1))
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad()
    states = [(k, v.clone() if isinstance(v, torch.Tensor) else v) for st in opt.state.values() for k, v in st.items()]
    return [p.detach().clone() for p in ps], states, [p.grad for p in ps], hooks

cases = [(torch.optim.AdamW, {"foreach": True}), (torch.optim.SGD, {"momentum": 0.9, "foreach": False})]
ours = [steps(uncompiled(cls), **kw) for cls, kw in cases]
imported = "torch._dynamo" in sys.modules
theirs = [steps(cls, **kw) for cls, kw in cases]
same = all(len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
           and repr(a[1]) == repr(b[1]) and a[2] == b[2] == [None, None] and a[3] == b[3] == [1, 1]
           for a, b in zip(ours, theirs))
print(json.dumps({"result": result, "dynamo_imported": imported, "optimizers_same": same}))
"""


def test_a_later_process_never_imports_dynamo_and_torchs_optimizers_step_the_same_unwrapped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing torch._dynamo (about 1.5 s) was most of a fast simulation: FakeTensorMode imports it, and so do
    torch's optimizer wrappers that keep torch.compile out. With FakeTensorMode's answers on disk and the optimizers
    unwrapped (optim.uncompiled), a fresh process gives the same result without it; the unwrapped AdamW and SGD
    step, keep state and run hooks exactly as torch's own."""
    spec, setup = CASES["full bf16 foreach"]
    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path))
    store = FakeReferences()
    monkeypatch.setattr(metasim, "STORE", store)
    monkeypatch.setattr(composite, "STORE", store)
    monkeypatch.setattr(metasim, "_OUTPUT_CACHE", {})
    monkeypatch.setattr(composite, "_PROGRAMS", {})
    here = simulate(spec, setup)
    env = {**os.environ, "VRAMLAB_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(dataclasses.asdict(spec)),
                           json.dumps(dataclasses.asdict(setup))], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["result"] == repr(dataclasses.replace(here, timing={}))
    assert not child["dynamo_imported"]
    assert child["optimizers_same"]


def test_non_reentrant_checkpointing_runs_on_the_fake_path() -> None:
    """transformers' default checkpointing is refused by the meta path and simulated on the fake one, whose
    result is the reference's."""
    spec, setup = CASES["full fp32 autocast, checkpointing, single-tensor"]
    setup = setup.replace(ckpt_reentrant=False)
    with pytest.raises(NotImplementedError):
        metasim.measure_meta(spec, setup)
    result = simulate(spec, setup)
    reference = simulate_paths.reference(spec, setup)
    assert result.peak_allocated_bytes == reference["peak"].total_bytes > 0
