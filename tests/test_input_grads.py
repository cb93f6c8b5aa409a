"""The input embeddings' output made to require grad (transformers' ``enable_input_require_grads``) without
checkpointing: axolotl 0.19.0's ``load_adapter`` (loaders/adapter.py) calls it for every adapter, so a LoRA step
without checkpointing keeps the embedding's output and the first norm's tensors for backward, and gives the
embedding's output a ``.grad``. Found by axolotl's own run beside the estimate (tools/conformance_frameworks.py:
33,280 B apart at a 2 x 64 batch of a tiny Llama)."""

from __future__ import annotations

import dataclasses

import pytest

from vramlab.core.estimate import estimate
from vramlab.core.sources.hf_config import spec_from_hf_config
from vramlab.core.sources.training import read_training_configs
from vramlab.core.spec.training import TrainingSetup

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "num_hidden_layers": 2, "max_position_embeddings": 4096}


@pytest.mark.parametrize(("keys", "on"), [("adapter: lora\n", True), ("adapter: qlora\nload_in_4bit: true\n", True),
                                          ("", False)])
def test_axolotl_makes_the_embeddings_output_require_grad_for_every_adapter(tmp_path, keys, on):
    cfg = tmp_path / "ax.yaml"
    cfg.write_text(f"base_model: m\nsequence_len: 128\n{keys}")
    setup = TrainingSetup().replace(**read_training_configs([cfg]).changes)
    assert setup.input_grads is on and setup.grad_ckpt is False


def test_the_estimate_keeps_what_enable_input_require_grads_keeps():
    pytest.importorskip("peft")
    from vramlab.core.tracing import hf

    spec = spec_from_hf_config(LLAMA, id="m", name="M")
    setup = TrainingSetup(method="lora", lora_targets="all-linear", lora_rank=8, seq_len=128, input_grads=True)
    ours = estimate(spec, setup, match_simulation=True).peak_allocated_bytes
    ref = hf.measure_config(LLAMA, setup, reduce_depth=False).peak_bytes  # transformers' own hook
    assert abs(ours - ref) <= 8 * 1024, (ours, ref)
    without = estimate(spec, dataclasses.replace(setup, input_grads=False), match_simulation=True)
    assert ours - without.peak_allocated_bytes >= 128 * 256 * 2  # the embedding's bf16 output, at least
