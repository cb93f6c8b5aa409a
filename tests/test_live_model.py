"""The numbers behind the live profile view (core.live), tested where Qt is not installed: the ring buffer of
readings, phase bands, predicted-versus-measured rows and the verdict of a failed run."""

from __future__ import annotations

import numpy as np

from vramlab.core.estimate import estimate
from vramlab.core.live import LiveSample, PhaseMark, RingBuffer, band_label, bands, comparison_rows, verdict
from vramlab.core.monitor.fake import RTX_4090_MEMORY_BYTES
from vramlab.core.profiling.outcomes import ProfileOutcome
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
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


def test_ring_buffer_max_tail_and_count_follow_every_sample():
    buf = RingBuffer(capacity=4)
    values = [5.0, None, 9.0, 2.0, 1.0, 3.0]
    for i, v in enumerate(values):
        buf.append(LiveSample(float(i), rss_bytes=v))
        held = [x for x in values[max(0, i - 3): i + 1] if x is not None]
        assert buf.max("rss_bytes") == max(held)  # of the samples held, also once the buffer wrapped
    assert buf.appended == 6 and len(buf) == 4
    assert buf.tail("t_s", 2).tolist() == [4.0, 5.0] and buf.tail("t_s", 10).tolist() == [2.0, 3.0, 4.0, 5.0]
    buf.clear()
    assert buf.appended == 0 and buf.max("rss_bytes") is None and buf.tail("t_s", 3).size == 0


def test_frame_pacer_draws_at_once_what_moves_and_the_rest_at_the_calm_rate():
    from vramlab.core.live import FramePacer

    p = FramePacer(calm_s=1.0, move_px=1.0)
    assert p.due(0.0) == "event"  # the first frame
    p.drawn(0.0, "event", {"rss_bytes": 1000.0})
    p.set_scale(bytes_per_px=10.0, top_bytes=2000.0)
    p.observe("rss_bytes", 1009.0)  # under a pixel from what is drawn
    p.observe("power_w", None)
    assert p.due(0.5) is None
    p.observe("rss_bytes", 991.0)  # still under a pixel: 9 bytes below
    assert p.due(0.99) is None and p.due(1.0) == "calm"
    p.drawn(1.0, "calm", {"rss_bytes": 991.0})
    p.observe("rss_bytes", 1001.0)  # a pixel from the value drawn last (not from the first frame's)
    assert p.due(1.05) == "peak"
    p.drawn(1.05, "peak", {"rss_bytes": 1001.0})
    p.observe("device_used_bytes", 5.0)  # a curve the last frame did not draw
    assert p.due(1.1) == "peak"
    p.drawn(1.1, "peak", {"rss_bytes": 1001.0, "device_used_bytes": 5.0})
    p.set_scale(bytes_per_px=1e9, top_bytes=2000.0)
    p.observe("rss_bytes", 2001.0)  # above the plot's top: a new peak, however coarse the scale
    assert p.due(1.15) == "peak"
    assert p.due(1.15, forced=True) == "event"
    assert p.reasons == {"event": 1, "peak": 2, "calm": 1}
