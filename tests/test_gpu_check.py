"""`make gpu-check` (tools/gpu_check.py) checked on the CPU: its plan and order, each step under its own timeout
within one budget, the result file written whatever happens, the tolerance that fails it, and a run on a
machine without CUDA or without an installed vramlab."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check as gc  # noqa: E402


def test_without_cuda_it_says_so_and_writes_a_result_saying_so(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU visible, even on a machine that has one
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--no-venv", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA GPU here (")
    assert "Traceback" not in proc.stderr
    doc = json.loads(out.read_text())
    assert doc["status"] == "no_gpu" and doc["steps"] == {} and doc["bitsandbytes"]


def test_the_plan_runs_in_the_issues_priority_order():
    names = [s.name for s in gc.plan(1)]
    assert names == ["nvml_probe", "context", "cublas_workspace", "attention_kernel", "attention_scratch",
                     "profile:qlora_nf4", "profile:lora_int8", "profile:lora_int8_ckpt", "profile:fp32_lora_gqa",
                     "profile:paged_adamw8bit", "profile:lora_50_steps", "pytest"]
    assert {s.name for s in gc.plan(1) if s.needs_bnb} == {"profile:qlora_nf4", "profile:lora_int8",
                                                          "profile:lora_int8_ckpt", "profile:paged_adamw8bit"}
    assert "profile:fsdp2" in [s.name for s in gc.plan(2)] and gc.plan(2)[-1].name == "pytest"
    assert gc.BUDGET_S <= 8 * 60


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_steps_never_run_past_the_budget_and_each_gets_its_own_timeout():
    clock = FakeClock()
    given: dict[str, float] = {}

    def runner(step: gc.Step, timeout_s: float) -> dict:
        given[step.name] = timeout_s
        clock.t += timeout_s  # every step hangs until its timeout
        return {"status": "timeout", "reason": "hung"}

    writes = []
    doc = gc.run_plan(gc.plan(1), runner, 300, lambda d: writes.append(json.dumps(d)), {}, "0.50.2", clock)
    assert clock.t <= 300 and all(t <= s.timeout_s for s in gc.plan(1) for n, t in given.items() if n == s.name)
    statuses = {n: e["status"] for n, e in doc["steps"].items()}
    assert statuses["nvml_probe"] == "timeout" and statuses["pytest"] == "not_run"
    assert len(writes) == len(gc.plan(1))  # the file is rewritten after every step
    assert all(f.startswith(("nvml_probe", "context", "cublas", "attention", "profile")) for f in doc["failed"])


def test_a_step_that_raises_is_its_own_failure_and_the_rest_still_run():
    def runner(step: gc.Step, timeout_s: float) -> dict:
        if step.name == "context":
            raise RuntimeError("boom")
        return {"levels": {}}

    doc = gc.run_plan(gc.plan(1), runner, 480, lambda d: None, {}, "0.50.2", FakeClock())
    assert doc["steps"]["context"]["status"] == "error" and "boom" in doc["steps"]["context"]["reason"]
    assert doc["steps"]["pytest"]["status"] == "ok"
    assert doc["failed"] == ["context: error (RuntimeError: boom)"]


def test_without_bitsandbytes_its_steps_are_skipped_and_named_not_failed():
    ran = []
    doc = gc.run_plan(gc.plan(1), lambda s, t: ran.append(s.name) or {}, 480, lambda d: None, {}, None, FakeClock())
    skipped = {n for n, e in doc["steps"].items() if e["status"] == "skipped"}
    assert skipped == {s.name for s in gc.plan(1) if s.needs_bnb} and not skipped & set(ran)
    assert all("bitsandbytes" in doc["steps"][n]["reason"] for n in skipped) and doc["failed"] == []


def test_a_level_beyond_its_tolerance_fails_the_check():
    levels = {"tensor": {"measured": 1000, "estimate": 1071, "estimate_error_pct": gc.pct(1000, 1071)},
              "reserved": {"measured": 1000, "estimate": 1100, "estimate_error_pct": gc.pct(1000, 1100)},
              "context": {"measured": 100, "estimate": 300, "estimate_error_pct": 200.0, "judged_as": "none"},
              "device": {"measured": None, "estimate": 5, "estimate_error_pct": None}}
    beyond = gc.judge(levels)
    assert beyond == ["tensor: estimate +7.1 % of measured, beyond 5 %"]  # a +70 % context is shown, not judged
    doc = {"steps": {"profile:x": {"status": "ok", "beyond_tolerance": beyond},
                     "attention_kernel": {"status": "ok", "mispredicted": ["fp32 gqa d128: torch chose math"]}}}
    assert len(gc.failures(doc)) == 2


def test_a_hung_step_is_ended_with_everything_it_started(tmp_path):
    pid_file = tmp_path / "grandchild"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " start_new_session=True);"  # as a profile's child leads a session of its own
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    res = gc.run_in_process([sys.executable, "-c", code], 3)
    assert res["status"] == "timeout" and time.monotonic() - t0 < 30
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the step's own child outlived its timeout")


def test_a_step_that_dies_without_a_result_is_recorded_as_crashed():
    res = gc.run_in_process([sys.executable, "-c", "import os; os._exit(139)"], 30)
    assert res["status"] == "crashed" and "139" in res["reason"]


def test_the_make_target_installs_nothing_and_needs_no_venv():
    for venv in (".venv", "/nonexistent-venv"):
        proc = subprocess.run(["make", "-n", "-C", str(ROOT), "gpu-check", f"VENV={venv}"], capture_output=True,
                              text=True, timeout=30, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "pip" not in proc.stdout and " venv" not in proc.stdout and "--no-venv" in proc.stdout


def test_the_source_tree_imports_as_vramlab_where_it_is_not_installed(tmp_path):
    """An interpreter without this project installed (here: ``python -S``, no site-packages), in the check and
    in the processes it starts."""
    probe = subprocess.run([sys.executable, "-S", "-c", "import vramlab"], capture_output=True, text=True, check=False)
    if probe.returncode == 0:
        pytest.skip("vramlab imports without site-packages here")
    child = "import vramlab.core.units as u; print(u.__file__)"
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); import gpu_check as g;"
            "env = g.ensure_importable(); import vramlab.core.units as u, subprocess; print(u.__file__);"
            f"print(subprocess.run([sys.executable, '-S', '-c', {child!r}], env=env, capture_output=True,"
            " text=True).stdout.strip())")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                          check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    here, there = proc.stdout.strip().splitlines()
    assert Path(here) == ROOT / "core" / "units.py" and Path(there) == ROOT / "core" / "units.py"


def test_every_profile_of_the_plan_is_a_valid_setup_of_its_model():
    from vramlab.core.catalog import find_model

    spec = find_model(gc.MODEL)
    assert spec.num_kv_heads < spec.num_heads  # the fp32 step needs grouped-query attention (the math kernel)
    setups = gc._profile_setups()
    for step in gc.plan(2):
        if step.name.startswith("profile:"):
            setup, steps = setups[step.name.removeprefix("profile:")]
            setup.validate(spec)
            assert steps >= 2


def test_a_profile_step_reports_every_level_and_judges_it(monkeypatch):
    """The profile step's own code, run on the CPU (the device and the model made small): an entry with the
    tensor level's counter, each level's error, and the judgement."""
    import dataclasses

    from vramlab.core import catalog
    from vramlab.core.profiling import profile as profile_mod

    small = dataclasses.replace(catalog.find_model(gc.MODEL), num_layers=2)
    real_profile = profile_mod.profile
    monkeypatch.setattr(catalog, "find_model", lambda name: small)
    monkeypatch.setattr(profile_mod, "profile",
                        lambda spec, setup, device, **kw: real_profile(spec, setup, "cpu", **kw))
    setups = {name: (setup.replace(seq_len=64), 2) for name, (setup, _n) in gc._profile_setups().items()}
    monkeypatch.setattr(gc, "_profile_setups", lambda: setups)
    entry = gc.step_profile("fp32_lora_gqa", gc.MODEL, 120)
    assert entry.get("status", "ok") == "ok", entry.get("reason")
    levels = entry["levels"]
    assert set(levels) == {"tensor", "reserved", "device", "context"}
    assert levels["tensor"]["counter"] in ("requested_bytes.all.peak", "max_memory_allocated")
    assert levels["tensor"]["estimate_error_pct"] is not None and isinstance(entry["beyond_tolerance"], list)
    assert any("math kernel" in n for n in entry["estimate_notes"])  # fp32 GQA on CUDA: SDPA's math kernel
    json.dumps(entry, default=str)


def test_an_interpreter_without_a_cuda_torch_hands_over_to_one_that_has_it(tmp_path):
    """`make gpu-check` in this project's venv (a CPU torch) on a GPU machine whose own python has a CUDA torch:
    the check runs again in that interpreter (here a stand-in that says it has CUDA 12.8 and records its call)."""
    called = tmp_path / "called"
    fake = tmp_path / "python3"
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then echo 12.8; exit 0; fi\necho \"$@\" > {called}\n")
    fake.chmod(0o755)
    assert gc.cuda_python([str(fake)]) == str(fake)
    assert gc.cuda_python([sys.executable]) is None  # this interpreter itself is never a candidate
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env.pop(gc.REEXEC_ENV, None)
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--no-venv", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "running in" in proc.stdout and "--no-venv" in called.read_text()
