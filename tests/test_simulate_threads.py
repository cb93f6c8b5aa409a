"""Two measured steps at once in one process (the window's simulation and trace workers) each give the number
they give alone: a step's tracker and its guard's patches are the process's, so the second waits for the first
(core/simulation/context.py ``exclusive``)."""

from __future__ import annotations

import threading

from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

SMALL = ModelSpec(id="small", name="Small", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=1000)
LORA_AMP = TrainingSetup(method="lora", micro_batch=2, seq_len=128, amp=True)
FULL_CKPT = TrainingSetup(method="full", micro_batch=1, seq_len=64, grad_ckpt=True)


def test_two_simulations_on_two_threads_each_give_their_own_number():
    alone = {"a": simulate(SMALL, LORA_AMP).peak_allocated_bytes, "b": simulate(SMALL, FULL_CKPT).peak_allocated_bytes}
    together: dict[str, int] = {}
    errors: list[BaseException] = []

    def run(key: str, setup: TrainingSetup) -> None:
        try:
            together[key] = simulate(SMALL, setup).peak_allocated_bytes
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=("a", LORA_AMP)), threading.Thread(target=run, args=("b", FULL_CKPT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert together == alone
