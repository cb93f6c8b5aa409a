"""HF Trainer's accumulation holds every micro-batch of an optimizer step (issue 29): ``get_batch_samples`` takes all
``gradient_accumulation_steps`` batches from the data loader before the step's first forward (accelerate's
``DataLoaderShard`` moves each to the device as it yields it) and its list keeps them through the optimizer step.
The builder's step is held to transformers' own Trainer here, the estimate to the builder."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from vramlab.core.kinds import Kind  # noqa: E402

BATCH, SEQ, ACCUM, STEPS = 2, 64, 2, 2
CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 128, "tie_word_embeddings": False}


def _inputs_at_each_forward(model: torch.nn.Module, tracker) -> list[int]:  # noqa: ANN001
    """The collated batches' bytes alive as each forward starts (the tracker's inputs region)."""
    seen: list[int] = []
    model.register_forward_pre_hook(lambda *_: seen.append(tracker.live_bytes(Kind.INPUTS)))
    return seen


def _trainers_run(tmp_path) -> list[int]:  # noqa: ANN001
    """transformers' Trainer, two optimizer steps of two micro-batches on a tiny Llama on this CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from vramlab.core.simulation.tracker import MemoryTracker

    tracker = MemoryTracker()

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:  # what DataCollatorForLanguageModeling gives
        with tracker.region(Kind.INPUTS):
            ids = torch.tensor([r["input_ids"] for r in rows])
            return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    rows = [{"input_ids": [(i + j) % CONFIG["vocab_size"] for j in range(SEQ)]} for i in range(BATCH * ACCUM * STEPS)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, use_cpu=True, report_to="none",
                             save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
                             remove_unused_columns=False, seed=0)
    torch.manual_seed(0)
    with tracker:
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        seen = _inputs_at_each_forward(model, tracker)
        Trainer(model=model, args=args, train_dataset=rows, data_collator=collate).train()
    return seen


def _builders_run() -> list[int]:
    """The builder's step (``vramlab simulate``'s reference) of the same run under fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramlab.core.simulation.model import build_model
    from vramlab.core.simulation.step import measure
    from vramlab.core.simulation.tracker import MemoryTracker

    tracker = MemoryTracker()
    seen: list[list[int]] = []

    def build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        model = build_model(*args, **kwargs)
        seen.append(_inputs_at_each_forward(model, tracker))
        return model

    with FakeTensorMode(allow_non_fake_inputs=False):
        measure(_spec(), _setup(method="full", weights="fp32", compute="fp32", grad_accum=ACCUM), torch.device("cpu"),
                real=False, tracker=tracker, steps=STEPS, builder=build)
    return seen[0]


def _spec():  # noqa: ANN202
    from vramlab.core.sources.hf_config import spec_from_hf_config

    return spec_from_hf_config({"model_type": "llama", **CONFIG}, id="tiny", name="tiny")


def _setup(**kw):  # noqa: ANN003, ANN202
    from vramlab.core.spec.training import TrainingSetup

    return TrainingSetup(micro_batch=BATCH, seq_len=SEQ, **kw)


def test_the_step_holds_every_micro_batch_as_trainer_does(tmp_path) -> None:  # noqa: ANN001
    """At each forward of the second optimizer step (the data loader has nothing left to fetch ahead, which on
    CUDA would be host memory anyway) the Trainer holds both micro-batches; so does the builder's step."""
    run = _trainers_run(tmp_path)
    assert len(run) == ACCUM * STEPS
    assert run[-1] == run[-2] > 0  # the first micro-batch is still alive at the second's forward
    assert _builders_run()[-ACCUM:] == run[-ACCUM:]


def test_the_estimate_holds_them_as_its_reference_does() -> None:
    """The estimate equals the builder's step with more micro-batches than the two it runs: the held ones count."""
    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate

    spec, setup = _spec(), _setup(method="lora", grad_accum=8)
    est, sim = estimate(spec, setup, match_simulation=True), simulate(spec, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert est.components[Kind.INPUTS] == sim.components[Kind.INPUTS]
    fewer = estimate(spec, setup.replace(grad_accum=2), match_simulation=True)
    assert est.components[Kind.INPUTS] > fewer.components[Kind.INPUTS]


@pytest.mark.slow  # the same mechanism as above, on a vision-language model's own class: make test-slow
@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_vlms_micro_batches_keep_their_pixel_inputs(objective: str) -> None:
    """A vision-language model's held micro-batches keep their pixel inputs (the collator's ``pixel_values`` and
    grid go to the device with the ids): transformers' Qwen2.5-VL class under fake tensors, and the estimate."""
    pytest.importorskip("peft")
    from tests.test_vlm import QWEN25_VL, _setup
    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate

    one = _setup("frozen", "lora", (224, 168), 1, "sdpa").replace(objective=objective)
    three = one.replace(grad_accum=3)
    est, sim = estimate(QWEN25_VL, three, match_simulation=True), simulate(QWEN25_VL, three)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert est.components[Kind.INPUTS] == sim.components[Kind.INPUTS]
    assert sim.components[Kind.INPUTS] == 3 * simulate(QWEN25_VL, one).components[Kind.INPUTS]
