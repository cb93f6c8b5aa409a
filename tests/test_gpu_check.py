"""`make gpu-check` on a machine without CUDA: one clear line, exit 0, nothing run, no result file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_without_cuda_it_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU visible, even on a machine that has one
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA GPU here (")
    assert "Traceback" not in proc.stderr
    assert not out.exists()
