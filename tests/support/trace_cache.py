"""A folder of traced tapes for one test module: the environment's cache folder and the process's trace store
point at it for as long as the module runs, and are put back afterwards."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def isolated_traces(folder: Path) -> Iterator[Path]:
    from vramlab.core import traced
    from vramlab.core.estimator.stored import TraceStore

    old_env, old_store = os.environ.get("VRAMLAB_CACHE_DIR"), traced.STORE
    os.environ["VRAMLAB_CACHE_DIR"] = str(folder)
    traced.STORE = TraceStore(folder)
    try:
        yield folder
    finally:
        traced.STORE = old_store
        if old_env is None:
            os.environ.pop("VRAMLAB_CACHE_DIR", None)
        else:
            os.environ["VRAMLAB_CACHE_DIR"] = old_env
