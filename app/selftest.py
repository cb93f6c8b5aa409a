"""``vramlab --self-test``: a smoke test of the installed or frozen app, run by the packaging build on what
it built and by anyone who wants to know whether an install works.

Checks, in this order (the GUI before anything that loads torch, so "torch not loaded at first paint"
means something):

1. ``build``     version, frozen or not, the build variant (``vramlab-build.json`` in a packaged app)
2. ``resources`` model and GPU presets, icons and the style sheet are readable
3. ``estimate``  a preset model (QLoRA on Llama-3.1-8B) on a preset GPU; components sum to the peak
4. ``gui``       the real start-up path (``app.main.run --gui-smoke-test``) until the main window's first
                 paint; offscreen when there is no display
5. ``simulate``  a two-layer model on fake tensors (CPU), compared with the estimate of the simulation
6. ``profile``   the same model for real on the CPU in the profile child process (``--profile-child`` of
                 the same executable when frozen)

Without torch (the estimator-only build) 5 and 6 check instead that simulate and profile say clearly that
the build lacks torch. Prints one line per check and exits 0, or 1 when a check failed, or 3 on a timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramlab.app.build import NO_TORCH, has_torch

BUILD_INFO = "vramlab-build.json"
EXIT_FAILED = 1
EXIT_TIMEOUT = 3


class Skip(Exception):
    """A check that does not apply here (the message says why)."""


@dataclass
class Check:
    name: str
    status: str  # ok | skip | FAIL
    detail: str
    seconds: float
    data: dict[str, Any] = field(default_factory=dict)


def build_info() -> dict[str, Any]:
    """What the packaging build recorded (variant, versions), or facts of this environment when not frozen."""
    from vramlab.core import __version__

    info: dict[str, Any] = {"version": __version__, "frozen": bool(getattr(sys, "frozen", False)),
                            "python": platform.python_version(), "platform": platform.platform()}
    bundle = getattr(sys, "_MEIPASS", None)
    path = Path(bundle) / BUILD_INFO if bundle else None
    if path is not None and path.is_file():
        info.update(json.loads(path.read_text(encoding="utf-8")))
    info.setdefault("variant", "full" if has_torch() else "estimator")
    return info


# ---- the checks -------------------------------------------------------------------------------------------

def check_build() -> tuple[str, dict[str, Any]]:
    info = build_info()
    torch_note = "torch " + info["torch"] if info.get("torch") else ("torch available" if has_torch() else "no torch")
    where = "frozen" if info["frozen"] else "Python " + info["python"]
    return f"VRAM Lab {info['version']}, {where}, {info['variant']} build, {torch_note}", info


def check_resources() -> tuple[str, dict[str, Any]]:
    from importlib import resources

    from vramlab.core.catalog import gpus, models

    root = resources.files("vramlab.resources")
    icons = [p.name for p in root.joinpath("icons").iterdir() if p.name.endswith(".svg")]
    if "vramlab.svg" not in icons:
        raise RuntimeError(f"the app icon is missing from {root.joinpath('icons')}")
    style = root.joinpath("styles/app.qss").read_text(encoding="utf-8")
    n_models, n_gpus = len(models()), len(gpus())
    if not (n_models and n_gpus and style):
        raise RuntimeError("empty presets or style sheet")
    return f"{n_models} model and {n_gpus} GPU presets, {len(icons)} icons, style sheet", {
        "models": n_models, "gpus": n_gpus, "icons": len(icons)}


def check_estimate() -> tuple[str, dict[str, Any]]:
    from vramlab.core.catalog import find_gpu, resolve_model
    from vramlab.core.estimate import estimate
    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.units import fmt_bytes

    entry, gpu = resolve_model("llama-3.1-8b"), find_gpu("rtx-4090")
    t0 = time.perf_counter()
    r = estimate(entry.spec, TrainingSetup(method="qlora"), gpu)
    ms = (time.perf_counter() - t0) * 1000
    if sum(r.components.values()) != r.peak_allocated_bytes:
        raise RuntimeError("the components do not sum to the peak")
    if not 0 < r.peak_allocated_bytes <= r.peak_reserved_bytes <= r.device_used_bytes:
        raise RuntimeError("the memory levels are out of order")
    fits = "fits" if r.fits() else "does not fit"
    return (f"{entry.spec.name} QLoRA on {gpu.name}: {fmt_bytes(r.device_used_bytes)} device used ({fits}), "
            f"{ms:.0f} ms"), {"device_used_bytes": r.device_used_bytes, "ms": round(ms, 2)}


def check_sources() -> tuple[str, dict[str, Any]]:
    """Training configs out and back in (PyYAML), and the Hub reader's library (huggingface_hub) loads and
    answers from an empty cache offline: both are in every build, the estimator-only one too. No network."""
    import dataclasses

    from vramlab.core.sources.export import export_setup, write_exported
    from vramlab.core.sources.hub import HubSettings, NotCached, load_hub_model
    from vramlab.core.sources.training import read_training_configs
    from vramlab.core.spec.training import TrainingSetup

    setup = TrainingSetup(method="qlora", lora_rank=16, grad_ckpt=True, micro_batch=2, seq_len=2048)
    with tempfile.TemporaryDirectory(prefix="vramlab-selftest-") as tmp:
        written = write_exported(export_setup(setup, "axolotl", model="org/model"), tmp)
        back = TrainingSetup().replace(**read_training_configs(written).changes)
        if back.resolved() != setup.resolved():
            raise RuntimeError("an exported axolotl config did not read back as the same setup")
        settings = dataclasses.replace(HubSettings.from_env(), cache_dir=Path(tmp) / "hub", offline=True,
                                       header_cache=Path(tmp) / "headers")
        try:
            load_hub_model("org/model", settings=settings)
            raise RuntimeError("an empty cache answered a Hub lookup")
        except NotCached:
            pass
    import huggingface_hub
    import yaml

    return (f"axolotl export read back; huggingface_hub {huggingface_hub.__version__}, PyYAML {yaml.__version__}",
            {"huggingface_hub": huggingface_hub.__version__})


def check_gui() -> tuple[str, dict[str, Any]]:
    if "torch" in sys.modules:
        raise RuntimeError("torch was loaded before the GUI started")
    from vramlab.app.main import run

    with tempfile.TemporaryDirectory(prefix="vramlab-selftest-") as tmp:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = run(["--gui-smoke-test", "--settings", str(Path(tmp) / "settings.ini")])
    if code != 0:
        raise RuntimeError(f"the GUI exited with {code}")
    line = next((x for x in out.getvalue().splitlines() if x.startswith("{")), None)
    if line is None:
        raise RuntimeError("the main window was never painted")
    shown = json.loads(line)
    if shown.get("torch_loaded"):
        raise RuntimeError("torch was imported before the main window was shown")
    from vramlab.app.qt import QtGui

    platform_name = QtGui.QGuiApplication.platformName()
    return (f"main window painted {shown['since_app_import_s']:.2f} s after the GUI import "
            f"(Qt platform {platform_name}), torch not loaded"), {**shown, "qt_platform": platform_name}


def _tiny():  # noqa: ANN202
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

    spec = ModelSpec(id="selftest-tiny", name="Tiny (self-test)", num_layers=2, hidden_size=64, num_heads=4,
                     num_kv_heads=2, intermediate_size=128, vocab_size=256)
    return spec, TrainingSetup(micro_batch=1, seq_len=16)


def check_simulate() -> tuple[str, dict[str, Any]]:
    from vramlab.core.estimate import estimate
    from vramlab.core.units import Unit, fmt_bytes

    if not has_torch():
        try:
            import vramlab.core.simulation.simulate  # noqa: F401
        except ModuleNotFoundError as e:
            return f"no torch in this build; simulate says: {_no_torch_text(e)}", {"torch": False}
        raise RuntimeError("simulate imported without torch")
    from vramlab.core.simulation.simulate import simulate

    spec, setup = _tiny()
    t0 = time.perf_counter()
    r = simulate(spec, setup)
    seconds = time.perf_counter() - t0
    predicted = estimate(spec, setup, match_simulation=True).peak_allocated_bytes
    diff = (predicted - r.peak_allocated_bytes) / r.peak_allocated_bytes
    return (f"two-layer model on fake tensors: {fmt_bytes(r.peak_allocated_bytes, Unit.MIB)} peak in "
            f"{seconds:.1f} s (estimate {diff:+.1%})"), {"peak_bytes": r.peak_allocated_bytes, "s": round(seconds, 2)}


def check_profile(timeout_s: float) -> tuple[str, dict[str, Any]]:
    from vramlab.core.profiling.profile import child_command, profile
    from vramlab.core.units import Unit, fmt_bytes

    spec, setup = _tiny()
    t0 = time.perf_counter()
    outcome = profile(spec, setup, device="cpu", steps=1, timeout_s=timeout_s)
    seconds = time.perf_counter() - t0
    how = " ".join(Path(child_command()[0]).name if i == 0 else a for i, a in enumerate(child_command()))
    if not has_torch():
        if outcome.ok or "torch" not in outcome.message:
            raise RuntimeError(f"expected a clear 'no torch' failure from the child, got {outcome.kind}: "
                               f"{outcome.message}")
        return f"child `{how}` answered in {seconds:.1f} s: {outcome.message}", {"s": round(seconds, 2)}
    if not outcome.ok or outcome.result is None:
        raise RuntimeError(f"the profile child failed ({outcome.kind}): {outcome.message}")
    peak = outcome.result.peak_allocated_bytes
    return (f"child `{how}`: one real CPU step, {fmt_bytes(peak, Unit.MIB)} peak, {seconds:.1f} s"), {
        "peak_bytes": peak, "s": round(seconds, 2)}


def _no_torch_text(e: BaseException) -> str:
    text = str(e)
    if "vramlab" not in text.lower():  # not the packaged app's explanation: use the CLI's
        text = f"{text} ({NO_TORCH})"
    return text


# ---- running them -----------------------------------------------------------------------------------------

def _run(name: str, fn: Callable[[], tuple[str, dict[str, Any]]]) -> Check:
    t0 = time.perf_counter()
    try:
        detail, data = fn()
        status = "ok"
    except Skip as e:
        detail, data, status = str(e), {}, "skip"
    except Exception as e:  # noqa: BLE001 - every failure is reported, with its trace
        detail = f"{type(e).__name__}: {e}"
        data, status = {"trace": traceback.format_exc(limit=6)}, "FAIL"
    return Check(name, status, detail, time.perf_counter() - t0, data)


def _watchdog(seconds: float) -> threading.Timer:
    def expire() -> None:
        sys.stderr.write(f"vramlab self-test: FAILED, no answer after {seconds:.0f} s\n")
        sys.stderr.flush()
        os._exit(EXIT_TIMEOUT)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def _headless() -> bool:
    return sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vramlab --self-test", description="Check that this VRAM Lab install works.")
    p.add_argument("--no-gui", action="store_true", help="skip the GUI check")
    p.add_argument("--no-profile", action="store_true", help="skip the profile child (a second process)")
    p.add_argument("--offscreen", action="store_true", help="render the GUI offscreen even with a display")
    p.add_argument("--json", action="store_true", help="print the checks as one JSON object instead")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds [300]")
    args = p.parse_args(argv or [])
    t_start = time.perf_counter()
    timer = _watchdog(args.timeout)
    if args.offscreen or (_headless() and not os.environ.get("QT_QPA_PLATFORM")):
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    # never read the user's calibration or write their settings; the folder goes when the test ends
    scratch = None
    if not os.environ.get("VRAMLAB_CONFIG_DIR"):
        scratch = tempfile.mkdtemp(prefix="vramlab-selftest-config-")
        os.environ["VRAMLAB_CONFIG_DIR"] = scratch
    try:
        return _run_checks(args, timer, t_start)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
            os.environ.pop("VRAMLAB_CONFIG_DIR", None)


def _run_checks(args: argparse.Namespace, timer: threading.Timer, t_start: float) -> int:

    plan: list[tuple[str, Callable[[], tuple[str, dict[str, Any]]]]] = [
        ("build", check_build), ("resources", check_resources), ("estimate", check_estimate),
        ("sources", check_sources)]
    if not args.no_gui:
        plan.append(("gui", check_gui))
    plan.append(("simulate", check_simulate))
    if not args.no_profile:
        plan.append(("profile", lambda: check_profile(timeout_s=max(30.0, args.timeout / 2))))

    checks: list[Check] = []
    for name, fn in plan:
        check = _run(name, fn)
        checks.append(check)
        if not args.json:
            print(f"  {check.status:<4}  {name:<10} {check.detail}", flush=True)
            if check.status == "FAIL":
                print("        " + check.data["trace"].rstrip().replace("\n", "\n        "), flush=True)
    timer.cancel()
    failed = [c.name for c in checks if c.status == "FAIL"]
    total = time.perf_counter() - t_start
    if args.json:
        print(json.dumps({"ok": not failed, "failed": failed, "seconds": round(total, 2),
                          "checks": [{"name": c.name, "status": c.status, "detail": c.detail,
                                      "seconds": round(c.seconds, 3), **c.data} for c in checks]}, default=str))
    elif failed:
        print(f"vramlab self-test: FAILED ({', '.join(failed)}) in {total:.1f} s", flush=True)
    else:
        print(f"vramlab self-test: passed in {total:.1f} s", flush=True)
    return EXIT_FAILED if failed else 0
