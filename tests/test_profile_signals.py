"""`vramlab profile` told to stop (issue 13): SIGTERM or Ctrl-C to the CLI ends the run's child process (and
under torchrun the agent and every rank), removes its temporary folder, and exits 128 + the signal with one
line. Before, SIGTERM left torchrun, both ranks and a ``vramlab-dist-*`` folder behind, and Ctrl-C left the
single-process child running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

# the real CLI, with the profile slowed down so that the signal arrives while the run is under way
DRIVER = """
import functools, signal, sys
# Ctrl-C as in a terminal: a test runner's worker may ignore SIGINT, and a child inherits an ignored signal
signal.signal(signal.SIGINT, signal.default_int_handler)
from vramlab.core.profiling import profile as p
p.profile = functools.partial(p.profile, fault="slow")
from vramlab.core.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 512,
        "hidden_act": "silu", "tie_word_embeddings": False,
    }))
    return str(path)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _gone(procs: list[psutil.Process], wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(("sig", "extra", "want_procs"), [
    (signal.SIGTERM, [], 1),
    (signal.SIGINT, [], 1),
    (signal.SIGTERM, ["--gpus", "2", "--sharding", "fsdp", "--weights", "fp32", "--launcher", "torchrun"], 3),
], ids=["sigterm", "ctrl-c", "sigterm-torchrun"])
def test_a_stop_signal_ends_every_process_and_removes_the_temporary_folder(tmp_path, sig, extra, want_procs):
    if sys.platform == "win32":
        pytest.skip("POSIX signals")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", DRIVER, "profile", "--model", _config(tmp_path), "--device", "cpu", "--seq", "64",
           "--timeout", "120", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        while len(_descendants(proc.pid)) < want_procs and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        started = _descendants(proc.pid)
        assert len(started) >= want_procs, proc.communicate(timeout=5)
        time.sleep(0.5)
        started = _descendants(proc.pid)  # the ranks too, once torchrun has started them
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1] in ("terminated", "interrupted") and "Traceback" not in err
    assert _gone(started), [p.pid for p in started]
    assert not list(tmp.iterdir())  # no vramlab-dist-* folder left


def test_cancel_ends_the_process_tree_without_killpg(monkeypatch):
    """Windows has no os.killpg (cancel raised AttributeError there): the tree is ended through psutil."""
    from vramlab.core.profiling.processes import popen_isolated
    from vramlab.core.profiling.profile import terminate

    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            " time.sleep(60)")
    proc = popen_isolated([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not _descendants(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = [psutil.Process(proc.pid), *_descendants(proc.pid)]
        assert len(tree) == 2
        monkeypatch.delattr(os, "killpg", raising=False)
        terminate(proc)
        assert proc.poll() is not None and _gone(tree)
    finally:
        if proc.poll() is None:
            proc.kill()
