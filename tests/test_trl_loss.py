"""TRL's fused LM head as SFTTrainer's loss kernel (issue 29: the user's real run; `--loss-kernel trl`).

TRL 1.16's SFTTrainer never makes the logits: ``add_fused_lm_head`` scores the shifted positions through the LM
head in tiles of 4096 tokens x 32768 vocabulary entries (``mm_buf``, 32768 wide whatever the vocabulary) and
accumulates the gradients in fp32. Held three ways: the reference (core/simulation/trl_head.py ``sft_loss``)
against TRL's own ``_fused_forward`` and ``SFTTrainer.compute_loss`` on real CPU tensors, with the Triton folds
launched as no-ops and the CUDA path taken (only valid positions scored, ``addmm(out=acc)`` in place); the
estimate against the reference on the built-in builder, on transformers' classes, on a traced family and on
vision-language models; and the readers and the export that carry the kernel between frameworks.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation.simulate import simulate  # noqa: E402
from vramlab.core.simulation.tracker import MemoryTracker  # noqa: E402

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=40000)
TRL = dict(loss_kernel="trl")


# ---- against TRL's own code ---------------------------------------------------------------------------------

class _Launch:
    """``kernel[grid](...)``: a Triton launch that writes into the tensors it is given (nothing allocated)."""

    def __getitem__(self, _grid: object):  # noqa: ANN204
        return lambda *a, **k: None


@pytest.fixture
def trl_cuda_path(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """trl 1.16.0's chunked log-prob kernel taking its CUDA path on CPU tensors: Triton folds as no-op launches,
    only the valid positions scored (``compact``), the fp32 accumulation in place (``addmm(out=acc)``)."""
    from importlib import metadata

    pytest.importorskip("trl")
    if metadata.version("trl") != "1.16.0":
        pytest.skip("the reference models trl 1.16.0")
    from trl.kernels import chunked_logprob as kernel
    from trl.trainer import utils as trl_utils

    monkeypatch.setattr(kernel, "_use_triton", lambda device: True)
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    monkeypatch.setattr(kernel, "_forward_kernel", _Launch())
    monkeypatch.setattr(kernel, "_backward_kernel", _Launch())
    monkeypatch.setattr(kernel, "triton", types.SimpleNamespace(cdiv=lambda a, b: -(-a // b)), raising=False)
    monkeypatch.setattr(kernel, "_addmm_fp32", lambda acc, a, b: None)
    return trl_utils


def _tiny_llama(dtype: torch.dtype, vocab: int):  # noqa: ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype)


def _trainer_stub() -> types.SimpleNamespace:
    """What SFTTrainer.compute_loss reads of its trainer: a single-process training step."""
    acc = types.SimpleNamespace(parallelism_config=None, num_processes=1, gather_for_metrics=lambda x: x)
    args = types.SimpleNamespace(loss_type="nll", average_tokens_across_devices=False)
    return types.SimpleNamespace(model=types.SimpleNamespace(training=True), aux_loss_enabled=False,
                                 accelerator=acc, compute_loss_func=None, label_smoother=None, args=args,
                                 _metrics={"train": {"entropy": [], "mean_token_accuracy": []}},
                                 _total_train_tokens=0, _tp_size=1)


def _peaks(run) -> dict[str, int]:  # noqa: ANN001
    """The forward's and the backward's peaks (CUDA's 512-byte blocks) of the tensors the step makes."""
    from vramlab.core.kinds import Phase

    tracker = MemoryTracker()
    with tracker:
        tracker.set_phase(Phase.FORWARD, 1)
        loss = run()
        tracker.set_phase(Phase.BACKWARD, 1)
        loss.backward()
        del loss
    return {k: rec.total_bytes for k, rec in tracker.phase_peaks.items()}


@pytest.mark.parametrize(("dtype", "vocab", "batch", "seq"), [(torch.bfloat16, 1000, 2, 40),
                                                              (torch.float32, 32768, 1, 33),
                                                              (torch.bfloat16, 512, 3, 17)],
                         ids=["bf16", "fp32-one-whole-tile", "small-vocab"])
def test_the_reference_allocates_what_sft_trainer_allocates(trl_cuda_path, dtype: torch.dtype, vocab: int,  # noqa: ANN001
                                                            batch: int, seq: int) -> None:
    from trl.trainer.sft_trainer import SFTTrainer

    from vramlab.core.objectives.shared.trl import SFT_OUTPUTS
    from vramlab.core.simulation.loss import apply

    theirs_model, ours_model = _tiny_llama(dtype, vocab), _tiny_llama(dtype, vocab)
    trl_cuda_path.add_fused_lm_head(theirs_model, outputs=SFT_OUTPUTS)
    ids = torch.randint(3, vocab, (batch, seq))
    inputs = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    theirs = _peaks(lambda: SFTTrainer.compute_loss(_trainer_stub(), theirs_model, dict(inputs)))
    setup = TrainingSetup(method="full", weights="bf16" if dtype is torch.bfloat16 else "fp32", **TRL)
    ours = _peaks(lambda: apply(ours_model, setup, ids, ids.clone(), attention_mask=torch.ones_like(ids),
                                use_cache=False))
    # CUDA's boolean indexing, masked_scatter and its backward (masked_select) allocate their int64 indices
    # (nonzero, maskPrefixSum) through the dispatcher; the CPU's kernels make them inside, unseen by the tracker.
    # One tile: a vocabulary of at most 32768 fills the tile from its start (a narrower last tile of a larger
    # vocabulary is a strided view, which the CPU's mm(out=) copies and cuBLAS writes in place)
    n = batch * (seq - 1)
    blocks = [-(-x // 512) * 512 for x in (n * 16, n * 16, n * 8)]
    assert 0 <= ours["forward@1"] - theirs["forward@1"] <= sum(blocks)
    # and under any dispatch mode (the tracker is one) autograd's index backward runs out of place (index_put, a
    # second (batch, seq - 1, hidden) gradient) where a plain CUDA run writes into its zeros (_index_put_impl_)
    rows_grad = -(-(n * 64 * dtype.itemsize) // 512) * 512
    assert -rows_grad <= ours["backward@1"] - theirs["backward@1"] <= blocks[0]
    assert theirs["backward@1"] > vocab * 64 * 4  # the fp32 LM-head gradient accumulator is in the backward peak


def _held_for_backward(run) -> int:  # noqa: ANN001
    """What the step holds between its forward and its backward (its inputs made under the tracker): the saved
    tensors and the outputs, every temporary of the forward gone."""
    from vramlab.core.kinds import Phase

    tracker = MemoryTracker()
    with tracker:
        tracker.set_phase(Phase.FORWARD, 1)
        loss = run()
        held = tracker.current
        loss.backward()
        del loss
    return held


@pytest.mark.parametrize(("dtype", "vocab", "batch", "seq"), [(torch.bfloat16, 1000, 2, 40),
                                                              (torch.float32, 512, 8, 300)],
                         ids=["bf16", "many-positions"])
def test_the_boolean_index_keeps_its_mask_for_backward(trl_cuda_path, dtype: torch.dtype, vocab: int,  # noqa: ANN001
                                                       batch: int, seq: int) -> None:
    """``hidden_states[mask]``: autograd's IndexBackward0 saves the boolean mask it was given (batch x (seq - 1)
    bytes); the kernel's int64 ``nonzero`` indices (16 bytes a position) are gone when it returns, on CUDA as on
    the CPU. The reference kept the int64 indices instead (35,840 bytes more at 8 x 300)."""
    from trl.trainer.sft_trainer import SFTTrainer

    from vramlab.core.objectives.shared.trl import SFT_OUTPUTS
    from vramlab.core.simulation.loss import apply

    theirs_model, ours_model = _tiny_llama(dtype, vocab), _tiny_llama(dtype, vocab)
    trl_cuda_path.add_fused_lm_head(theirs_model, outputs=SFT_OUTPUTS)
    ids = torch.randint(3, vocab, (batch, seq))
    theirs = _held_for_backward(lambda: SFTTrainer.compute_loss(
        _trainer_stub(), theirs_model, {"input_ids": ids.clone(), "labels": ids.clone(),
                                        "attention_mask": torch.ones_like(ids)}))
    setup = TrainingSetup(method="full", weights="bf16" if dtype is torch.bfloat16 else "fp32", **TRL)
    ours = _held_for_backward(lambda: apply(ours_model, setup, ids.clone(), ids.clone(),
                                            attention_mask=torch.ones_like(ids), use_cache=False))
    assert ours == theirs


# ---- the estimate against the reference ---------------------------------------------------------------------

SETUPS = {
    "lora-batch2": TrainingSetup(method="lora", lora_targets="q_proj,v_proj", seq_len=512, micro_batch=2),
    "full-odd-sizes": TrainingSetup(method="full", seq_len=300, micro_batch=3),
    "autocast-fp32-weights": TrainingSetup(method="full", seq_len=300, micro_batch=3, weights="fp32",
                                           compute="bf16", amp=True),
    "lora-checkpointing": TrainingSetup(method="lora", seq_len=256, grad_ckpt=True),
    "qlora": TrainingSetup(method="qlora", lora_targets="all-linear", seq_len=256),
    # TRL gathers a sharded head around the kernel (maybe_gather_lm_head_ctx); the root unit is gathered anyway
    "lora-zero3": TrainingSetup(method="lora", seq_len=256, gpus=2, sharding="zero3"),
    "full-fsdp": TrainingSetup(method="full", seq_len=256, gpus=2, sharding="fsdp"),
    "full-zero3-offload": TrainingSetup(method="full", seq_len=256, gpus=4, sharding="zero3", offload="params"),
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_the_estimate_matches_the_kernel_on_transformers_classes(name: str) -> None:
    setup = SETUPS[name].replace(**TRL)
    est = estimate(LLAMA, setup, match_simulation=True)
    built = simulate(LLAMA, setup)
    ref = simulate(LLAMA, setup, hf=True)  # transformers' LlamaForCausalLM (+ peft), its hidden states to the head
    hf = estimate(LLAMA, SETUPS[name], match_simulation=True)
    assert est.peak_allocated_bytes == built.peak_allocated_bytes
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= 8192  # HF's few small buffers
    assert est.peak_phase == ref.peak_phase
    assert est.peak_allocated_bytes < hf.peak_allocated_bytes  # no fp32 logits


def test_the_tile_is_32768_wide_whatever_the_vocabulary() -> None:
    """A 512-entry vocabulary still gets [tokens, 32768] tiles (TRL's _CHUNKED_LOGPROB_CHUNK_SIZE), forward and
    backward: there TRL's head costs more than the whole logits would, by about a tile."""
    spec = dataclasses.replace(LLAMA, vocab_size=512)
    setup = TrainingSetup(method="lora", seq_len=257, micro_batch=2)
    tile = 2 * 256 * 32768 * 2
    fused = estimate(spec, setup.replace(**TRL), match_simulation=True).peak_allocated_bytes
    whole = estimate(spec, setup, match_simulation=True).peak_allocated_bytes
    assert tile / 2 < fused - whole < 2 * tile


@pytest.mark.parametrize(("extra", "needle"), [(dict(chunked_loss=True), "drop --chunked-loss"),
                                               (dict(loss_fp32=False), "drop --loss-bf16"),
                                               (dict(method="lora", lora_targets="q_proj,lm_head"), "lm_head")])
def test_what_the_fused_head_cannot_be_combined_with_is_refused(extra: dict, needle: str) -> None:
    with pytest.raises(SetupError, match=needle):
        TrainingSetup(**TRL, **extra).validate(LLAMA)


def test_the_objectives_accept_it_as_what_they_run() -> None:
    """DPO / KTO / GRPO score tokens through the same head: the kernel names what their trainers do."""
    setup = TrainingSetup(objective="dpo", method="lora", seq_len=128, completion_len=64)
    assert estimate(LLAMA, setup.replace(**TRL)).peak_allocated_bytes == estimate(LLAMA, setup).peak_allocated_bytes


def test_an_objective_comparison_trains_sft_as_trls_sfttrainer() -> None:
    """The comparison's columns are TRL's trainers: SFT through the fused head, beside DPO's."""
    from vramlab.core.compare import compare_setups

    setup = TrainingSetup(method="lora", seq_len=256, micro_batch=2)
    rows = {r.name: r for r in compare_setups(LLAMA, setup, objectives=["sft", "dpo"], allocator=False)}
    sft = rows["SFT"].result
    assert sft.setup.loss_kernel.value == "trl"
    assert sft.peak_allocated_bytes == estimate(LLAMA, setup.replace(**TRL)).peak_allocated_bytes
    assert sft.peak_allocated_bytes < estimate(LLAMA, setup).peak_allocated_bytes


# ---- between frameworks -------------------------------------------------------------------------------------

def test_a_trl_sft_config_reads_as_the_fused_head_and_label_smoothing_is_refused(tmp_path) -> None:  # noqa: ANN001
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / "sft.yaml"
    cfg.write_text("max_length: 512\nper_device_train_batch_size: 2\n")
    assert read_training_configs([cfg]).changes["loss_kernel"] == "trl"
    cfg.write_text("max_length: 512\nloss_type: dft\n")
    assert read_training_configs([cfg]).changes["loss_kernel"] == "trl"
    cfg.write_text("max_length: 512\nlabel_smoothing_factor: 0.1\n")
    src = read_training_configs([cfg])
    assert "loss_kernel" not in src.changes and "label smoothing" in src.refused["loss_kernel"].note


def test_only_trl_exports_it_and_the_cli_names_the_version(capsys) -> None:  # noqa: ANN001
    import json

    from vramlab.core.cli import main
    from vramlab.core.sources.export import export_setup

    assert "loss_type: nll" in export_setup(TrainingSetup(**TRL), "trl", model="m/x").files["trl_sft.yaml"]
    for fmt in ("axolotl", "llamafactory"):
        with pytest.raises(SetupError, match="TRL's fused LM head"):
            export_setup(TrainingSetup(**TRL), fmt, model="m/x")
    assert main(["estimate", "--model", "llama-3.2-1b", "--method", "lora", "--loss-kernel", "trl", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["loss_kernel"] == "trl"
    assert out["models_versions"]["loss_kernel"] == {"trl": "1.16.0"}
