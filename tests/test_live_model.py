"""The numbers behind the live profile view (core.live), tested where Qt is not installed: the ring buffer of
readings, phase bands, predicted-versus-measured rows and the verdict of a failed run."""

from __future__ import annotations

import numpy as np

from vramlab.core.estimate import estimate
from vramlab.core.live import LiveSample, PhaseMark, RingBuffer, band_label, bands, comparison_rows, verdict
from vramlab.core.measure.profile import ProfileOutcome
from vramlab.core.monitor.fake import RTX_4090_MEMORY_BYTES
from vramlab.core.spec import ModelSpec, TrainingSetup
from vramlab.core.units import Unit

TINY = ModelSpec(id="tiny", name="Tiny", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, vocab_size=300)
SETUP = TrainingSetup(method="lora", seq_len=64)


def test_ring_buffer_keeps_the_newest_samples_in_order():
    buf = RingBuffer(capacity=5)
    for i in range(8):
        buf.append(LiveSample(float(i), device_used_bytes=i * 10 if i != 6 else None))
    assert len(buf) == 5
    assert buf.column("t_s").tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert np.isnan(buf.column("device_used_bytes")[3]) and buf.last("device_used_bytes") == 70.0
    assert buf.max("device_used_bytes") == 70.0 and buf.max("power_w") is None


def test_bands_follow_the_phase_marks_with_predicted_and_measured_peaks():
    predicted = estimate(TINY, SETUP, None, match_simulation=True)
    marks = [PhaseMark(1.0, "load", 0, 0), PhaseMark(2.0, "forward@1", 5, 5, "load", 7, 7),
             PhaseMark(2.5, "backward@1", 9, 9, "forward@1", 11, 11)]
    out = bands(marks, 3.0, predicted, started_s=0.1)
    assert [b.key for b in out] == ["start", "load", "forward@1", "backward@1"]
    assert out[1].measured_bytes == 7 and out[2].measured_bytes == 11 and out[3].measured_bytes is None
    assert out[3].t1_s == 3.0 and not out[3].done
    assert out[2].predicted_bytes == next(p.bytes for p in predicted.phases if p.key == "forward@1")
    assert band_label("optimizer@2") == "opt 2" and band_label("backward@1", short=False) == "Backward, step 1"


def test_verdict_and_rows_for_a_failed_run():
    failed = ProfileOutcome(False, "oom", "CUDA out of memory", "cuda", failed_phase="backward@1",
                            memory_at_failure=20 * 1024**3)
    v = verdict(failed, None, RTX_4090_MEMORY_BYTES, Unit.GIB)
    assert v.state == "nofit"
    assert v.text == ("✘ Out of memory in backward, step 1 with 20.00 GiB allocated (tensors): this setup does not "
                      "fit the GPU (CUDA out of memory). The profiling process ended and its memory was returned.")
    assert comparison_rows(failed, None) == []
