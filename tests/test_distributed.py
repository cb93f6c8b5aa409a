"""Sharded profiles under torchrun: FSDP2 on the CPU with gloo, world size 2, a tiny model.

The launcher (core.profiling.distributed) starts torchrun, one rank per "GPU"; each rank builds the model,
shards it with FSDP2 ``fully_shard`` and measures itself with the dispatch tracker. These tests hold the
launcher (per-rank results, cancel, a crashed rank, timeout, refusals) and compare the real FSDP2 peaks
with the single-process simulation of the same setup and with the estimate, phase by phase.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time

import psutil
import pytest

from vramlab.core.checks import SetupError
from vramlab.core.cli import main
from vramlab.core.estimate import estimate
from vramlab.core.profiling.distributed import (
    DistributedOutcome,
    check_supported,
    dist_command,
    exit_codes,
    launch_refusal,
    profile_distributed,
)
from vramlab.core.profiling.profile import profile
from vramlab.core.report import profile_text
from vramlab.core.simulation.simulate import simulate
from vramlab.core.simulation.tracker import round_block
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

torch_dist = pytest.importorskip("torch.distributed")
if not (torch_dist.is_available() and torch_dist.is_gloo_available()):
    pytest.skip("this torch has no gloo backend", allow_module_level=True)

TINY = ModelSpec(id="tiny-dist", name="TinyDist", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, vocab_size=512)
# FSDP2's usual recipe: fp32 shards, bf16 gather and compute, fp32 gradient reduction. Without the Hub kernels: with
# the Hub's RoPE kernel (clones of q and k) the forward's peak moves to a moment where real FSDP2 holds 5,632 B more
# than the one-process emulation beside the all-gather buffer the docstring below accounts for (both runs take the
# kernel: bf16 q and cos); that moment is not accounted for yet
SETUP = TrainingSetup(method="full", weights="fp32", compute="bf16", seq_len=64, gpus=2, sharding="fsdp",
                      hub_kernels=False)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _nothing_left(pids: list[int], wait_s: float = 5.0) -> bool:
    """No child of this process and none of ``pids`` (rank processes, reparented when torchrun ends) alive."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not psutil.Process(os.getpid()).children(recursive=True) and not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _rank_pids(events: list[dict]) -> list[int]:
    return [e["pid"] for e in events if e.get("event") == "start"]


@pytest.fixture(scope="module")
def run() -> tuple[DistributedOutcome, list[dict]]:
    events: list[dict] = []
    out = profile_distributed(TINY, SETUP, device="cpu", timeout_s=240, on_event=events.append)
    return out, events


def test_two_ranks_two_results(run):
    out, events = run
    assert out.ok and out.kind == "ok", (out.kind, out.message, out.stderr_tail[-5:])
    assert out.world_size == 2 and out.backend == "gloo" and len(out.ranks) == 2
    keys = ["load", "forward@1", "backward@1", "optimizer@1", "forward@2", "backward@2", "optimizer@2"]
    for r, o in enumerate(out.ranks):
        assert o.ok and o.result is not None
        assert [p.key for p in o.result.phases] == keys
        assert o.result.total_params == TINY.param_count  # DTensor parameters count their global size
        assert any(f"rank {r} of 2" in n for n in o.result.notes)
        phases = [e["key"] for e in events if e.get("rank") == r and e.get("event") == "phase"]
        assert phases[0] == "load" and phases[-1] == "end"
    # every rank line is tagged, and the first event is torchrun's own pid
    assert events[0]["event"] == "started"
    assert all("rank" in e for e in events[1:])
    # identical layers split evenly: both ranks hold the same
    assert out.ranks[0].result.peak_allocated_bytes == out.ranks[1].result.peak_allocated_bytes
    assert out.result.peak_allocated_bytes == max(o.result.peak_allocated_bytes for o in out.ranks)
    d = out.to_json()
    assert d["world_size"] == 2 and [x["rank"] for x in d["ranks"]] == [0, 1]
    assert d["ranks"][1]["phase_steps"]["optimizer@2"] > 0
    text = profile_text(out, "MiB")
    assert "2 ranks (gloo)" in text and "rank 1" in text
    assert _nothing_left(_rank_pids(events))


def test_real_fsdp2_against_simulation_and_estimate(run):
    """Per rank and phase, real FSDP2 (tracker on CPU tensors, accelerate's MixedPrecisionPolicy: gathered and
    reduced in bf16) = simulate + the buffers FSDP2 keeps that the single-process emulation (core.simulation.shard)
    does not:

    * forward: FSDP2 keeps a unit's flat all-gather output (bf16, world x padded shard) after copying it
      out into the unsharded parameters, until the next unit's copy-out (``comm_ctx.all_gather_state``);
      the last layer's buffer lives until the root's post-forward, so the loss moment has one layer's
      all-gather buffer more than the emulation: layer_params x 2 bytes, exactly.
    * backward: the real peak is at the copy-out of layer 0 (start of its backward), with that all-gather buffer
      and layer 1's bf16 reduce-scatter input still held (``comm_ctx.reduce_scatter_states``); the emulation
      peaks earlier, inside layer 1's reduce-scatter, where it holds the unit, its reduce-scatter input, the bf16
      output and the fp32 gradient shards FSDP2 casts it to. The two peaks are different moments: the real one
      is higher, by less than the two buffers the emulation never holds (108,544 B here, 4 % of the phase).
    * load and optimizer: the same tensors (1/N padded shards, states and gradients of the shards).

    Gloo's reduce-scatter copies its whole input inside the kernel and releases the copy on its own thread
    at a racy moment; NCCL has no such tensor, so the rank tracker keeps it out (that is what makes these
    figures repeatable). The tolerance is a single 512-byte allocator block.
    """
    out, _ = run
    sim = {p.key: p.bytes for p in simulate(TINY, SETUP).phases}
    est = {p.key: p.bytes for p in estimate(TINY, SETUP, match_simulation=True).phases}
    assert est == sim  # the estimator's own contract, restated for the figures above
    unit = TINY.layer_params()
    all_gather_buffer = round_block(unit * 2, 512)  # bf16 gather; every dim 0 here divides by the world size
    held = 2 * all_gather_buffer  # backward: the all-gather buffer and the bf16 reduce-scatter input (see above)
    expected = {"load": 0, "optimizer": 0, "forward": all_gather_buffer}
    block = 512
    for o in out.ranks:
        real = {p.key: p.bytes for p in o.result.phases}
        assert real.keys() == sim.keys()
        for key, b in real.items():
            phase = key.split("@")[0]
            if phase == "backward":
                assert 0 < b - sim[key] < held, (key, b, sim[key])
                continue
            assert abs((b - sim[key]) - expected[phase]) <= block, (key, b, sim[key], b - sim[key], expected[phase])
            assert abs((b - est[key]) - expected[phase]) <= block
        # the whole-run peak: backward of step 2 in both
        assert 0 < o.result.peak_allocated_bytes - max(sim.values()) < held


def test_cli_profile_two_ranks_on_cpu(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 512,
        "hidden_act": "silu", "tie_word_embeddings": False,
    }))
    code = main(["profile", "--model", str(cfg), "--device", "cpu", "--gpus", "2", "--sharding", "fsdp",
                 "--weights", "fp32", "--seq", "64", "--timeout", "240"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "2 ranks (gloo)" in out and "Phase peaks per rank" in out
    rows = [line.split()[0] for line in out.splitlines() if line[:1].isdigit()]
    assert rows[:2] == ["0", "1"]
    assert _nothing_left([])


def test_cancel_ends_every_rank():
    events: list[dict] = []

    def abort() -> bool:  # once both ranks are in their first forward
        return len({e["rank"] for e in events if e.get("event") == "phase" and e["key"] == "forward@1"}) == 2

    out = profile_distributed(TINY, SETUP, device="cpu", fault="slow", timeout_s=240, on_event=events.append,
                              should_abort=abort)
    assert out.kind == "cancelled" and not out.ok
    pids = _rank_pids(events)
    assert len(pids) == 2
    assert _nothing_left(pids)


def test_a_crashed_rank_is_named():
    events: list[dict] = []
    out = profile_distributed(TINY, SETUP, device="cpu", fault="crash@1", timeout_s=240, on_event=events.append)
    assert out.kind == "crashed" and not out.ok
    assert out.failed_rank == 1 and out.message.startswith("rank 1 ")
    assert "139" in out.message  # the exit code torchrun reported for it
    assert out.failed_phase == "backward@1"
    assert "crashed on rank 1" in profile_text(out)
    assert _nothing_left(_rank_pids(events))


def test_a_hung_rank_is_ended_at_the_timeout():
    events: list[dict] = []
    out = profile_distributed(TINY, SETUP, device="cpu", fault="hang@1", timeout_s=12, on_event=events.append)
    assert out.kind == "timeout" and not out.ok
    assert "every rank was ended" in out.message
    assert _nothing_left(_rank_pids(events))


@pytest.mark.parametrize(("changes", "words"), [
    ({"sharding": "zero1"}, "ZeRO-1"),
    ({"sharding": "zero2"}, "SHARD_GRAD_OP"),
    ({"sharding": "none"}, "plain data parallel"),
    ({"gpus": 1}, "--gpus 2"),
    ({"offload": "params"}, "offload"),
    ({"method": "qlora", "weights": "nf4"}, "quantized"),
    ({"optimizer": "adamw8bit"}, "bitsandbytes"),
    ({"optimizer": "adafactor"}, "DTensor"),
])
def test_refusals_say_why(changes, words):
    setup = SETUP.replace(**changes)
    with pytest.raises(SetupError, match=words):
        check_supported(TINY, setup, "cpu")
    assert words in (launch_refusal(TINY, setup, "cpu") or "") or setup.gpus < 2 or setup.sharding.value == "none"
    if setup.gpus > 1:
        with pytest.raises(SetupError):
            profile(TINY, setup, device="cpu", launcher="torchrun")


def test_cuda_needs_enough_gpus():
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs are present")
    with pytest.raises(SetupError, match="visible GPUs"):
        check_supported(TINY, SETUP, "cuda")
    assert launch_refusal(TINY, SETUP, "cuda") is not None  # profile(auto) emulates rank 0 instead


def test_torchrun_command(monkeypatch, tmp_path):
    cmd = dist_command(2, tmp_path)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in cmd and "--nproc-per-node=2" in cmd
    assert cmd[-2:] == ["vramlab.core.profiling.dist_child", str(tmp_path)]
    monkeypatch.setattr("sys.frozen", True, raising=False)
    frozen = dist_command(2, tmp_path)
    # the frozen app runs torchrun and then each rank through its hidden --profile-child entry
    assert frozen[1:3] == ["--profile-child", "--torchrun"]
    assert frozen[-5:] == ["--no-python", frozen[0], "--profile-child", "--dist-rank", str(tmp_path)]


def test_exit_codes_from_torchrun_summary():
    text = """Failures:
[1]:
  time      : 2026-01-01_00:00:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 17136)  (SIGTERM)
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 139 (pid: 17135)
"""
    assert exit_codes(text.splitlines()) == {1: -15, 0: 139}


def test_rank_child_routes_through_the_profile_child(monkeypatch):
    """``vramlab --profile-child --dist-rank DIR`` reaches dist_child.main (frozen app, no ``python -m``)."""
    import sys

    from vramlab.core.profiling import child, dist_child

    seen = {}
    monkeypatch.setattr(dist_child, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    monkeypatch.setattr(sys, "argv", ["vramlab", "--dist-rank", "/tmp/x"])
    with contextlib.redirect_stdout(io.StringIO()):
        child.main()
    assert seen["argv"] == ["/tmp/x"]


def test_simulation_with_a_world_size_that_does_not_divide():
    """The reduce-scatter output of the emulation is the concatenated partitions (sum of ceil(numel / N));
    with N = 3 and 128-wide norms ceil(total / N) was too short and the simulation failed."""
    setup = SETUP.replace(gpus=3)
    sim = simulate(TINY, setup)
    assert {p.key: p.bytes for p in sim.phases} == {
        p.key: p.bytes for p in estimate(TINY, setup, match_simulation=True).phases}
