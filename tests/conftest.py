"""Shared test fixtures. GUI tests run offscreen; a test that leaves a QThread or child process running
fails (see tests/gui/conftest.py)."""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# never read or write the developer's own settings and calibration
os.environ["VRAMLAB_CONFIG_DIR"] = tempfile.mkdtemp(prefix="vramlab-test-config-")
# nor its cache (traced tapes, FakeTensorMode's answers for the fast simulation)
os.environ["VRAMLAB_CACHE_DIR"] = tempfile.mkdtemp(prefix="vramlab-test-cache-")
os.environ.setdefault("PYQTGRAPH_QT_LIB", "PySide6")


class _NoQt:
    """With ``VRAMLAB_BLOCK_QT=1`` (``make test`` runs the core tests so), importing Qt or pyqtgraph fails as it
    would where they are not installed: the core tests must pass in an environment without Qt."""

    BLOCKED = ("PySide6", "shiboken6", "pyqtgraph")

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in self.BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (Qt is blocked for the core tests)",
                                      name=name)


if os.environ.get("VRAMLAB_BLOCK_QT") == "1":
    sys.meta_path.insert(0, _NoQt())


# Property tests (tests/test_properties.py): a few derandomized examples per kind in the default run, so a red CI
# run reproduces; benchmarks/fuzz.py runs thousands. HYPOTHESIS_PROFILE=thorough runs more here. No example
# database: a test run writes nothing into the checkout.
try:
    from hypothesis import HealthCheck, settings

    _common = {"deadline": None, "database": None, "suppress_health_check": [HealthCheck.too_slow]}
    settings.register_profile("ci", max_examples=15, derandomize=True, **_common)
    settings.register_profile("thorough", max_examples=300, **_common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # the dev extra is not installed: the property tests skip themselves
    pass
