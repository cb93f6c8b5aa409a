"""Every array of the traced tapes over a few models and recipes, to the byte.

The proof that a change to how the trace runs (issue 12: the first trace faster) leaves what it records unchanged.

Each case is traced from nothing (an empty cache folder, a fresh process per tree), as CUDA runs it and as the
simulation does; the digest is a SHA-256 over every stored array of both tapes (coefficients, signs, kinds,
tags, phases, references, multiplicities, the symbolic sizes, the parameter counts, the mode and the note
without its seconds). Cases: the two 7B configs of ``trace_speed.py`` (full width, traced at reduced depth) in
both of its recipes, and small configs of GPT-NeoX, OLMo and Qwen3-MoE with LoRA on fused and on all linear
layers, QLoRA NF4, gradient accumulation with checkpointing and full fine-tuning.

``--old REF`` traces the same cases with that commit's code (``git archive``, imported ahead of this tree) in
the same run, and says whether every digest is equal.

Run: .venv/bin/python benchmarks/trace_identity.py [--old REF]   (a minute or two per tree on two cores)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import old_tree, record  # noqa: E402

TINY = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 500, "max_position_embeddings": 2048}
SMALL = {
    "neox": {**TINY, "model_type": "gpt_neox", "rotary_pct": 0.25, "tie_word_embeddings": False},
    "olmo": {**TINY, "model_type": "olmo", "num_key_value_heads": 2},
    "qwen3_moe": {**TINY, "model_type": "qwen3_moe", "num_key_value_heads": 2, "head_dim": 16,
                  "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
}
SMALL_CASES = [
    ("neox", "lora-fused", {"method": "lora", "lora_targets": "query_key_value,dense", "micro_batch": 2,
                            "seq_len": 300}),
    ("neox", "lora-accumulation-checkpointing", {"method": "lora", "lora_targets": "query_key_value,dense",
                                                 "micro_batch": 2, "seq_len": 300, "grad_accum": 2,
                                                 "grad_ckpt": True}),
    ("neox", "qlora-nf4", {"method": "qlora", "lora_targets": "all-linear", "micro_batch": 2, "seq_len": 300}),
    ("olmo", "full", {"micro_batch": 1, "seq_len": 300}),
    ("qwen3_moe", "lora-all-linear", {"method": "lora", "lora_targets": "all-linear", "micro_batch": 2,
                                      "seq_len": 300}),
]

CHILD = """
import hashlib, json, re, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
from trace_identity import cases
from vramlab.core import traced
from vramlab.core.estimator.stored import TraceStore
from vramlab.core.sources.traced_config import traced_spec
from vramlab.core.spec.training import TrainingSetup

out = {}
for name, cfg, recipe in cases():
    spec, _ = traced_spec(cfg, cfg["model_type"], id="m", name="m", source="config.json", dtype=None)
    setup = TrainingSetup(**recipe)
    h = hashlib.sha256()
    for cuda in (True, False):
        t = traced.traced_tape(spec, setup, cuda=cuda, store=TraceStore(Path(sys.argv[2])))
        for a in (t.coef, t.sign, t.kind, t.new_kind, t.tag, t.phase, t.ref):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
            h.update(repr(a.shape).encode())
        note = re.sub(r" in [0-9.]+ s", "", t.note)  # the note says how long the trace took
        h.update(repr((t.phases, sorted(t.multiplicity.items()), t.symbolic, t.total_params, t.trainable_base,
                       t.trainable_per_rank, t.mode, note)).encode())
    out[name] = h.hexdigest()[:16]
print(json.dumps(out))
"""


def cases() -> list[tuple[str, dict, dict]]:
    from trace_speed import MODELS, RECIPES

    out = [(f"{model} / {recipe}", cfg, r) for model, cfg in MODELS.items() for recipe, r in RECIPES.items()]
    return out + [(f"small {m} / {what}", SMALL[m], r) for m, what, r in SMALL_CASES]


def digests(code: Path | None) -> dict[str, str]:
    """Each case's digest, traced in a fresh process (``code``: an old tree's folder first on its path)."""
    env = dict(os.environ)
    env.pop("VRAMLAB_CACHE_DIR", None)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="vramlab-trace-identity-") as tmp:
        env["VRAMLAB_CACHE_DIR"] = tmp
        proc = subprocess.run([sys.executable, "-c", CHILD, str(HERE), str(Path(tmp, "tapes"))], env=env,
                              capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def overall(d: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", metavar="REF", help="trace the same cases with this commit's code too")
    args = ap.parse_args()
    new = digests(None)
    result: dict = {"what": __doc__.splitlines()[0], "digest": overall(new), "cases": new}
    print(f"this tree: {result['digest']}")
    if args.old:
        with old_tree(args.old, prefix="vramlab-trace-identity-old-") as code:
            old = digests(code)
        result["old"] = {"ref": args.old, "digest": overall(old), "cases": old}
        result["same_as_old"] = old == new
        print(f"{args.old}: {overall(old)}; the same: {old == new}")
        for name in new:
            if old.get(name) != new[name]:
                print(f"  differs: {name}")
    print(record("trace_identity", result))


if __name__ == "__main__":
    main()
