"""transformers' checkpointed decoder layers hold the position ids to the end of backward:
``GradientCheckpointingLayer.__call__`` checkpoints ``partial(forward, self, **kwargs)``, and the decoder loop
passes ``position_ids`` by keyword (Llama, Qwen, Mistral, Gemma, Phi-3 ... in transformers 5.25), so the run
function, which the graph keeps (reentrant) or each layer's checkpoint frame holds (non-reentrant), keeps the
[1, seq] int64 tensor the base model made. The estimate dropped it when the base model returned: 512 B low in the
ms-swift and LLaMA-Factory runs (tools/conformance_frameworks.py), 8 KiB at 1 x 1024."""

from __future__ import annotations

import pytest

from vramlab.core.estimate import estimate
from vramlab.core.sources.hf_config import spec_from_hf_config
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("peft")

from vramlab.core.tracing import hf  # noqa: E402

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "num_hidden_layers": 2, "max_position_embeddings": 4096}


@pytest.mark.parametrize(("method", "reentrant"), [pytest.param("full", True, marks=pytest.mark.slow), ("lora", False)])
def test_the_checkpointed_layers_hold_the_position_ids_as_transformers_does(method, reentrant):
    spec = spec_from_hf_config(LLAMA, id="m", name="M")
    setup = TrainingSetup(method=method, lora_targets="all-linear", lora_rank=8, seq_len=1024, grad_ckpt=True,
                          ckpt_reentrant=reentrant)
    ours = estimate(spec, setup, match_simulation=True).peak_allocated_bytes
    assert ours == hf.measure_config(LLAMA, setup, reduce_depth=False).peak_bytes  # transformers' own classes
