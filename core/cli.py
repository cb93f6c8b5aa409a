"""The headless command line: ``vramlab estimate|simulate|profile|fit|advise|compare|export|gpus`` (no Qt is
imported).

Bad flags, impossible setups and broken files exit with code 2 and one clear line on stderr; a run that
does not fit the GPU is a result, not an error (exit 0; ``--fail-if-oom`` makes it 3 for scripts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vramlab.core import __version__
from vramlab.core.allocator import AllocatorConfig
from vramlab.core.checks import SetupError
from vramlab.core.cli_flags import (
    Parser,
    UsageError,
    add_setup_flags,
    add_source_flag,
    enum_values,
    flag_values,
    flagged_fields,
    ignored_flags,
    names_list,
    seconds,
    setup_from_args,
    steps_count,
)
from vramlab.core.report import fit_text, profile_text, render_table
from vramlab.core.result import MemoryResult
from vramlab.core.spec.options import Objective
from vramlab.core.spec.presets import PRECISION_PRESETS
from vramlab.core.spec.unsloth_loss import fused_loss_runs, unsloth_gpu_free
from vramlab.core.units import fmt_bytes, fmt_count

if TYPE_CHECKING:
    from vramlab.core.catalog import ModelEntry
    from vramlab.core.sources.mapping import SetupSource
    from vramlab.core.spec.gpu import GpuSpec
    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.traced import Progress

EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3



@dataclass(frozen=True)
class Resolved:
    """What the command line names: the model, the setup and the GPU, and where they came from (shown with the
    answer): the training configs' mapping (``--config``) and a Hub model's origin."""

    entry: ModelEntry
    setup: TrainingSetup
    gpu: GpuSpec | None
    source: SetupSource | None = None
    origin: str = ""


def _with_tape_source(args: argparse.Namespace, entry: ModelEntry) -> tuple[ModelEntry, Progress | None]:
    """``--source`` applied to the model, and where a first trace reports its progress (stderr), passed to the
    estimates the command runs (None: the estimate traces nothing)."""
    from vramlab.core import traced
    from vramlab.core.tracing.requirements import check_available, installed

    choice = getattr(args, "source", None)
    if choice:
        entry = dataclasses.replace(entry, spec=dataclasses.replace(entry.spec, tape=choice))
    forced = traced.uses_trace(entry.spec)
    if forced:
        check_available()
    if not (forced or (entry.spec.is_moe and installed())):  # auto may trace an MoE recipe (adapts_experts)
        return entry, None
    name = entry.spec.name

    def progress(text: str, fraction: float) -> None:
        print(f"trace of {name}: {text} ({fraction:.0%})", file=sys.stderr, flush=True)

    return entry, progress


def resolve(args: argparse.Namespace) -> Resolved:
    """Model, setup and GPU of the command line, with the mapping read from ``--config`` files and a Hub
    model's origin."""
    from vramlab.core.catalog import find_gpu, resolve_model

    paths = list(getattr(args, "config", None) or [])
    source = None
    if paths:
        from vramlab.core.sources.training import read_training_configs

        source = read_training_configs(paths)
    model = args.model or (source.model if source is not None else None)
    if not model:
        raise UsageError("--model is required (or a --config that names the model: base_model, "
                         "model_name_or_path)")
    entry = resolve_model(model)
    if entry.adapter is not None:  # a Hub adapter repo: its adapter_config.json is the first training config
        from vramlab.core.sources.training import read_training_configs

        source = read_training_configs(paths, adapter=entry.adapter, adapter_source=f"{model}/adapter_config.json")
    if source is not None:
        from vramlab.core.sources.training import with_flags

        source = with_flags(source, flagged_fields(args), flag_values(args))
        source.check()
    setup = setup_from_args(args, source)
    setup.validate(entry.spec)
    gpu = find_gpu(args.gpu) if getattr(args, "gpu", None) is not None else None
    if gpu is not None and gpu.id.startswith(("card-", "custom-")):  # which reading of a size was taken
        print(f"note: --gpu {gpu.notes}", file=sys.stderr)
    if getattr(args, "unsloth_free_memory", None) is not None and fused_loss_runs(setup):
        setup = setup.replace(unsloth_gpu=unsloth_gpu_free(gpu, args.unsloth_free_memory))
    unused = ignored_flags(args, setup)
    if unused:
        entry = dataclasses.replace(entry, warnings=(*entry.warnings, *unused))
    return Resolved(entry, setup, gpu, source, entry.origin)


# ---- commands -----------------------------------------------------------------------------------------------

def cmd_estimate(args: argparse.Namespace) -> int:
    from vramlab.core.catalog import gpus, models

    if args.list_models:
        if args.json:
            print(json.dumps([{**m.to_dict(), "param_count": m.param_count} for m in models()], indent=2))
            return 0
        for m in models():
            print(f"{m.id:<32}{m.name:<34}{fmt_count(m.param_count):>8}  {m.summary()}")
        return 0
    if args.list_gpus:
        if args.json:
            print(json.dumps([dataclasses.asdict(g) for g in gpus()], indent=2))
            return 0
        for g in gpus():
            print(f"{g.id:<26}{g.name:<40}{fmt_bytes(g.memory_bytes):>12}  {g.bf16_tflops:>7.1f} TFLOP/s")
        return 0
    if not args.model and not args.config:
        raise UsageError("vramlab estimate: --model is required (or --config, --list-models, --list-gpus)")
    from vramlab.core.estimate import estimate

    run = resolve(args)
    entry, setup, gpu = run.entry, run.setup, run.gpu
    conf = _alloc_conf(args.alloc_conf)
    entry, progress = _with_tape_source(args, entry)
    result = estimate(entry.spec, setup, gpu, allocator=not args.fast, alloc_conf=conf, progress=progress)
    result = _with_import_warnings(result, entry.warnings)
    return _emit(args, run, result)


def _alloc_conf(flag: str | None) -> AllocatorConfig | None:
    """--alloc-conf as given (a bad value is exit 2), else PYTORCH_CUDA_ALLOC_CONF from the environment: a
    value we cannot read there is a warning and the default allocator is modelled (it is not our input)."""
    if flag is not None:
        return AllocatorConfig.parse(flag) if flag else None
    env = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if not env:
        return None
    try:
        return AllocatorConfig.parse(env)
    except SetupError as e:
        print(f"warning: PYTORCH_CUDA_ALLOC_CONF ignored: {e}", file=sys.stderr)
        return None


def _with_import_warnings(result: MemoryResult, warnings: Sequence[str]) -> MemoryResult:
    if not warnings:
        return result
    import dataclasses

    return dataclasses.replace(result, warnings=(*warnings, *result.warnings))


def _with_sources(run: Resolved, out: dict[str, Any]) -> dict[str, Any]:
    """``--json``: where the model and the setup came from (a Hub model, training configs), when they did."""
    if run.source is not None:
        out["setup_source"] = run.source.to_json()
    if run.origin:
        out["model_origin"] = run.origin
    return out


def _print_sources(run: Resolved) -> None:
    """The text answer is preceded by the model's origin and the training-config mapping, when there are."""
    source, origin = run.source, run.origin
    if origin:
        print(f"Model: {origin}")
    if source is not None:
        print(source.table())
    if origin or source is not None:
        print()


def _emit(args: argparse.Namespace, run: Resolved, result: MemoryResult) -> int:
    if args.json:
        print(json.dumps(_with_sources(run, result.to_json()), indent=2))
    else:
        _print_sources(run)
        print(render_table(result, args.unit))
    if getattr(args, "fail_if_oom", False) and result.gpu is not None and not result.fits():
        return EXIT_DOES_NOT_FIT
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from vramlab.core.simulation.simulate import simulate

    run = resolve(args)
    entry, setup, gpu = run.entry, run.setup, run.gpu
    hf_config = None
    if args.hf and entry.source != "preset":
        hf_config = _hf_config_of(entry.source)
    result = simulate(entry.spec, setup, gpu, steps=args.steps, hf=args.hf, hf_config=hf_config)
    return _emit(args, run, _with_import_warnings(result, entry.warnings))


def _hf_config_of(source: str):  # noqa: ANN202
    """The user's config.json as a transformers config (parsed as data; no remote code)."""
    from pathlib import Path

    path = Path(source)  # the file named (transformers reads a file path as that file), else the folder's
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except ImportError as e:
        raise SetupError("--hf needs transformers and peft: pip install 'vramlab[hf]'") from e
    except (OSError, ValueError, KeyError) as e:
        raise SetupError(f"{path}: transformers cannot read this config ({e})") from e


def cmd_profile(args: argparse.Namespace) -> int:
    from vramlab.core.profiling.outcomes import OutcomeKind
    from vramlab.core.profiling.profile import profile

    run = resolve(args)
    entry, setup, gpu = run.entry, run.setup, run.gpu
    device = args.device
    if device == "auto":
        from vramlab.core.monitor import cuda_available_without_context

        try:
            device = "cuda" if cuda_available_without_context() else "cpu"
        except Exception:  # NVML trouble of any kind: there is no usable GPU to profile on
            device = "cpu"
        if device == "cpu":
            print("note: no NVIDIA GPU found; profiling on the CPU (the tensor level and the process's "
                  "memory; no reserved or device level)", file=sys.stderr)
    launcher = args.launcher
    if setup.gpus > 1 and launcher != "emulate":
        from vramlab.core.profiling.distributed import check_supported, launch_refusal

        if launcher == "torchrun":
            check_supported(entry.spec, setup, device)  # a refusal is exit 2 with its reason
        else:
            reason = launch_refusal(entry.spec, setup, device)
            if reason is not None:
                print(f"note: not run under torchrun ({reason}); measuring rank 0 emulated in one process",
                      file=sys.stderr)
    from vramlab.core.profiling.processes import stop_signals_raise

    with stop_signals_raise():  # SIGTERM / SIGHUP end the run's processes and temporary folders, as Ctrl-C does
        outcome = profile(entry.spec, setup, device=device, gpu=gpu, steps=args.steps,
                          snapshot=args.snapshot, isolate=not args.in_process, timeout_s=args.timeout,
                          launcher=launcher)
    if args.calibrate:
        from vramlab.core.calibration import save
        from vramlab.core.profile_calibration import from_outcome

        cal = from_outcome(entry.spec, setup, gpu, outcome)
        if cal is not None:
            print(f"saved {cal.label} to {save(cal)}", file=sys.stderr)
    if outcome.kind is OutcomeKind.NO_GPU:  # nothing was measured: bad input for this machine, not a result
        raise UsageError(f"{outcome.message}: use --device cpu (or --device auto) on a machine without a CUDA GPU")
    if args.json:
        print(json.dumps(_with_sources(run, outcome.to_json()), indent=2))
    else:
        _print_sources(run)
        print(profile_text(outcome, args.unit))
    return 0 if outcome.ok or outcome.kind is OutcomeKind.OOM else 1


def cmd_gpus(args: argparse.Namespace) -> int:
    from vramlab.core.monitor import describe_gpus

    listing = describe_gpus()
    if args.json:
        print(json.dumps(listing.as_dict(), indent=2))
    else:
        print(listing.text)
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    from vramlab.core.advisor import fit_search

    run = resolve(args)
    entry, setup, gpu = run.entry, run.setup, run.gpu
    if gpu is None:
        raise UsageError("vramlab fit: --gpu is required")
    entry, progress = _with_tape_source(args, entry)
    answer = fit_search(entry.spec, setup, gpu, margin=args.margin, target_batch=args.target_batch,
                        allocator=not args.fast, progress=progress)
    if args.json:
        print(json.dumps(_with_sources(run, answer.to_json()), indent=2))
    else:
        _print_sources(run)
        print(fit_text(answer, args.unit))
    return 0




def cmd_compare(args: argparse.Namespace) -> int:
    from vramlab.core.compare import compare_setups
    from vramlab.core.report import comparison_text

    run = resolve(args)
    entry, setup, gpu = run.entry, run.setup, run.gpu
    entry, progress = _with_tape_source(args, entry)
    rows = compare_setups(entry.spec, setup, gpu, presets=args.presets, objectives=args.objectives,
                          allocator=not args.fast, progress=progress)
    if args.json:
        from vramlab.core.report import comparison_title

        out = {"title": comparison_title(entry.spec, rows), "model": entry.spec.id,
               "gpu": dataclasses.asdict(gpu) if gpu is not None else None, "rows": [r.to_json() for r in rows],
               "warnings": list(entry.warnings)}
        print(json.dumps(_with_sources(run, out), indent=2))
        return 0
    _print_sources(run)
    for w in entry.warnings:
        print(f"Warning: {w}")
    print(comparison_text(entry.spec, rows, gpu, args.unit, markdown=args.markdown))
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from vramlab.core.advisor import allocator_advice, checklist, fit_search, savings
    from vramlab.core.estimate import estimate
    from vramlab.core.report import advice_text, objective_label

    run = resolve(args)
    entry, setup, gpu = run.entry, run.setup, run.gpu
    entry, progress = _with_tape_source(args, entry)
    exact = not args.fast
    result = _with_import_warnings(estimate(entry.spec, setup, gpu, allocator=exact, progress=progress),
                                   entry.warnings)
    saves = savings(entry.spec, setup, gpu, allocator=exact, progress=progress)
    fit = (fit_search(entry.spec, setup, gpu, margin=args.margin, target_batch=args.target_batch, allocator=exact,
                      progress=progress)
           if gpu is not None else None)
    tips = allocator_advice(result)
    checks = checklist(entry.spec, setup, result)
    if args.json:
        out = {"objective": objective_label(setup), "result": result.to_json(),
               "savings": [s.to_json() for s in saves], "fit": fit.to_json() if fit is not None else None,
               "allocator_advice": tips, "checklist": [{"item": i, "why": w} for i, w in checks]}
        print(json.dumps(_with_sources(run, out), indent=2))
        return 0
    _print_sources(run)
    print(advice_text(result, saves, fit, tips, checks, args.unit))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from vramlab.core.sources.export import export_setup, model_name_for, write_exported

    run = resolve(args)
    entry, setup = run.entry, run.setup
    given = args.model or (run.source.model if run.source is not None else "")
    name = model_name_for(given, preset_source=entry.spec.source if entry.source == "preset" else None)
    exported = export_setup(setup, args.format, model=name)
    if args.out:
        for path in write_exported(exported, args.out):
            print(f"wrote {path}")
        return 0
    if len(exported.files) > 1:
        raise UsageError(f"this setup needs {len(exported.files)} files ({', '.join(exported.files)}): "
                         "give --out DIR")
    print(exported.files[exported.main], end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="vramlab", description="GPU memory of LLM fine-tuning: estimate, simulate, measure.")
    p.add_argument("--version", action="version", version=f"vramlab {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=Parser)

    e = sub.add_parser("estimate", help="analytical estimate (< 1 ms)")
    add_setup_flags(e)
    e._option_string_actions["--model"].required = False  # --list-models needs no model
    e.add_argument("--list-models", action="store_true")
    e.add_argument("--list-gpus", action="store_true")
    e.add_argument("--json", action="store_true")
    e.add_argument("--fail-if-oom", action="store_true", help="exit 3 when it does not fit --gpu")
    e.add_argument("--fast", action="store_true",
                   help="model the allocator's slack instead of replaying the step through it (< 1 ms)")
    e.add_argument("--alloc-conf", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF to model, e.g. expandable_segments:True [the environment's]")
    add_source_flag(e)
    e.set_defaults(func=cmd_estimate)

    s = sub.add_parser("simulate", help="run the real architecture on fake tensors (seconds, no GPU)")
    add_setup_flags(s)
    s.add_argument("--steps", type=steps_count, default=2, help="optimizer steps to run [2]")
    s.add_argument("--hf", action="store_true",
                   help="measure transformers' own model class (and peft) instead of the built-in decoder")
    s.add_argument("--json", action="store_true")
    s.add_argument("--fail-if-oom", action="store_true")
    s.set_defaults(func=cmd_simulate)

    r = sub.add_parser("profile", help="run real training steps on this machine's GPU (or CPU)")
    add_setup_flags(r)
    r.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: the CUDA GPU when NVML finds one, else the CPU [auto]")
    r.add_argument("--steps", type=steps_count, default=2, help="optimizer steps to run [2]")
    r.add_argument("--snapshot", help="write a torch.cuda.memory snapshot (pickle for memory_viz) here")
    r.add_argument("--in-process", action="store_true", help="do not isolate the run in a child process")
    r.add_argument("--timeout", type=seconds, default=1800.0, help="seconds before a hung run is ended")
    r.add_argument("--launcher", choices=["auto", "torchrun", "emulate"], default="auto",
                   help="with --gpus N > 1: one process per GPU under torchrun (FSDP2), or rank 0 emulated in "
                        "one process; auto: torchrun when the setup can run so [auto]")
    r.add_argument("--calibrate", action="store_true",
                   help="save the measured CUDA context and allocator slack for later estimates on this GPU")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_profile)

    f = sub.add_parser("fit", help="largest micro batch and sequence that fit a GPU")
    add_setup_flags(f, gpu_required=True)
    f.add_argument("--margin", type=float, default=0.1, help="fraction of GPU memory kept free [0.1]")
    f.add_argument("--target-batch", type=int,
                   help="effective batch (samples per optimizer step, all GPUs) to reach with accumulation")
    f.add_argument("--fast", action="store_true",
                   help="judge with the allocator's slack model instead of replaying each step through it")
    add_source_flag(f)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_fit)

    a = sub.add_parser("advise", help="what to change to fit: each change's saving, the fit search with --gpu, "
                                      "allocator settings and checks before a long run")
    add_setup_flags(a)
    a.add_argument("--margin", type=float, default=0.1, help="fit search: fraction of GPU memory kept free [0.1]")
    a.add_argument("--target-batch", type=int, help="fit search: effective batch to reach with accumulation")
    a.add_argument("--fast", action="store_true", help="judge with the allocator's slack model (< 1 ms each)")
    add_source_flag(a)
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_advise)

    c = sub.add_parser("compare", help="the setup side by side under several precision presets and objectives "
                                       "[Full / LoRA / QLoRA]")
    add_setup_flags(c)
    c.add_argument("--presets", type=names_list, metavar="ID,...",
                   help=f"precision presets, one column each: {', '.join(x.id for x in PRECISION_PRESETS)} "
                        "[full-amp-bf16,lora-bf16,qlora-nf4, unless --objectives is given: then the setup's own]")
    c.add_argument("--objectives", type=names_list, nargs="?", const=["sft", "dpo", "grpo"], metavar="OBJ,...",
                   help="objectives, one column each (with each preset), TRL's defaults for each "
                        f"({', '.join(enum_values(Objective))}) [the setup's own; with no list: sft,dpo,grpo]")
    c.add_argument("--fast", action="store_true", help="model the allocator's slack instead of replaying each step")
    add_source_flag(c)
    out = c.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--markdown", action="store_true", help="a Markdown table (for a report or an issue)")
    c.set_defaults(func=cmd_compare)

    x = sub.add_parser("export", help="write the setup as a training config: axolotl, llamafactory, trl, "
                                      "deepspeed (importing it with --config gives the same setup)")
    x.add_argument("format", choices=["axolotl", "llamafactory", "trl", "deepspeed"])
    add_setup_flags(x)
    x.add_argument("--out", "-o", metavar="DIR", help="write the file(s) into DIR [print the one file]")
    x.set_defaults(func=cmd_export)

    g = sub.add_parser("gpus", help="detected NVIDIA GPUs (NVML)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_gpus)
    return p


def one_line(text: object) -> str:
    """A message as one line: a path with a newline in it is shown with ``\\n``, not split."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


def _describe_os_error(e: OSError) -> str:
    """'<file>: <reason>' without Python's '[Errno N]' (a file name of any length kept on one line)."""
    reason = e.strerror or str(e)
    name = e.filename if e.filename is not None else ""
    name = str(name) if len(str(name)) <= 120 else str(name)[:60] + "..." + str(name)[-40:]
    return f"{name}: {reason}" if name else reason


def _stdout_gone() -> None:
    """stdout cannot be written (a full device, a closed pipe): point it at the null device, so that Python's
    flush at exit does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


# Libraries' notices of their own API changes (transformers' FutureWarning for a renamed method) speak to whoever
# calls that API, here VRAM Lab, not to the user reading an answer: kept out of the command line's output.
_LIBRARIES = r"(transformers|peft|trl|torch|huggingface_hub|accelerate)(\.|$)"


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=_LIBRARIES)
    if sys.stdout is None:  # `vramlab ... >&-`: Python starts without sys.stdout, and print() drops text silently
        print("error: standard output is closed: the answer cannot be written (redirect it to a file or to "
              "/dev/null instead of closing it)", file=sys.stderr)
        return EXIT_BAD_INPUT
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        if not getattr(args, "command", None):
            parser.print_help()
            return 0
        code = args.func(args)
        sys.stdout.flush()  # a full device or a closed pipe shows here, where it can be reported
        return code
    except (UsageError, SetupError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP during a profile (measure.processes.Terminated)
        signum = getattr(e, "signum", 2)
        print("terminated" if signum != 2 else "interrupted", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `vramlab ... | head`: the reader has what it wanted
        _stdout_gone()
        return 0
    except OSError as e:  # a path the system refuses (a name too long), or output to a full device
        if e.filename is None:  # writing the answer failed: no second error from the flush at exit
            _stdout_gone()
        what = _describe_os_error(e) if e.filename is not None else f"writing the output failed: {e.strerror or e}"
        print(f"error: {one_line(what)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
