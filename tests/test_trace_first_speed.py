"""What the first trace does to be faster (issue 12: the first estimate of a new 7B architecture well under
10 s) changes nothing it records: each shortcut switched off gives the same events, array for array.
``benchmarks/trace_identity.py`` holds the whole tapes equal over more models and recipes, old tree beside new.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from vramlab.core.sources.traced_config import traced_spec  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402
from vramlab.core.tracing import capture, hflora  # noqa: E402
from vramlab.core.tracing import hf as hfmod  # noqa: E402

TINY = {"model_type": "olmo", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 500, "max_position_embeddings": 2048}


def _run(setup: TrainingSetup) -> tuple:
    spec, _ = traced_spec(TINY, "olmo", id="m", name="m", source="config.json", dtype=None)
    cuda, sim = capture.trace_both(spec, setup, capture.Point(3, 2, 41, setup.lora_rank), spec.transformers_config)
    return tuple((t.ops, t.sizes, t.dims, t.phases, t.total_params, t.trainable_params) for t in (cuda, sim))


def test_the_recorder_answers_a_tensors_device_as_fake_tensor_mode_does() -> None:
    """The recorder answers ``prim.device`` (most of the ops a step dispatches) itself: the device a fake tensor
    says it is on, and "meta" while FakeTensorMode runs a kernel, as FakeTensorMode's own handler does."""
    rec = capture.Recorder()
    with FakeTensorMode() as mode:
        t = torch.empty(3, 4)
        asked = []
        assert rec.__torch_dispatch__(capture._DEVICE, (), (t,)) == torch.device("cpu") == t.device
        with torch._subclasses.fake_tensor.in_kernel_invocation_manager(mode):
            asked.append(rec.__torch_dispatch__(capture._DEVICE, (), (t,)))
    assert asked == [torch.device("meta")]


@pytest.mark.parametrize("setup", [TrainingSetup(micro_batch=2, seq_len=41),
                                   TrainingSetup(method="lora", lora_targets="q,v", micro_batch=2, seq_len=41)],
                         ids=["full", "lora"])
def test_a_run_records_the_same_events_with_every_shortcut_off(setup: TrainingSetup,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _run(setup)
    with monkeypatch.context() as m:
        m.setattr(capture, "_DEVICE", object())  # prim.device through FakeTensorMode, as before
        m.setattr(hfmod, "default_device", torch.device)  # the build inside `with torch.device("cpu")`
        m.setattr(hflora, "default_device", torch.device)
        slow = _run(setup)
    assert fast == slow


def test_a_trace_without_lora_does_not_import_peft() -> None:
    """peft is imported before the fake-tensor mode starts for a LoRA step only: full fine-tuning never needs
    it (a fifth of a second of the first trace)."""
    code = textwrap.dedent(f"""
        import sys
        from vramlab.core.tracing import capture
        from vramlab.core.sources.traced_config import traced_spec
        from vramlab.core.spec.training import TrainingSetup
        spec, _ = traced_spec({TINY!r}, "olmo", id="m", name="m", source="config.json", dtype=None)
        capture.trace_both(spec, TrainingSetup(micro_batch=2, seq_len=41), capture.Point(2, 2, 41, 8),
                         spec.transformers_config)
        print(sorted(m for m in sys.modules if m == "peft" or m.startswith("peft.")))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_trace_leaves_what_was_frozen_before_it_frozen() -> None:
    """A trace freezes what exists before its run (its collections at phase boundaries look at the run alone),
    then unfreezes it; what the app had frozen once started (app/workers.py) stays frozen, and a process that
    had frozen nothing is left with nothing frozen."""
    assert gc.get_freeze_count() == 0
    _run(TrainingSetup(micro_batch=2, seq_len=41))
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        _run(TrainingSetup(micro_batch=2, seq_len=41))
        assert gc.get_freeze_count() >= before > 0
    finally:
        gc.unfreeze()
