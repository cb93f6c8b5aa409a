"""Fuzz benchmark (issue 13): many generated hostile inputs per kind, each held to the contract of
tests/support/fuzz.py, and how every one ended.

Per kind (CLI flags, config files, safetensors headers, scenario setups, saved settings, calibration files):
how many inputs were tried, how many got an answer that satisfies the invariants, how many were refused
cleanly (exit 2 and one line, or a one-line SetupError; for settings: repaired with a reported problem), and
how many broke the contract: tracebacks, wrong answers (a negative, wrapped or inconsistent number, invalid
JSON, a two-line refusal) and hangs (no answer within HANG_S). The goal is zero of the last three. The
issue's own cases (the seed corpus) run first. A second table times the refusal of absurd models: they must
be refused quickly, with the bound in the message.

Run: .venv/bin/python benchmarks/fuzz.py [--examples N]   (writes benchmarks/results/fuzz.json)
"""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from common import record  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from tests.support import fuzz  # noqa: E402

HANG_S = 30  # no single input may take longer than this


class Hang(Exception):
    pass


def _alarm(_signum: int, _frame: object) -> None:
    raise Hang(f"no answer after {HANG_S} s")


def classify(kind: str, value: Any) -> tuple[str, float, str]:
    """(outcome, seconds, detail) for one input: answered, refused, traceback, wrong or hang."""
    check = fuzz.CHECKS[kind]
    t0 = time.perf_counter()
    signal.alarm(HANG_S)
    try:
        outcome, detail = check(value), ""
    except Hang as e:
        outcome, detail = "hang", str(e)
    except fuzz.ContractBroken as e:
        cause = e.__cause__
        outcome = "traceback" if cause is not None and not isinstance(cause, fuzz.ContractBroken) else "wrong"
        detail = str(e)[:300]
    except Exception as e:  # noqa: BLE001 - a check that itself failed is a traceback in what it ran
        outcome, detail = "traceback", "".join(traceback.format_exception_only(type(e), e)).strip()[:300]
    finally:
        signal.alarm(0)
    return outcome, time.perf_counter() - t0, detail


def run_kind(kind: str, examples: int) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    times: list[float] = []
    failures: list[str] = []

    def one(value: Any) -> None:
        outcome, seconds, detail = classify(kind, value)
        counts[outcome] += 1
        times.append(seconds)
        if detail and len(failures) < 5:
            failures.append(detail)

    for value in fuzz.SEED_CORPUS[kind]:
        one(value)
    seeds = sum(counts.values())
    test = settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))(given(fuzz.STRATEGIES[kind])(one))
    test()
    return {
        "tried": sum(counts.values()), "seed_corpus": seeds,
        "answered": counts["answered"], "refused_cleanly": counts["refused"],
        "tracebacks": counts["traceback"], "wrong_answers": counts["wrong"], "hangs": counts["hang"],
        "median_ms": round(1000 * statistics.median(times), 2), "slowest_s": round(max(times), 3),
        "failures": failures,
    }


ABSURD = {
    "10,000 layers": {**fuzz.LLAMA_CONFIG, "num_hidden_layers": 10_000},
    "100,000 layers": {**fuzz.LLAMA_CONFIG, "num_hidden_layers": 100_000},
    "100,000 experts": {**fuzz.LLAMA_CONFIG, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                        "num_local_experts": 100_000, "num_experts_per_tok": 2},
    "hidden 1e9": {**fuzz.LLAMA_CONFIG, "hidden_size": 10**9, "num_attention_heads": 8, "num_key_value_heads": 8},
    "vocab 1e12": {**fuzz.LLAMA_CONFIG, "vocab_size": 10**12},
}


def absurd_refusals() -> dict[str, Any]:
    out = {}
    for name, cfg in ABSURD.items():
        t0 = time.perf_counter()
        outcome = fuzz.check_config_file(cfg)
        out[name] = {"outcome": outcome, "seconds": round(time.perf_counter() - t0, 3)}
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=1000, help="generated inputs per kind [1000]")
    args = p.parse_args(argv)
    signal.signal(signal.SIGALRM, _alarm)
    logging.disable(logging.WARNING)  # the warnings of ignored calibration files, thousands of them
    kinds: dict[str, Any] = {}
    t0 = time.perf_counter()
    for kind in fuzz.KINDS:
        k0 = time.perf_counter()
        kinds[kind] = run_kind(kind, args.examples)
        kinds[kind]["seconds"] = round(time.perf_counter() - k0, 1)
        r = kinds[kind]
        print(f"{kind:<20} tried {r['tried']:>5}  answered {r['answered']:>5}  refused {r['refused_cleanly']:>5}  "
              f"tracebacks {r['tracebacks']}  wrong {r['wrong_answers']}  hangs {r['hangs']}  "
              f"({r['seconds']} s, slowest {r['slowest_s']} s)", flush=True)
        for f in r["failures"]:
            print(f"    {f}", flush=True)
    absurd = absurd_refusals()
    for name, r in absurd.items():
        print(f"{name:<20} {r['outcome']} in {r['seconds']} s")
    broken = sum(r["tracebacks"] + r["wrong_answers"] + r["hangs"] for r in kinds.values())
    path = record("fuzz", {
        "note": "in-process, derandomized off (a new sample each run); machine shared with other jobs while "
                "recorded. 'refused_cleanly' for settings means repaired with a reported problem.",
        "examples_per_kind": args.examples, "hang_s": HANG_S, "kinds": kinds, "absurd_models": absurd,
        "total_tried": sum(r["tried"] for r in kinds.values()), "contract_broken": broken,
        "seconds": round(time.perf_counter() - t0, 1),
    })
    print(f"{'contract broken':<20} {broken}   -> {path}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
