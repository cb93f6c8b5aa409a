"""DPO / IPO, KTO, ORPO / SimPO / CPO and GRPO (issue 15): the estimate against the fake-tensor simulation of
TRL 1.16.0's step over the whole matrix, at real widths, plus what the objectives cost on one 7B model.

Matrix: objectives (DPO, IPO, KTO, ORPO, SimPO, CPO, GRPO with transformers.generate and with vLLM colocated) x
(full, LoRA, QLoRA) x reference handling (a second copy, adapters disabled, precomputed, none) x checkpointing
(alternating), for three families at their real widths and vocabularies (SmolLM2-135M: Llama layout, tied;
Qwen2.5-0.5B: q/k/v biases, 152k vocabulary; GPT-2: LayerNorm, learned positions, plain MLP) with 4 decoder
layers (the estimator replays one layer and multiplies it, which the full-depth row checks), and the tiny-width
matrix of tests/test_objectives.py in full. Each row: simulated and estimated tensor peak, the difference, and
both levels' phase peaks compared.

Then Llama-2-7B (full depth, LoRA r16 on all linear layers, batch 4 x 2048, checkpointing) as SFT, DPO and
GRPO on a 24 GB and an 80 GB GPU: the numbers of docs/screenshots/objectives-*.png.

Run: .venv/bin/python benchmarks/objectives.py   (several minutes on two loaded cores)
     .venv/bin/python benchmarks/objectives.py --pair   (only ORPO / SimPO / CPO: results/objectives-pair.json)
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from common import record  # noqa: E402

from tests.support.matrix import shallow  # noqa: E402
from vramlab.core.catalog import find_gpu, find_model  # noqa: E402
from vramlab.core.estimate import estimate  # noqa: E402
from vramlab.core.simulation.simulate import simulate  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402

FAMILIES = ("smollm2-135m", "qwen2.5-0.5b", "gpt2")
# the linear layers all three families have (GPT-2's MLP has no gate)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
METHODS = ({"method": "full"}, {"method": "lora", "lora_targets": TARGETS, "lora_dropout": 0.05},
           {"method": "qlora", "lora_targets": TARGETS})


PAIR_OBJECTIVES = ("orpo", "simpo", "cpo")


def cases() -> list[tuple[str, object, dict]]:
    out = []
    for fam in FAMILIES:
        spec = shallow(find_model(fam), 4)
        for mi, method in enumerate(METHODS):
            refs = ["precomputed"] + (["copy"] if method["method"] != "qlora" else []) \
                + (["adapters"] if method["method"] != "full" else [])
            for ri, ref in enumerate(refs):
                out.append((fam, spec, {**method, "objective": "dpo", "reference": ref, "micro_batch": 2,
                                        "seq_len": 1024, "completion_len": 512, "grad_ckpt": (mi + ri) % 2 == 0}))
            out.append((fam, spec, {**method, "objective": "ipo", "micro_batch": 1, "seq_len": 2048,
                                    "grad_ckpt": mi % 2 == 1}))
            out.append((fam, spec, {**method, "objective": "kto", "micro_batch": 4, "seq_len": 1024,
                                    "grad_ckpt": mi % 2 == 0, **({"reference": "precomputed"} if mi == 2 else {})}))
            # the simulation runs every generated token (a few hundred ms each at these widths): short completions
            out.append((fam, spec, {**method, "objective": "grpo", "micro_batch": 8, "num_generations": 8,
                                    "seq_len": 576, "completion_len": 64, "grad_ckpt": mi != 1}))
            out.append((fam, spec, {**method, "objective": "grpo", "micro_batch": 4, "num_generations": 4,
                                    "seq_len": 160, "completion_len": 32, "beta": 0.04, "num_iterations": 2,
                                    "grad_ckpt": mi == 1}))
        out.append((fam, spec, {"method": "lora", "objective": "grpo", "micro_batch": 8, "num_generations": 8,
                                "seq_len": 1024, "completion_len": 512, "generation_backend": "vllm-colocate"}))
        for mi, method in enumerate(METHODS):  # ORPO / SimPO / CPO: full logits, no reference
            for oi, obj in enumerate(PAIR_OBJECTIVES):
                out.append((fam, spec, {**method, "objective": obj, "micro_batch": 1 + (mi + oi) % 2,
                                        "seq_len": 512, "grad_ckpt": (mi + oi) % 2 == 0}))
    full = find_model("qwen2.5-0.5b")  # one row at full depth: the repeated layers multiplied
    out.append(("qwen2.5-0.5b (24 layers)", full, {"method": "lora", "objective": "grpo", "micro_batch": 4,
                                                  "num_generations": 4, "seq_len": 160, "completion_len": 16,
                                                  "beta": 0.04, "grad_ckpt": True}))
    return out


def tiny_cases() -> list[tuple[str, object, dict]]:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_objectives as t

    return [(f"{fam} (tiny)", t.PAIR_FAMILIES[fam], kw) for fam, kw in t.CASES + t.PAIR_CASES]


def main(argv: list[str]) -> int:
    """``--pair``: only the ORPO / SimPO / CPO rows, recorded as results/objectives-pair.json."""
    pair = "--pair" in argv
    if pair:
        return _pair_only()
    rows = []
    worst = 0.0
    for label, spec, kw in cases() + tiny_cases():
        row = _row(label, spec, kw)
        worst = max(worst, abs(row["relative"]))
        rows.append(row)
    llama = find_model("llama-2-7b")
    base = TrainingSetup(method="lora", lora_targets="all-linear", lora_rank=16, micro_batch=4, seq_len=2048,
                         grad_ckpt=True, completion_len=1024)
    seven_b = []
    for gpu_id in ("rtx-4090", "a100-80gb"):
        gpu = find_gpu(gpu_id)
        for name, changes in (("SFT", {}), ("DPO", {"objective": "dpo"}),
                              ("GRPO", {"objective": "grpo", "num_generations": 4})):
            r = estimate(llama, dataclasses.replace(base, **changes), gpu, allocator=True)
            seven_b.append({"gpu": gpu.name, "objective": name, "tensor_peak_bytes": r.peak_allocated_bytes,
                            "reserved_bytes": r.peak_reserved_bytes, "device_used_bytes": r.device_used_bytes,
                            "peak_phase": r.peak_phase, "fits": r.fits()})
    print(record("objectives", {
        "what": "estimate vs fake-tensor simulation of TRL 1.16.0's DPO/IPO/KTO/ORPO/SimPO/CPO/GRPO step (tensor "
                "peak, phase peaks); Llama-2-7B SFT/DPO/GRPO on 24 GB and 80 GB",
        "rows": rows, "worst_relative_difference": worst,
        "all_phases_equal": all(r["phases_equal"] for r in rows),
        "llama_2_7b": seven_b,
    }))
    return 0 if worst <= 0.01 else 1


def _row(label: str, spec: object, kw: dict) -> dict:
    setup = TrainingSetup(**kw)
    t0 = time.perf_counter()
    sim = simulate(spec, setup)
    t_sim = time.perf_counter() - t0
    t0 = time.perf_counter()
    est = estimate(spec, setup, match_simulation=True)
    t_est = time.perf_counter() - t0
    diff = est.peak_allocated_bytes - sim.peak_allocated_bytes
    phases_equal = {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in sim.phases}
    print(f"{label:28s} {kw['objective']:5s} {kw['method']:6s} sim {sim.peak_allocated_bytes:>14,} "
          f"diff {diff:+,} phases {'=' if phases_equal else '!='}", flush=True)
    return {"model": label, "setup": {k: (list(v) if isinstance(v, tuple) else v) for k, v in kw.items()},
            "simulated_bytes": sim.peak_allocated_bytes, "estimated_bytes": est.peak_allocated_bytes,
            "difference_bytes": diff, "relative": diff / sim.peak_allocated_bytes, "phases_equal": phases_equal,
            "peak_phase": sim.peak_phase, "simulate_s": round(t_sim, 2), "estimate_s": round(t_est, 4)}


def _pair_only() -> int:
    rows = [_row(label, spec, kw) for label, spec, kw in cases() + tiny_cases()
            if kw["objective"] in PAIR_OBJECTIVES]
    worst = max(abs(r["relative"]) for r in rows)
    print(record("objectives-pair", {
        "what": "estimate vs fake-tensor simulation of TRL 1.16.0's trl.experimental ORPO / SimPO / CPO step "
                "(tensor peak, phase peaks): the --pair rows of benchmarks/objectives.py",
        "rows": rows, "worst_relative_difference": worst, "all_phases_equal": all(r["phases_equal"] for r in rows),
    }))
    return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
