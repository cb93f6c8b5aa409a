"""Hostile inputs generated with hypothesis, and the contract every one of them is held to (issue 13).

Each *kind* of input (CLI flags, config.json files, safetensors headers, scenario setups, saved settings,
calibration files) has a strategy and a ``check_*`` function. A check runs the input the way a user
would hand it to us and returns ``"answered"`` or ``"refused"``; anything else raises
:class:`ContractBroken`:

* answered: the numbers satisfy the invariants (:func:`check_answer`): components sum to the tensor peak,
  the peak is the highest phase, tensor <= reserved <= device, nothing negative, everything finite;
* refused: exit code 2 (or :class:`SetupError`) and one line, starting ``error:`` on the CLI;
* never a traceback, another exit code, invalid JSON, a negative or wrapped number.

tests/test_properties.py runs a few examples per kind in the default suite; benchmarks/fuzz.py runs many
and records how each ended. The strategies are weighted towards the edges: zero, negative, the bounds of
core/spec/ and just past them, huge, NaN and infinity, junk text.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from vramlab.core.catalog import find_model
from vramlab.core.checks import SetupError
from vramlab.core.cli import main
from vramlab.core.estimate import estimate
from vramlab.core.spec.edits import repair_setup_fields
from vramlab.core.spec.training import SETUP_BOUNDS, TrainingSetup

KINDS = ("cli_flags", "config_file", "safetensors_header", "scenario_setup", "settings", "calibration_file")
MODELS = ("gpt2", "qwen2.5-0.5b", "llama-3.2-1b", "qwen3-30b-a3b")


class ContractBroken(AssertionError):
    """An input that got neither a right answer nor a clean refusal."""


# ---- value strategies ------------------------------------------------------------------------------------------

def edge_ints(lo: int = 1, hi: int = 1 << 20) -> st.SearchStrategy[int]:
    """Whole numbers weighted to the edges of [lo, hi] and far beyond."""
    return st.one_of(
        st.integers(lo, min(hi, lo + 64)),
        st.sampled_from([lo - 1, lo, hi, hi + 1, 0, -1, -(10**6), 2**31, 2**32, 2**63, 2**64, 10**30]),
        st.integers(-(2**70), 2**70),
    )


junk_text = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=24)
weird_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                         st.sampled_from([0.0, -0.0, 1e-300, 1e300, math.nan, math.inf, -math.inf]))
json_scalars = st.one_of(st.none(), st.booleans(), edge_ints(), weird_floats, junk_text)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(junk_text, inner, max_size=4)),
                           max_leaves=8)

CHOICES: dict[str, list[str]] = {
    "--method": ["full", "lora", "qlora", "freeze"],
    "--weights": ["fp32", "bf16", "fp16", "int8", "nf4"],
    "--compute": ["fp32", "bf16", "fp16"],
    "--optimizer": ["adamw", "adamw8bit", "paged_adamw8bit", "sgd", "sgd_momentum", "adafactor", "lion"],
    "--optimizer-impl": ["foreach", "fused", "single"],
    "--attention": ["sdpa", "eager", "flash"],
    "--sharding": ["none", "zero1", "zero2", "zero3", "fsdp"],
    "--offload": ["none", "optimizer", "params"],
    "--lora-targets": ["q_proj,v_proj", "all-linear", "q,k,v,o", "lm_head", "gate_proj,down_proj"],
    "--gpu": ["rtx-4090", "h200", "a10", "24GiB", "1GB", "4GB", "41GB", "h100", "nvidia h200", "inf", "0GB",
              "1e9GB", "64TiB", "65TiB"],
    "--preset": ["full-amp-bf16", "lora-bf16", "qlora-nf4", "lora-int8"],
}
NUMBERS = {"--lora-rank": SETUP_BOUNDS["lora_rank"], "--trainable-layers": (1, 64),
           "--batch": SETUP_BOUNDS["micro_batch"], "--seq": SETUP_BOUNDS["seq_len"],
           "--grad-accum": SETUP_BOUNDS["grad_accum"], "--gpus": SETUP_BOUNDS["gpus"],
           "--loss-chunks": SETUP_BOUNDS["loss_chunks"]}
FLOATS = ("--lora-alpha", "--lora-dropout")
SWITCHES = ("--grad-ckpt", "--chunked-loss", "--master-weights", "--amp", "--no-amp", "--optimizer-in-backward",
            "--kbit-prepare", "--loss-bf16")


PLAUSIBLE = {"--lora-rank": (1, 256), "--trainable-layers": (1, 24), "--batch": (1, 64), "--seq": (1, 32768),
             "--grad-accum": (1, 64), "--gpus": (1, 16), "--loss-chunks": (2, 64)}


@st.composite
def cli_argv(draw: st.DrawFn) -> list[str]:
    """``estimate -m MODEL [flags] --fast --json`` with each flag absent, valid, out of range or junk. Half the
    inputs are calm (every value plausible, only their combination may be refused), half hostile."""
    calm = draw(st.booleans())
    argv = ["estimate", "-m", draw(st.sampled_from(MODELS))]
    junk = junk_text.filter(lambda t: not t.startswith("-"))
    for flag, options in CHOICES.items():
        if draw(st.integers(0, 3)) == 0:
            argv += [flag, draw(st.sampled_from(options) if calm else st.one_of(st.sampled_from(options), junk))]
    for flag, (lo, hi) in NUMBERS.items():
        if draw(st.integers(0, 3)) == 0:
            argv += [flag, str(draw(st.integers(*PLAUSIBLE[flag]) if calm else edge_ints(lo, hi)))]
    for flag in FLOATS:
        if draw(st.integers(0, 3)) == 0:
            argv += [flag, repr(draw(st.floats(0, 0.9) if calm else weird_floats))]
    argv += [s for s in SWITCHES if draw(st.integers(0, 4)) == 0]
    return [*argv, "--fast", "--json"]


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                "intermediate_size": 512, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
                "vocab_size": 1000, "max_position_embeddings": 512, "torch_dtype": "bfloat16",
                "tie_word_embeddings": False, "hidden_act": "silu"}


@st.composite
def config_dict(draw: st.DrawFn) -> dict[str, Any]:
    """A small Llama config with some of its values replaced by edge numbers, junk or nesting."""
    cfg = dict(LLAMA_CONFIG)
    calm = draw(st.booleans())
    for key in list(cfg):
        pick = draw(st.integers(0, 5 if not calm else 40))
        if pick == 0:
            cfg[key] = draw(edge_ints(1, 4096))
        elif pick == 1:
            cfg[key] = draw(json_values)
    if draw(st.booleans()):
        cfg.update(draw(st.dictionaries(st.sampled_from(["num_local_experts", "num_experts_per_tok", "head_dim",
                                                          "n_positions", "moe_intermediate_size", "model_type"]),
                                        st.one_of(edge_ints(0, 2048), json_scalars), max_size=3)))
    return cfg


# The safetensors header kind: a one-layer Llama whose correct header is generated, then (half the time) damaged.
TINY_CONFIG = {**LLAMA_CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 100}
TINY_TENSORS = {"model.embed_tokens.weight": [100, 64], "lm_head.weight": [100, 64], "model.norm.weight": [64],
                "model.layers.0.input_layernorm.weight": [64],
                "model.layers.0.post_attention_layernorm.weight": [64],
                "model.layers.0.self_attn.q_proj.weight": [64, 64], "model.layers.0.self_attn.k_proj.weight": [32, 64],
                "model.layers.0.self_attn.v_proj.weight": [32, 64], "model.layers.0.self_attn.o_proj.weight": [64, 64],
                "model.layers.0.mlp.gate_proj.weight": [128, 64], "model.layers.0.mlp.up_proj.weight": [128, 64],
                "model.layers.0.mlp.down_proj.weight": [64, 128]}


def _tile(shapes: dict[str, list[int]]) -> dict[str, Any]:
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header


@st.composite
def safetensors_header(draw: st.DrawFn) -> dict[str, Any]:
    """The tiny Llama's exact header, untouched or with one tensor's dtype, shape, offsets or entry damaged,
    a tensor dropped or added, or hostile metadata."""
    header = _tile(TINY_TENSORS)
    how = draw(st.sampled_from(["none", "none", "dtype", "shape", "offsets", "entry", "drop", "add", "metadata"]))
    name = draw(st.sampled_from(sorted(TINY_TENSORS)))
    if how == "dtype":
        header[name]["dtype"] = draw(st.one_of(st.sampled_from(["F16", "F32", "I8", "U8", "F8_E4M3", "bf16"]),
                                               junk_text))
    elif how == "shape":
        header[name]["shape"] = draw(st.lists(st.one_of(st.integers(0, 256), edge_ints(0, 4096)), max_size=4))
    elif how == "offsets":
        header[name]["data_offsets"] = draw(st.lists(edge_ints(0, 40_000), min_size=0, max_size=3))
    elif how == "entry":
        header[name] = draw(json_values)
    elif how == "drop":
        del header[name]
    elif how == "add":
        header[draw(junk_text)] = draw(st.one_of(json_values, st.just(header[name])))
    elif how == "metadata":
        header["__metadata__"] = draw(st.one_of(st.dictionaries(junk_text, junk_text, max_size=2), json_values))
    return header


SETUP_FIELDS = [f for f in TrainingSetup.__dataclass_fields__]


@st.composite
def setup_dict(draw: st.DrawFn) -> dict[str, Any]:
    """A scenario's or the settings' ``setup`` object: real field names with valid, edge or junk values."""
    valid = TrainingSetup().to_dict()
    calm = draw(st.booleans())
    out: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(SETUP_FIELDS), max_size=8, unique=True)):
        if calm:
            out[name] = draw(st.one_of(st.just(valid[name]), st.sampled_from(CALM_VALUES.get(name, [valid[name]]))))
        else:
            out[name] = draw(st.one_of(st.just(valid[name]), edge_ints(), json_scalars,
                                       st.sampled_from(["lora", "qlora", "nf4", "bf16", "fp32", "no", "yes", "True"])))
    return out


CALM_VALUES: dict[str, list[Any]] = {
    "method": ["full", "lora", "qlora", "freeze"], "weights": ["bf16", "fp32", "nf4", None],
    "compute": ["bf16", "fp32"], "amp": [None, True, False], "grad_ckpt": [True, False],
    "micro_batch": [1, 2, 8, 64], "seq_len": [128, 512, 4096], "lora_rank": [4, 16, 64], "gpus": [1, 2, 8],
    "sharding": ["none", "zero2", "fsdp"], "optimizer": ["adamw", "adamw8bit", "sgd"], "trainable_layers": [1, 4],
    "attention": ["sdpa", "eager"], "lora_targets": [["q_proj", "v_proj"], "all-linear"], "grad_accum": [1, 8],
}


@st.composite
def calibration_text(draw: st.DrawFn) -> str:
    """calibration.json: one entry, plausible two times in three and hostile otherwise, or broken JSON."""
    if draw(st.integers(0, 2)):
        item = {"gpu_name": draw(st.sampled_from(["NVIDIA GeForce RTX 4090", "GeForce RTX 4090", "NVIDIA A10"])),
                "context_bytes": draw(st.integers(0, 16 * 2**30)),
                "slack_ratio": draw(st.floats(0.25, 4.0))}
    else:
        item = {"gpu_name": draw(st.one_of(st.just("NVIDIA GeForce RTX 4090"), json_scalars)),
                "context_bytes": draw(st.one_of(st.just(600 * 2**20), edge_ints(0, 16 * 2**30), weird_floats)),
                "slack_ratio": draw(st.one_of(st.just(1.2), weird_floats, edge_ints(0, 4)))}
    text = json.dumps({"rtx4090": item})
    return draw(st.one_of(st.just(text), st.just(text), st.just(text[: draw(st.integers(0, len(text)))]),
                          st.just("[" * draw(st.integers(0, 5000)))))


STRATEGIES = {"cli_flags": cli_argv(), "config_file": config_dict(), "safetensors_header": safetensors_header(),
              "scenario_setup": setup_dict(), "settings": setup_dict(), "calibration_file": calibration_text()}


# ---- the contract ------------------------------------------------------------------------------------------------

def _no_constants(name: str) -> Any:
    raise ContractBroken(f"the JSON output holds {name}")


def check_answer(d: dict[str, Any]) -> None:
    """The invariants of an answer (the ``--json`` object of the CLI contract)."""
    peak, reserved, device = d["peak_allocated_bytes"], d["peak_reserved_bytes"], d["device_used_bytes"]
    comps = d["components"]
    numbers = [peak, reserved, device, *comps.values(), *d["phases"].values(), d["total_params"],
               d["trainable_params"]]
    if not all(isinstance(x, int) and 0 <= x < 2**62 for x in numbers):
        raise ContractBroken(f"a negative, fractional or wrapped number: {numbers}")
    if sum(comps.values()) != peak:
        raise ContractBroken(f"components sum to {sum(comps.values())}, not the peak {peak}")
    if max(d["phases"].values()) != peak:
        raise ContractBroken(f"the highest phase {max(d['phases'].values())} is not the peak {peak}")
    if not 0 < peak <= reserved <= device:
        raise ContractBroken(f"levels out of order: {peak} / {reserved} / {device}")
    if d["total_params"] <= 0:
        raise ContractBroken("no parameters")
    if "gpu" in d and d["gpu"]["headroom_bytes"] != d["gpu"]["memory_bytes"] - device:
        raise ContractBroken("headroom is not memory less the device level")


def run_cli(argv: list[str]) -> str:
    """Run the CLI in this process; "answered" or "refused", else ContractBroken."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException as e:  # noqa: BLE001 - a traceback is exactly what is being looked for
        raise ContractBroken(f"{argv}: {type(e).__name__}: {e}") from e
    lines = [x for x in err.getvalue().splitlines() if not x.startswith("warning:")]
    if code == 2:
        if out.getvalue() or len(lines) != 1 or not lines[0].startswith("error: "):
            raise ContractBroken(f"{argv}: exit 2 without exactly one error line: {err.getvalue()!r}")
        return "refused"
    if code != 0:
        raise ContractBroken(f"{argv}: exit {code}: {err.getvalue()!r}")
    try:
        data = json.loads(out.getvalue(), parse_constant=_no_constants)
    except ValueError as e:
        raise ContractBroken(f"{argv}: the output is not valid JSON ({e})") from e
    check_answer(data)
    return "answered"


@contextlib.contextmanager
def _folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="vramlab-fuzz-") as d:
        yield Path(d)


def check_cli_flags(argv: list[str]) -> str:
    return run_cli(argv)


def check_config_file(cfg: dict[str, Any]) -> str:
    with _folder() as d:
        (d / "config.json").write_text(json.dumps(cfg))
        return run_cli(["estimate", "-m", str(d / "config.json"), "--fast", "--json"])


def check_safetensors_header(header: dict[str, Any] | str) -> str:
    """The header in a safetensors file whose data section is as long as the exact header says."""
    data = 2 * sum(math.prod(shape) for shape in TINY_TENSORS.values())
    with _folder() as d:
        (d / "config.json").write_text(json.dumps(TINY_CONFIG))
        raw = (header if isinstance(header, str) else json.dumps(header)).encode()
        (d / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data))
        return run_cli(["estimate", "-m", str(d), "--fast", "--json"])


def _estimate_answer(spec: Any, setup: TrainingSetup, gpu: Any = None) -> str:
    try:
        result = estimate(spec, setup, gpu)
    except SetupError as e:  # a bound only the estimate can see (a step too large to count)
        if "\n" in str(e):
            raise ContractBroken(f"a two-line refusal: {e!r}") from e
        return "refused"
    check_answer(json.loads(json.dumps(result.to_json(), allow_nan=False)))
    return "answered"


def check_scenario_setup(data: dict[str, Any]) -> str:
    """A setup from a scenario file the user opens: valid, or refused with one line (SetupError)."""
    spec = find_model("gpt2")
    try:
        setup = TrainingSetup.from_dict(data)
        setup.validate(spec)
    except SetupError as e:
        if "\n" in str(e):
            raise ContractBroken(f"a two-line refusal: {e!r}") from e
        return "refused"
    except Exception as e:  # noqa: BLE001
        raise ContractBroken(f"{data!r}: {type(e).__name__}: {e}") from e
    return _estimate_answer(spec, setup)


def check_settings(data: dict[str, Any]) -> str:
    """The window's saved setup: always repaired into a valid setup, every problem one line."""
    spec = find_model("gpt2")
    try:
        fields, problems = repair_setup_fields(data, model=spec)
        setup = TrainingSetup().replace(**fields)
        setup.validate(spec)
    except Exception as e:  # noqa: BLE001 - the window must always start
        raise ContractBroken(f"{data!r}: {type(e).__name__}: {e}") from e
    if any("\n" in p for p in problems):
        raise ContractBroken(f"a two-line problem: {problems!r}")
    _estimate_answer(spec, setup)
    return "refused" if problems else "answered"


def check_calibration_file(text: str) -> str:
    """calibration.json in the config folder: used when valid, ignored otherwise; never a failed estimate."""
    from vramlab.core.calibration import load_all
    from vramlab.core.catalog import find_gpu

    with _folder() as d:
        (d / "calibration.json").write_text(text)
        old = os.environ.get("VRAMLAB_CONFIG_DIR")
        os.environ["VRAMLAB_CONFIG_DIR"] = str(d)
        try:
            loaded = load_all()
            _estimate_answer(find_model("gpt2"), TrainingSetup(), find_gpu("rtx-4090"))
        except ContractBroken:
            raise
        except Exception as e:  # noqa: BLE001
            raise ContractBroken(f"{text[:80]!r}: {type(e).__name__}: {e}") from e
        finally:
            if old is None:
                os.environ.pop("VRAMLAB_CONFIG_DIR", None)
            else:
                os.environ["VRAMLAB_CONFIG_DIR"] = old
    return "answered" if loaded else "refused"


CHECKS = {"cli_flags": check_cli_flags, "config_file": check_config_file,
          "safetensors_header": check_safetensors_header, "scenario_setup": check_scenario_setup,
          "settings": check_settings, "calibration_file": check_calibration_file}

# The issue's own cases, always run (the seed corpus): kind -> inputs.
SEED_CORPUS: dict[str, list[Any]] = {
    "cli_flags": [
        ["estimate", "-m", "gpt2", "--gpu", g, "--fast", "--json"] for g in ("1GB", "1G", "41GB", "4GB", "inf")
    ] + [
        ["estimate", "-m", "gpt2", "--batch", "4294967296", "--fast", "--json"],
        ["estimate", "-m", "gpt2", "--batch", "268435456", "--fast", "--json"],
        ["estimate", "-m", "gpt2", "--seq", "8589934592", "--fast", "--json"],
        ["estimate", "-m", "gpt2", "--method", "lora", "--lora-alpha", "nan", "--fast", "--json"],
        ["estimate", "-m", "gpt2", "--lora-rank", "0", "--fast", "--json"],
        ["estimate", "-m", "gpt2", "--batch", "1048576", "--seq", "134217728", "--fast", "--json"],
    ],
    "config_file": [
        {**LLAMA_CONFIG, "hidden_size": 1e30},
        {**LLAMA_CONFIG, "num_hidden_layers": 10_000},
        {**LLAMA_CONFIG, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
         "num_local_experts": 100_000, "num_experts_per_tok": 2},
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2,
         "n_positions": -1_000_000, "vocab_size": 100, "activation_function": "gelu_new"},
    ],
    "safetensors_header": [
        '{"model.embed_tokens.weight": {"dtype": "BF16", "shape": [1000, ' + "9" * 5000
        + '], "data_offsets": [0, 4096]}}',
        {"model.embed_tokens.weight": {"dtype": "BF16", "shape": [2**62, 2**62], "data_offsets": [0, 4096]}},
    ],
    "scenario_setup": [{"micro_batch": 3_000_000_000}, {"grad_ckpt": "no"}, {"lora_rank": math.nan},
                       {"method": "lora", "lora_alpha": math.inf}],
    "settings": [{"micro_batch": 3_000_000_000}, {"lora_rank": math.nan}, {"seq_len": 10**4999},
                 {"grad_ckpt": "no"}],
    "calibration_file": [
        "{ broken",
        json.dumps({"x": {"gpu_name": "NVIDIA GeForce RTX 4090", "context_bytes": -10 * 2**30, "slack_ratio": 1.0}}),
        json.dumps({"x": {"gpu_name": 5, "context_bytes": 1, "slack_ratio": 1.0}}),
    ],
}
