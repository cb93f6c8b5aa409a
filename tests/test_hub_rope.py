"""transformers' Hub RoPE kernel (issue 29): kernels-community/rotary's ``apply_rotary_transformers``, which
``kernelize`` puts in place of every decorated ``apply_rotary_pos_emb`` in training on CUDA (transformers 5.25.0).
Held to the kernels library's own ``kernelize`` under transformers' mapping, with the repo's layer as its source
writes it over its op registered as its binding registers it (no autograd kernel: torch's own fallback decides
what autograd records), on transformers' classes; the hand-written rule to the classes' decorators; the estimate
three ways."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from tests.support.hub_library import kernelize_as_transformers
from tests.support.step_timeline import step_timeline
from tests.support.three_ways import held_three_ways
from tests.test_hub_kernels import HAND_WRITTEN
from vramlab.core.catalog import find_model
from vramlab.core.estimate import estimate
from vramlab.core.spec import hub_kernels
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("kernels")

from vramlab.core.simulation import rope  # noqa: E402

ROTARY = ("apply_rotary_transformers",)  # only the rotary repo stands in (the norms keep their torch forward)


def _model(name: str, dtype: torch.dtype):  # noqa: ANN202
    import peft
    import transformers as tf

    size = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    cfg = {"llama": tf.LlamaConfig(**size), "qwen3": tf.Qwen3Config(**size, head_dim=16)}[name]
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"]))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_trace_kernelizes_rope_as_the_kernels_library_does(monkeypatch, name: str) -> None:  # noqa: ANN001
    """The same tensors, alloc for alloc, through forward and backward, as the library's kernelize with the Hub
    repo's layer; and not the torch path's (its products and rotate_half's halves, and their backward)."""
    ids = torch.randint(0, 32, (2, 24))

    def run(kernelize) -> list[int]:  # noqa: ANN001
        model = _model(name, torch.bfloat16)
        kernelize(model)
        return step_timeline(model, ids)

    swapped = []

    def library(model) -> None:  # noqa: ANN001
        kernelize_as_transformers(model, monkeypatch, ROTARY)
        swapped.append(sum("_kernel_repo" in vars(f) for m in model.modules()
                           for f in (vars(m).get("_kernel_funcs") or {}).values()))

    theirs = run(library)
    ours = run(rope.kernelize_rope)
    assert swapped[0] == 2  # each layer's attention's wrapper
    assert theirs == ours
    assert ours != run(lambda model: None)


def test_the_real_run_trains_q_and_k_on_unrotated_gradients(monkeypatch) -> None:  # noqa: ANN001
    """What a run with the kernel trains: the forward's rotation is right (the same loss), but autograd records
    nothing of the op (it returns nothing: torch's fallback cannot hook it), so q's and k's gradients skip the
    rotation: q_proj's and k_proj's LoRA weights get other gradients than the torch path's (and every layer's
    below the last), and torch says nothing."""
    ids = torch.randint(0, 32, (1, 12))

    def grads(kernelize) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
        model = _model("llama", torch.float32)
        kernelize(model)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # torch's "autograd kernel was not registered" would raise
        loss, kernel = grads(lambda model: kernelize_as_transformers(model, monkeypatch, ROTARY))
    plain_loss, plain = grads(lambda model: None)
    assert torch.allclose(loss, plain_loss, atol=1e-5)
    checked = 0
    for name, g in kernel.items():  # lora_B's (lora_A's are zeros both ways: lora_B starts at zero)
        if "lora_B" in name:
            checked += 1
            # the last layer's v_proj alone: every gradient below it passes through a wrong q / k gradient
            assert torch.allclose(g, plain[name], atol=1e-6) == ("layers.1." in name and "v_proj" in name), name
    assert checked == 6


def test_the_hand_written_rule_is_transformers_decorators() -> None:
    """:func:`hub_kernels.hub_rope` says the program runs the kernel exactly where the family's attention carries
    a wrapper of a function decorated ``use_kernel_forward_from_hub("rotary_pos_emb")`` (built on the meta
    device): Phi's on its rotary slices, Pythia's GPT-NeoX, StableLM and Phi-3 not decorated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def decorated(model_type: str) -> bool:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, num_hidden_layers=1))
        return rope.kernelize_rope(model) > 0

    seen = set()
    for preset, model_type in {**HAND_WRITTEN, "pythia-160m": "gpt_neox", "stablelm-base-alpha-3b": "stablelm",
                               "phi-1.5": "phi"}.items():
        assert decorated(model_type) == hub_kernels.hub_rope(find_model(preset)), preset
        seen.add(hub_kernels.hub_rope(find_model(preset)))
    assert seen == {True, False}


LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=32000)


@pytest.mark.parametrize("name", ["eager", "qwen3-sdpa"])
def test_the_estimate_holds_the_hub_rope_three_ways(name: str) -> None:
    spec = LLAMA if name == "eager" else dataclasses.replace(LLAMA, qk_norm=True, head_dim=64)
    setup = TrainingSetup(method="lora", lora_targets="all-linear", seq_len=256, micro_batch=2,
                          attention="eager" if name == "eager" else "sdpa")
    est, off = held_three_ways(spec, setup, setup.replace(hub_kernels=False))
    assert est.peak_allocated_bytes != off.peak_allocated_bytes
    assert any(hub_kernels.ROPE_GRADIENT in n for n in est.notes)


def test_autocast_over_fp32_weights_is_named_with_the_binding_check() -> None:
    """q and k come out of autocast in bf16, the rotary table in the embeddings' fp32: the binding's
    ``TORCH_CHECK(x1.dtype() == cos.dtype())`` fails the run at its first step. The programs count the torch path
    there (equal to the run without the Hub's RoPE, the norm aside) and the note says the run fails."""
    setup = TrainingSetup(method="full", weights="fp32", compute="bf16", seq_len=128)
    assert setup.autocast
    est, _off = held_three_ways(LLAMA, setup, setup.replace(hub_kernels=False))
    assert any(hub_kernels.ROPE_DTYPE in n for n in est.notes)
    plain = estimate(LLAMA, TrainingSetup(method="lora", seq_len=128))
    assert not any(hub_kernels.ROPE_DTYPE in n for n in plain.notes)
