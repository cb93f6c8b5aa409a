"""TRL's activation offloading (``activation_offloading=True``; ``--offload-activations``; issue 29 item 5).

Held to TRL 1.16.0's own ``OffloadActivations`` and ``get_act_offloading_ctx_manager``: the same step run once with
VRAM Lab's transformation (core/simulation/act_offload.py) and once with TRL's class in its place
(tests/support/libs.py), on the built-in builder and on transformers' classes (+ peft), every phase's peak
equal to the byte. The estimate answers it from transformers' classes traced at the sizes asked (the layers fitted),
and the readers map TRL's and axolotl's keys onto it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.support import offload_libraries as libs
from vramlab.core.checks import SetupError
from vramlab.core.cli import main
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.sources.training import read_training_configs
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation import step  # noqa: E402
from vramlab.core.simulation.simulate import simulate  # noqa: E402

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                  intermediate_size=256, vocab_size=512)


def _phases(r) -> dict[str, int]:  # noqa: ANN001
    """Every phase's peak above the loaded model (transformers' first build in a process keeps one more 1 KiB
    buffer than the next, whatever the step)."""
    load = next(p.bytes for p in r.phases if p.key == "load")
    return {p.key: p.bytes - load for p in r.phases}


def _held_to_trl(setup: TrainingSetup, hf: bool) -> None:
    libs.installed()
    # on transformers' torch norms: TRL's own hooks cannot key the Hub RMSNorm's saved tensors under fake tensors
    # ("unknown parameter type" in its _get_unique_tensor_key)
    setup = setup.replace(hub_kernels=False)
    ours = simulate(LLAMA, setup, hf=hf)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step, "offload_context", libs.trl_context(mp, axolotl=setup.offload_activations == "axolotl"))
        theirs = simulate(LLAMA, setup, hf=hf)
    assert _phases(ours) == _phases(theirs)
    assert ours.peak_phase == theirs.peak_phase
    without = simulate(LLAMA, setup.replace(offload_activations="none"), hf=hf)
    plain = _phases(without)
    assert any(v < plain[k] for k, v in _phases(ours).items() if k.startswith(("forward", "backward")))  # it moves


def test_the_step_is_trls_own_offloading():
    _held_to_trl(TrainingSetup(method="lora", lora_targets="all-linear", micro_batch=2, seq_len=64,
                               offload_activations=True), hf=True)


def test_axolotls_offloading_is_its_own():
    """axolotl's adapter manager keeps no parameter storages (the weights' transposes go to the host too) and its
    patch clones a non-contiguous saved tensor first: more than TRL's keeps."""
    setup = TrainingSetup(method="lora", lora_targets="all-linear", micro_batch=2, seq_len=64,
                          offload_activations="axolotl")
    _held_to_trl(setup, hf=False)
    trl = simulate(LLAMA, setup.replace(offload_activations="trl"))
    assert simulate(LLAMA, setup).peak_allocated_bytes > trl.peak_allocated_bytes


@pytest.mark.slow
@pytest.mark.parametrize(("setup", "hf"), [
    (TrainingSetup(method="full", micro_batch=2, seq_len=64, offload_activations=True, grad_ckpt=True), False),
    (TrainingSetup(method="lora", micro_batch=2, seq_len=64, offload_activations=True), False),
    (TrainingSetup(method="full", micro_batch=2, seq_len=64, offload_activations=True), True),
    (TrainingSetup(method="lora", micro_batch=2, seq_len=64, offload_activations=True, grad_ckpt=True), True),
    (TrainingSetup(method="lora", micro_batch=1, seq_len=8, offload_activations=True), True),  # under 1 KiB
    (TrainingSetup(method="lora", micro_batch=2, seq_len=64, offload_activations=True, objective="dpo",
                   completion_len=32), True),
    (TrainingSetup(method="full", micro_batch=2, seq_len=64, grad_accum=2, offload_activations=True,
                   attention="eager"), True),
    (TrainingSetup(method="lora", micro_batch=2, seq_len=64, offload_activations="axolotl"), True),
    (TrainingSetup(method="qlora", micro_batch=2, seq_len=64, offload_activations="axolotl"), True),
    (TrainingSetup(method="full", micro_batch=2, seq_len=64, offload_activations=True, grad_ckpt=True,
                   ckpt_reentrant=True), True),  # the recompute in backward packs through the hooks again
], ids=["full-checkpointing-builder", "lora-builder", "full-hf", "lora-checkpointing-hf", "tiny-hf", "dpo-hf",
        "accumulation-eager-hf", "axolotl-lora-hf", "axolotl-qlora-hf", "full-reentrant-hf"])
def test_the_step_is_trls_own_offloading_matrix(setup, hf):
    _held_to_trl(setup, hf)


def test_the_estimate_is_transformers_classes_traced_at_the_sizes_asked():
    # transformers' torch norms: with the Hub's RMSNorm the fitted tape fails its check and the classes are simulated
    # directly (which tensor a stash key stands for then depends on a freed storage's reuse, as TRL's data pointers
    # on CUDA do: not held here)
    setup = TrainingSetup(method="lora", micro_batch=2, seq_len=64, offload_activations=True, hub_kernels=False)
    est = estimate(LLAMA, setup, match_simulation=True)
    ref = simulate(LLAMA, setup, hf=True)
    assert est.source.startswith("traced"), est.notes  # transformers' classes at the sizes asked, the layers fitted
    assert est.peak_allocated_bytes == ref.peak_allocated_bytes
    assert _phases(est) == _phases(ref)
    plain = estimate(LLAMA, setup.replace(offload_activations="none"), match_simulation=True)
    assert est.components.get(Kind.ACTIVATIONS, 0) < plain.components[Kind.ACTIVATIONS]
    assert est.models_versions()["activation_offloading"] == {"trl": "1.16.0"}


def test_what_trl_does_not_run_is_refused_with_its_reason():
    with pytest.raises(SetupError, match="grpo trainer has no activation_offloading"):
        TrainingSetup(method="lora", objective="grpo", offload_activations=True).validate()
    with pytest.raises(SetupError, match="modelled for LoRA / QLoRA"):
        TrainingSetup(method="full", offload_activations="axolotl").validate()
    with pytest.raises(SetupError, match="axolotl turns gradient checkpointing off"):
        TrainingSetup(method="lora", grad_ckpt=True, offload_activations="axolotl").validate()
    with pytest.raises(SetupError, match="hand-written program does not model activation offloading"):
        estimate(dataclasses.replace(LLAMA, tape="hand-written"), TrainingSetup(offload_activations=True))


def test_the_estimator_only_build_says_what_it_needs(monkeypatch):
    from vramlab.core import traced

    monkeypatch.setattr(traced, "missing", lambda: ["torch", "transformers"])
    with pytest.raises(SetupError, match=r"needs torch, transformers \(pip install 'vramlab\[hf\]'\)"):
        estimate(LLAMA, TrainingSetup(offload_activations=True))


def test_trl_configs_turn_it_on(tmp_path):
    for name, body in (("sft.yaml", "use_peft: true\nmax_length: 256\nactivation_offloading: true\n"),
                       ("dpo.yaml", "beta: 0.1\nloss_type: sigmoid\nmax_length: 256\nactivation_offloading: true\n"),
                       ("kto.yaml", "loss_type: kto\nmax_length: 256\nactivation_offloading: true\n")):
        cfg = tmp_path / name
        cfg.write_text(body)
        src = read_training_configs([cfg])
        assert src.changes["offload_activations"] == "trl", name
        assert not any(r.key == "activation_offloading" and r.status == "not modelled" for r in src.rows)
    off = tmp_path / "off.yaml"
    off.write_text("use_peft: true\nmax_length: 256\n")
    assert "offload_activations" not in read_training_configs([off]).changes


def test_the_command_line_takes_it(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
                                  "vocab_size": 512}))
    code = main(["estimate", "--model", str(config), "--method", "lora", "--seq", "64", "--offload-activations",
                 "--no-hub-kernels", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    d = json.loads(out)
    assert d["setup"]["offload_activations"] == "trl" and d["source"].startswith("traced")
    code = main(["estimate", "--model", str(config), "--objective", "grpo", "--offload-activations"])
    _out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "activation_offloading" in err
    code = main(["estimate", "--model", str(config), "--grad-ckpt-offload"])  # nothing is checkpointed
    out, err = capsys.readouterr()
    assert code == 0 and "--grad-ckpt-offload does not apply" in out + err


def test_axolotl_configs_turn_it_on(tmp_path):
    cfg = tmp_path / "ax.yaml"
    for body in ("activation_offloading: true\ngradient_checkpointing: true\n", "gradient_checkpointing: offload\n"):
        cfg.write_text("base_model: x\nadapter: lora\nsequence_len: 256\n" + body)
        src = read_training_configs([cfg])
        assert (src.changes["offload_activations"], src.changes["grad_ckpt"]) == ("axolotl", False), body
    for body in ("activation_offloading: legacy\nadapter: lora\n", "activation_offloading: true\n"):  # full: wrapped
        cfg.write_text("base_model: x\nsequence_len: 256\n" + body)
        src = read_training_configs([cfg])
        assert "offload_activations" not in src.changes
        assert any(r.key == "activation_offloading" and r.status == "not modelled" for r in src.rows), body


# ---- offloaded gradient checkpointing (LLaMA-Factory's use_unsloth_gc) ----------------------------------------------
OFFLOADED = TrainingSetup(method="lora", lora_targets="all-linear", micro_batch=2, seq_len=64, grad_ckpt=True,
                          ckpt_offload=True)


def _held_to_framework(setup: TrainingSetup, hf: bool, framework: str) -> None:
    ours = simulate(LLAMA, setup, hf=hf)
    with pytest.MonkeyPatch.context() as mp:
        libs.offloaded_checkpoint(mp, framework)
        theirs = simulate(LLAMA, setup, hf=hf)
    assert _phases(ours) == _phases(theirs)


def test_the_offloaded_checkpoint_is_llamafactorys_own():
    _held_to_framework(OFFLOADED, True, "llamafactory")


@pytest.mark.slow
@pytest.mark.parametrize(("setup", "hf", "framework"), [
    (OFFLOADED, False, "llamafactory"), (OFFLOADED.replace(method="full"), False, "llamafactory"),
    (OFFLOADED.replace(method="qlora"), True, "llamafactory"),
    (OFFLOADED.replace(grad_accum=2, lora_dropout=0.1), True, "llamafactory"), (OFFLOADED, True, "axolotl"),
    (OFFLOADED.replace(method="full"), True, "axolotl")],
    ids=["lora-builder", "full-builder", "qlora-hf", "accumulation-dropout-hf", "axolotl-lora-hf", "axolotl-full-hf"])
def test_the_offloaded_checkpoint_is_the_frameworks_own_matrix(setup, hf, framework):
    _held_to_framework(setup, hf, framework)


def test_the_estimate_mirrors_the_offloaded_checkpoint():
    est = estimate(LLAMA, OFFLOADED, match_simulation=True)
    built = simulate(LLAMA, OFFLOADED)
    assert est.source == "hand-written"
    assert est.peak_allocated_bytes == built.peak_allocated_bytes
    assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in built.phases}
    kept = estimate(LLAMA, OFFLOADED.replace(ckpt_offload=False), match_simulation=True)
    forward = {p.key: p.bytes for p in est.phases}["forward@1"]
    assert forward < {p.key: p.bytes for p in kept.phases}["forward@1"]  # the layers' inputs are not kept
    alone = TrainingSetup(method="lora", seq_len=64, ckpt_offload=True)  # without checkpointing: nothing to offload
    plain = alone.replace(ckpt_offload=False)
    assert estimate(LLAMA, alone).peak_allocated_bytes == estimate(LLAMA, plain).peak_allocated_bytes
    assert alone.resolved()["ckpt_offload"] is None


def test_llamafactory_configs_turn_it_on(tmp_path):
    cfg = tmp_path / "lf.yaml"
    cfg.write_text("stage: sft\nfinetuning_type: lora\ncutoff_len: 256\nuse_unsloth_gc: true\n")
    src = read_training_configs([cfg])
    assert src.changes["ckpt_offload"] is True and src.changes.get("grad_ckpt", True) is True
    cfg.write_text("stage: sft\nfinetuning_type: lora\ncutoff_len: 256\nuse_unsloth_gc: true\n"
                   "disable_gradient_checkpointing: true\n")
    assert "ckpt_offload" not in read_training_configs([cfg]).changes  # nothing is checkpointed


def test_a_host_tensor_is_not_offloaded_again():
    """What is already in host memory (offloaded checkpointing's saved input) is not on the accelerator: TRL keeps
    it as it is (its device check); fake and meta tensors say so through the tracker's host region."""
    import torch

    from vramlab.core.simulation import context
    from vramlab.core.simulation.act_offload import OffloadActivations
    from vramlab.core.simulation.tracker import MemoryTracker

    tracker = MemoryTracker()
    with context.active(tracker), tracker:
        with tracker.host():
            host = torch.empty(64, 64)
        device = torch.empty(64, 64)
        hooks = OffloadActivations(torch.nn.Linear(1, 1), "cpu")
        kept, moved = hooks._pack(host), hooks._pack(device)
        assert hooks.tracker[kept][1] is False and hooks.tracker[moved][1] is True
        assert tracker.current == 64 * 64 * 4  # the device tensor only: its host copy is not counted


# ---- under ZeRO-1 / 2 (issue 28): the forward and backward are the one-GPU step's (whole parameters; the optimizer
# state and the gradients partitioned), so the offloaded tensors are those of one GPU

ZERO2 = dict(gpus=2, sharding="zero2", hub_kernels=False)


def test_the_offloaded_checkpoint_under_zero2_is_the_estimate_of_the_classes():
    setup = OFFLOADED.replace(**ZERO2)
    est, ref = estimate(LLAMA, setup, match_simulation=True), simulate(LLAMA, setup, hf=True)
    assert est.peak_allocated_bytes == ref.peak_allocated_bytes
    kept = estimate(LLAMA, setup.replace(ckpt_offload=False, ckpt_reentrant=True), match_simulation=True)
    assert _phases(est)["forward@1"] < _phases(kept)["forward@1"]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero1", "zero2"])
def test_under_zero_1_2_the_offloading_is_the_libraries_own(sharding: str):
    _held_to_framework(OFFLOADED.replace(**{**ZERO2, "sharding": sharding}), True, "llamafactory")
    _held_to_trl(TrainingSetup(method="lora", lora_targets="all-linear", micro_batch=2, seq_len=64,
                               offload_activations=True, **{**ZERO2, "sharding": sharding}), hf=True)
    setup = TrainingSetup(method="lora", micro_batch=2, seq_len=64, offload_activations=True,
                          **{**ZERO2, "sharding": sharding})
    est = estimate(LLAMA, setup, match_simulation=True)
    assert est.source.startswith("traced")
    assert est.peak_allocated_bytes == simulate(LLAMA, setup, hf=True).peak_allocated_bytes


# ---- under ZeRO-3 / FSDP (issue 28): each layer computes with its unit's gathered weights. The offloaded checkpoint
# recomputes the layer in backward beside the unit gathered again (FSDP2's pre-forward hook in the recompute, its
# pre-backward hook on the recomputed output), from a copy of its input brought back. TRL's hooks, built at the
# trainer's init before the model is sharded, hold no gathered storage among their parameters: a saved view of a
# gathered weight (its transpose) is offloaded like an activation, a gathered parameter saved as itself stays.

ZERO3 = dict(gpus=2, sharding="zero3", hub_kernels=False)


def test_the_offloaded_checkpoint_under_zero3_is_the_estimate_of_the_classes():
    """Refused before; the hand-written estimate was one layer input short (32 KiB here) where it answered: its copy
    back was sized by the unit boundary's view of the input, which has no bytes of its own."""
    setup = OFFLOADED.replace(**ZERO3)
    est, ref = estimate(LLAMA, setup, match_simulation=True), simulate(LLAMA, setup, hf=True)
    assert est.source == "hand-written"
    assert _phases(est) == _phases(ref)
    kept = estimate(LLAMA, setup.replace(ckpt_offload=False, ckpt_reentrant=True), match_simulation=True)
    # the layers' inputs are in host memory (at the peak, in a layer's backward, its copy back stands in for one)
    assert est.components[Kind.ACTIVATIONS] < kept.components[Kind.ACTIVATIONS]


def test_activation_offloading_under_fsdp_is_trls_own():
    setup = TrainingSetup(method="lora", lora_targets="all-linear", micro_batch=2, seq_len=64,
                          offload_activations=True, gpus=2, sharding="fsdp")
    _held_to_trl(setup, hf=False)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero3", "fsdp"])
def test_under_zero3_fsdp_the_offloading_is_the_libraries_own(sharding: str):
    _held_to_framework(OFFLOADED.replace(**{**ZERO3, "sharding": sharding}), True, "llamafactory")
    _held_to_framework(OFFLOADED.replace(method="full", **{**ZERO3, "sharding": sharding}), False, "axolotl")
    for setup, hf in ((TrainingSetup(method="lora", lora_targets="all-linear", micro_batch=2, seq_len=64,
                                     offload_activations=True, **{**ZERO3, "sharding": sharding}), True),
                      (TrainingSetup(method="full", micro_batch=2, seq_len=64, offload_activations=True,
                                     grad_ckpt=True, **{**ZERO3, "sharding": sharding}), True),
                      (TrainingSetup(method="lora", micro_batch=2, seq_len=64, offload_activations="axolotl",
                                     **{**ZERO3, "sharding": sharding}), True)):
        _held_to_trl(setup, hf=hf)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero3", "fsdp"])
def test_activation_offloading_under_zero3_fsdp_is_the_estimate_of_the_classes(sharding: str):
    setup = TrainingSetup(method="lora", micro_batch=2, seq_len=64, offload_activations=True,
                          **{**ZERO3, "sharding": sharding})
    est = estimate(LLAMA, setup, match_simulation=True)
    assert est.source.startswith("traced")
    assert _phases(est) == _phases(simulate(LLAMA, setup, hf=True))


@pytest.mark.slow
def test_trls_hooks_offload_the_weights_fsdp2_gathers(tmp_path):
    """Real FSDP2 (``fully_shard`` on two gloo ranks) under TRL's own hooks, built before the model is sharded as
    SFTTrainer builds them: the transpose a linear layer saves of its gathered weight is offloaded, the gathered
    norm weight saved as itself is kept (tests/support/fsdp2_trl_rank.py)."""
    import subprocess
    import sys
    from pathlib import Path

    libs.installed()
    dist = pytest.importorskip("torch.distributed")
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch has no gloo backend")
    rank = Path(__file__).parent / "support" / "fsdp2_trl_rank.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", str(rank)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
    saved = json.loads(line)["saved"]
    views = [s for s in saved if not s["parameter"]]
    params = [s for s in saved if s["parameter"]]
    assert len(views) == 2 and all(s["offloaded"] and s["bytes"] >= 1024 for s in views)  # each layer's proj
    assert len(params) == 2 and not any(s["offloaded"] for s in params) and all(s["bytes"] >= 1024 for s in params)


def test_a_freed_storage_is_not_taken_for_a_later_one_at_the_same_address():
    """TRL's "second save of a storage in the stash" key, for an offset view whose clone went to the stash: when the
    view's storage is freed, a later storage CPython places at the same address is a new one and is offloaded (the
    key once outlived its storage, and which tensors stayed on the device changed from run to run)."""
    import torch

    from vramlab.core.simulation.act_offload import OffloadActivations

    model = torch.nn.Linear(4, 4)  # (alive: its parameters' storages are the ones TRL exempts)
    hooks = OffloadActivations(model, "cpu")
    base = torch.zeros(2, 1024)
    first = hooks._pack(base[1])  # an offset view of 4 KiB: TRL clones it and stashes the clone
    assert hooks.tracker[first][1]
    freed = id(base.untyped_storage())
    others = [torch.zeros(2, 1024) for _ in range(32)]  # made before the free: only their storage objects come after
    del base
    # CPython hands the freed storage object's memory to the next object of its size: the first storage asked for
    later = next((t for t in others if id(t.untyped_storage()) == freed), None)
    if later is None:
        pytest.skip("CPython placed no later storage at the freed one's address")
    assert hooks.tracker[hooks._pack(later[1])][1]  # offloaded, not kept as "in the stash already"


def test_the_offloaded_checkpoints_copy_back_is_its_inputs_own_elements():
    """A checkpointed input that is a view of a larger storage (q sliced from a fused qkv output): the offloaded
    checkpoint's host copy is ``empty_like`` of the view, so the copy brought back in backward has the view's
    elements, not its storage's. Held to the simulation's function run by torch on CPU: the live bytes at the
    backward's peak (the engine sized the copy by the storage, three times q: one q-sized tensor high at the peak)."""
    import torch

    from vramlab.core.estimator.engine import Engine
    from vramlab.core.estimator.ops import Ops
    from vramlab.core.simulation import context
    from vramlab.core.simulation.offload_ckpt import checkpoint_to_host
    from vramlab.core.simulation.tracker import MemoryTracker

    rows, width = 64, 96
    tracker = MemoryTracker(block=1)
    with context.active(tracker), tracker:
        qkv = torch.ones(rows, 3 * width, requires_grad=True)
        out = checkpoint_to_host(lambda h: h * 2.0, qkv[:, :width])
        start = len(tracker.timeline) - 1
        out.backward(torch.ones_like(out))
        assert qkv.grad is not None
    theirs = [live for _e, live in tracker.timeline[start:]]

    engine = Engine(match_simulation=True)
    engine.ckpt_offload = engine.ckpt_reentrant = True
    ops = Ops(engine)
    fused = ops.param(rows * 3 * width, "f32", Kind.WEIGHTS, True)
    q = engine.view(fused, rows * width)
    engine.node(q, [(fused, ops.gbytes(fused))])  # SliceBackward: the storage's zeros, the gradient copied in
    engine.grad_enabled = False
    y = ops.unary(q)
    engine.grad_enabled = True

    def run(engine: Engine, node, buf) -> None:  # noqa: ANN001
        gx = engine.checkpoint_backward(q, ops.unary, buf, node, offloaded=True)
        if gx is not None:
            engine.deliver(q, gx)

    engine.node(y, [(q, 0)], special=run)
    live = sum(int(n.generic()) * sign for n, sign, *_ in engine.tape)
    ours = [live]
    start = len(engine.tape)
    engine.backward(y)
    for n, sign, *_ in engine.tape[start:]:
        live += int(n.generic()) * sign
        ours.append(live)
    assert fused.grad is not None
    assert max(ours) - ours[0] == max(theirs) - theirs[0]
