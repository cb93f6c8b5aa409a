"""Options compose (issue 28): families x method x objective x sharding x loss x autocast, sampled so that every
pair of values of two axes is in some cell (a greedy pairwise design), each answered cell held to the reference.
The loss axis: transformers' own, chunked, bf16 logits, Cut Cross Entropy, TRL's fused LM head, Liger's fused
linear cross-entropy.

For each cell the estimate (the variant that predicts the simulation) is compared with the same setup run under
fake tensors: transformers' own classes (+ peft) for the text families (``simulate --hf``) and for the
vision-language models (their only simulation), every objective's TRL step on transformers' classes (TRL's
trainers themselves do not run here: no GPU). A refused cell records the reason the validation gives.

Tiny widths (two to seven layers, vocabulary 8,000 for the text families, 1,000 for the hand-written VLMs, 512
for the VLMs traced whole): the mechanisms, not the sizes. The families: Llama and Gemma 2 hand-written, Llama
traced; LLaVA-1.5, Qwen2.5-VL, Gemma 3, Llama 3.2 Vision (mllama) and PaliGemma hand-written VLMs; Qwen2-VL,
Mistral 3 and LLaVA-NeXT traced whole. A traced family traces once per recipe structure (up to about 10 minutes
each on two cores: the recorded cells' estimate_seconds).

The design grows by stages (FAMILY_STAGES): the first eight families' greedy design (48 cells) is kept cell for
cell, and the families added after it (mllama, PaliGemma, LLaVA-NeXT) get cells of their own, greedy over the
pairs the kept cells leave; every pair of two axes' values is still in some cell, and a recorded run of the earlier
stages stays valid (``--only family=...`` runs the new families' cells and keeps the others' rows).

Run: .venv/bin/python benchmarks/composition.py [--out NAME] [--cells N] [--objective sft] [--only AXIS=VALUE]
(about 25-30 minutes on two cores); ``composition.json`` is the whole design, ``composition-sft.json`` the
pairs of the other axes with SFT held (recorded with the first five families, before Gemma 3 and the traced VLMs
joined: about an hour to re-run at eleven). ``--only objective=orpo`` re-runs the design's cells with that value and
keeps the other cells' rows from the recorded file (a change that touches one value of one axis); repeated, the
cells that match each (``--only objective=grpo --only "family=llava (hand-written VLM)|qwen2.5-vl (hand-written
VLM)"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from common import record  # noqa: E402

from tests.support.traced_vlm import generic_configs, tiny_configs  # noqa: E402
from tests.test_handwritten_vs_hf import GEMMA2 as HW_GEMMA2  # noqa: E402
from tests.test_vlm import LLAVA, QWEN25_VL  # noqa: E402
from tests.test_vlm_gemma3 import GEMMA3  # noqa: E402
from tests.test_vlm_mllama import TINY as MLLAMA  # noqa: E402
from tests.test_vlm_paligemma import _spec as paligemma_spec  # noqa: E402
from vramlab.core.checks import SetupError  # noqa: E402
from vramlab.core.sources.hf_config import hf_config_to_spec, spec_from_hf_config  # noqa: E402
from vramlab.core.spec.model import ModelSpec  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402

LLAMA = ModelSpec(id="llama-tiny", name="Llama (tiny)", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=8000)
GEMMA2 = spec_from_hf_config({**HW_GEMMA2, "vocab_size": 8000, "num_hidden_layers": 4}, id="gemma2-tiny",
                             name="Gemma 2 (tiny)")

PALIGEMMA = paligemma_spec(112)


# three text layers, as Mistral 3's: with five, the traced GRPO cell under ZeRO-3 is not fitted (its two- and
# three-layer traces differ by more than a layer: four events' sizes follow the depth) and is simulated whole,
# about 14 minutes on two cores; the alignment that once took over an hour there now answers in 0.2 s
# (core/tracing/align.py)
_NEXT = tiny_configs()["llava_next"]
LLAVA_NEXT = {**_NEXT, "text_config": {**_NEXT["text_config"], "num_hidden_layers": 3}}


def _traced_vlm(config: dict, name: str) -> ModelSpec:
    return hf_config_to_spec(config, id=name, name=name)[0]


FAMILIES = {
    "llama (hand-written)": LLAMA,
    "gemma2 (hand-written)": GEMMA2,
    "llama (traced)": dataclasses.replace(LLAMA, id="llama-traced", tape="traced"),
    "qwen2.5-vl (hand-written VLM)": QWEN25_VL,
    "llava (hand-written VLM)": LLAVA,
    "gemma3 (hand-written VLM)": GEMMA3,
    # families traced whole: rules of their own (Qwen2-VL) or their processor class (Mistral 3); Gemma 4's traced
    # GRPO cell ran over 12 minutes here, so it is held by tests/test_vlm_any.py instead
    "qwen2-vl (traced VLM)": _traced_vlm(tiny_configs()["qwen2_vl"], "qwen2-vl-tiny"),
    "mistral3 (traced VLM)": _traced_vlm(generic_configs()["mistral3"], "mistral3-tiny"),
    # joined the design later (FAMILY_STAGES)
    "mllama (hand-written VLM)": MLLAMA,
    "paligemma (hand-written VLM)": PALIGEMMA,
    "llava-next (traced VLM)": _traced_vlm(LLAVA_NEXT, "llava-next-tiny"),
}
# the family axis grew in stages: the cells of a stage's design are kept as they were and the next stage's families
# join them with cells of their own (greedy over the pairs those cells leave), so that recorded rows stay valid
FAMILY_STAGES = (8, 11)
AXES = {
    "family": list(FAMILIES),
    "method": ["full", "lora", "qlora", "freeze"],
    "objective": ["sft", "dpo", "orpo", "grpo"],
    "sharding": ["none", "zero2", "zero3+offload", "fsdp"],
    "loss": ["hf", "chunked", "bf16", "cce", "trl", "liger"],
    "autocast": ["off", "on"],
}


def pairwise(axes: dict[str, list[str]], seed: int = 0, start: list[dict] | tuple = ()) -> list[dict]:
    """A greedy pairwise design: the cells ``start``, then cells from the full product, each the one covering most
    pairs not yet covered."""
    names = list(axes)
    product = [dict(zip(names, values)) for values in itertools.product(*axes.values())]
    random.Random(seed).shuffle(product)
    todo = {(a, x, b, y) for a, b in itertools.combinations(names, 2) for x in axes[a] for y in axes[b]}

    def pairs(cell: dict) -> set:
        return {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(names, 2)}

    out = list(start)
    for cell in out:
        todo -= pairs(cell)
    while todo:
        best = max(product, key=lambda c: len(pairs(c) & todo))
        out.append(best)
        todo -= pairs(best)
    return out


def design(axes: dict[str, list[str]]) -> list[dict]:
    """The design of ``axes`` grown by FAMILY_STAGES: every pair of two axes' values in some cell."""
    cells: list[dict] = []
    for n in FAMILY_STAGES:
        cells = pairwise(dict(axes, family=axes["family"][:n]), start=cells)
    return cells


def setup_of(cell: dict) -> TrainingSetup:
    method = cell["method"]
    kw: dict = {"method": method, "seq_len": 128, "micro_batch": 2, "gpus": 1}
    if method in ("lora", "qlora"):
        kw["lora_targets"] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    if method == "freeze":
        kw["trainable_layers"] = 1
    if cell["autocast"] == "on":
        if method == "qlora":
            kw["amp"] = True
        else:
            kw["weights"] = "fp32"
    elif method != "qlora":
        kw["weights"] = "bf16"
    sharding = cell["sharding"]
    if sharding != "none":
        kw["gpus"] = 4
        kw["sharding"] = sharding.split("+")[0]
        if sharding.endswith("offload"):
            kw["offload"] = "optimizer"
    if cell["loss"] == "chunked":
        kw["chunked_loss"] = True
    elif cell["loss"] == "bf16":
        kw["loss_fp32"] = False
    elif cell["loss"] in ("cce", "trl", "liger"):
        kw["loss_kernel"] = cell["loss"]
    objective = cell["objective"]
    if objective != "sft":
        kw["objective"] = objective
        kw["completion_len"] = 64
        if objective == "grpo":
            kw["num_generations"] = 2
    spec = FAMILIES[cell["family"]]
    if spec.vision is not None:
        kw.update(images=1, image_width=320, image_height=240, vision_tuning="frozen")
    return TrainingSetup(**kw)


def run_cell(cell: dict) -> dict:
    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate

    spec = FAMILIES[cell["family"]]
    out = dict(cell)
    try:
        setup = setup_of(cell)
        setup.validate(spec)
    except SetupError as e:
        out.update(status="refused", reason=str(e))
        return out
    t0 = time.perf_counter()
    try:
        est = estimate(spec, setup, match_simulation=True)
    except SetupError as e:
        out.update(status="refused", reason=str(e))
        return out
    out["estimate_seconds"] = round(time.perf_counter() - t0, 3)
    plain = dataclasses.replace(spec, tape="auto")
    hf = spec.vision is None
    t0 = time.perf_counter()
    try:
        ref = simulate(plain, setup, hf=hf)
    except SetupError as e:
        out.update(status="no reference", reason=str(e), estimate=est.peak_allocated_bytes, source=est.source)
        return out
    err = (est.peak_allocated_bytes - ref.peak_allocated_bytes) / ref.peak_allocated_bytes
    out.update(status="answered", source=est.source, reference=ref.source, estimate=est.peak_allocated_bytes,
               simulated=ref.peak_allocated_bytes, error=round(err, 6), within=abs(err) <= 0.005,
               estimate_phase=est.peak_phase, simulated_phase=ref.peak_phase,
               simulate_seconds=round(time.perf_counter() - t0, 3))
    return out


def _recorded(name: str, cells: list[dict], only: list[str]) -> list[dict | None]:
    """The recorded rows of ``name`` for the cells ``only`` (AXIS=VALUE[|VALUE...], each of them) does not select
    (None: re-run it); the recorded design must be this one, cell for cell, or its first stages (FAMILY_STAGES):
    the cells past them are run."""
    import json

    from common import RESULTS

    wanted = {}
    for item in only:
        axis, _, values = item.partition("=")
        wanted[axis] = values.split("|")
        if axis not in AXES or not set(wanted[axis]) <= set(AXES[axis]):
            raise SystemExit(f"--only {item}: expected AXIS=VALUE[|VALUE...] with AXIS one of {', '.join(AXES)}")
    recorded = json.loads((RESULTS / f"{name}.json").read_text())["cells"]
    if [{k: r[k] for k in AXES} for r in recorded] != cells[:len(recorded)]:
        raise SystemExit(f"results/{name}.json records another design: run it whole")
    recorded += [None] * (len(cells) - len(recorded))
    return [None if all(cell[a] in v for a, v in wanted.items()) else row for cell, row in zip(cells, recorded)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="composition", help="result file name under benchmarks/results/")
    ap.add_argument("--cells", type=int, default=0, help="run only the first N cells of the design (0: all)")
    ap.add_argument("--objective", help="hold the objective axis at this value (e.g. sft: the other axes' pairs)")
    ap.add_argument("--only", action="append", help="AXIS=VALUE[|VALUE...]: re-run only these cells of the design "
                    "(repeated: the cells that match each), the others' rows kept from the recorded file")
    args = ap.parse_args()
    os.environ.setdefault("VRAMLAB_CACHE_DIR", tempfile.mkdtemp(prefix="vramlab-composition-"))
    axes = dict(AXES, objective=[args.objective]) if args.objective else AXES
    cells = design(axes)
    if args.cells:
        cells = cells[:args.cells]
    kept = _recorded(args.out, cells, args.only) if args.only else None
    rows = []
    for i, cell in enumerate(cells):
        row = kept[i] if kept is not None and kept[i] is not None else run_cell(cell)
        rows.append(row)
        print(i, {k: row.get(k) for k in ("family", "method", "objective", "sharding", "loss", "autocast", "status",
                                          "error", "reason")}, flush=True)
    answered = [r for r in rows if r["status"] == "answered"]
    summary = {"cells": len(rows), "answered": len(answered), "within_0.5%": sum(r["within"] for r in answered),
               "refused": sum(r["status"] == "refused" for r in rows),
               "no_reference": sum(r["status"] == "no reference" for r in rows),
               "worst_error": max((abs(r["error"]) for r in answered), default=None)}
    print(record(args.out, {"axes": axes, "summary": summary, "cells": rows}))
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
