"""The fit's layer alignment (``core/tracing/solve.py``'s ``layer_chunks``) against difflib's, on traces of a
generating step (issue 28: a traced GRPO step of LLaVA-NeXT at five text layers, ~40,000 and ~51,000 events, spent
40 minutes and more in difflib).

``layer_chunks`` finds what one more layer adds by difflib's alignment of a trace at two and at three layers. The
old code ran ``difflib.SequenceMatcher`` (no junk, ``autojunk=False``), whose longest match walks every pair of
equal events: quadratic where events repeat, as they do when the extra layer runs in every generated token's
forward. The new one keeps difflib's recursion and reads each longest match from a suffix automaton
(``core/tracing/align.py``). Each case times both on the same two traces (CPU seconds) and checks the chunks are
equal; difflib is skipped above ``--difflib-max`` events (it would take minutes to hours).

Cases: synthetic traces shaped as a generating step (a prompt, then per generated token a forward through every
layer, then the loss's forward, backward and the optimizer), 5,000 to ~57,000 events; and a tiny OLMo's GRPO step
(LoRA, TRL's trainer; needs trl) traced at two and three layers, ``--completion`` tokens generated.

Run: .venv/bin/python benchmarks/trace_align.py [--completion 64] [--difflib-max 25000]
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import record  # noqa: E402

from vramlab.core.tracing import align, capture, solve  # noqa: E402


def _difflib(a: list, b: list) -> list:
    return difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()


def generating(tokens: int, depth: int, layer: int = 60, rest: int = 20) -> capture.Trace:
    """A trace shaped as a generating step: each event an allocation whose (kind, size) names what it is."""
    fwd = list(range(1000, 1000 + layer))
    seq = list(range(10, 300))
    for t in range(tokens):
        seq += list(range(100, 100 + rest // 2)) + fwd * depth + list(range(200, 200 + rest // 2)) + [6 + t % 3]
    seq += [7, 8] + fwd * depth + [9] + list(range(2000, 2000 + 2 * layer)) * depth + [11, 12]
    seq += list(range(3000, 3006)) * depth + [13]
    ops = [(capture.ALLOC, i, v % 7, 0, 0) for i, v in enumerate(seq)]
    return capture.Trace(ops, [16 * (v + 1) for v in seq], ["step"], 0, 0, 0)


def grpo(completion: int) -> tuple[capture.Trace, capture.Trace]:
    from vramlab.core.sources.traced_config import traced_spec
    from vramlab.core.spec.training import Method, Objective, TrainingSetup

    tiny = {"model_type": "olmo", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 500, "max_position_embeddings": 2048}
    spec, _ = traced_spec(tiny, "olmo", id="m", name="m", source="config.json", dtype=None)
    s = completion + 8
    setup = TrainingSetup(method=Method.LORA, micro_batch=2, seq_len=s, completion_len=completion,
                          objective=Objective.GRPO, num_generations=2)
    low, more = (capture.trace_both(spec, setup, capture.Point(d, 2, s, setup.lora_rank), spec.transformers_config,
                                    steps=1)[0] for d in (2, 3))
    return low, more


def timed(low: capture.Trace, more: capture.Trace, with_difflib: bool) -> dict:
    t0 = time.process_time()
    new = solve.layer_chunks(low, more)
    row = {"events": [len(low.ops), len(more.ops)], "chunks": len(new),
           "new_cpu_s": round(time.process_time() - t0, 3)}
    if with_difflib:
        t0 = time.process_time()
        with mock.patch.object(align, "opcodes", _difflib):
            old = solve.layer_chunks(low, more)
        row["difflib_cpu_s"] = round(time.process_time() - t0, 3)
        row["same_chunks"] = old == new
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--completion", type=int, default=64, help="tokens the GRPO case generates (0: skip it)")
    ap.add_argument("--difflib-max", type=int, default=25_000, help="run difflib up to this many events")
    args = ap.parse_args()
    cases = {}
    for tokens in (40, 100, 200, 400, 800):
        low, more = generating(tokens, 2), generating(tokens, 3)
        name = f"synthetic, {tokens} generated tokens"
        cases[name] = timed(low, more, len(more.ops) <= args.difflib_max)
        print(name, cases[name], flush=True)
    if args.completion:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed: the GRPO case is skipped")
        else:
            t0 = time.perf_counter()
            low, more = grpo(args.completion)
            name = f"tiny OLMo GRPO (LoRA), {args.completion} tokens generated, 2 and 3 layers"
            cases[name] = {**timed(low, more, len(more.ops) <= args.difflib_max),
                           "trace_wall_s": round(time.perf_counter() - t0, 1)}
            print(name, cases[name], flush=True)
    same = all(c.get("same_chunks", True) for c in cases.values())
    path = record("trace_align", {"what": __doc__.split("\n\n")[0], "cases": cases, "same_chunks": same})
    print(path)


if __name__ == "__main__":
    main()
