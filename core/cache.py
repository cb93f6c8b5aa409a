"""Where VRAM Lab keeps what it caches (traced tapes, the configs it has counted, the fake reference's peaks), and
the file name of a cache key: a module of the standard library only, below every reader and estimator that caches.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """Where traced tapes are kept: ``VRAMLAB_CACHE_DIR``, else the platform's user cache folder."""
    env = os.environ
    override = env.get("VRAMLAB_CACHE_DIR")
    if override:  # (the others not read: 3-5 us each, on every look-up)
        return _cache_dir(override, sys.platform, None, None)
    return _cache_dir(override, sys.platform, env.get("LOCALAPPDATA"), env.get("XDG_CACHE_HOME"), env.get("HOME"),
                      env.get("USERPROFILE"))


@functools.lru_cache(maxsize=8)
def _cache_dir(override: str | None, platform: str, local: str | None, xdg: str | None, *_home: str | None) -> Path:
    """:func:`cache_dir` for these settings (``_home``: what ``Path.home()`` reads), made once per process: the
    importer asks first, so a restart's first estimate finds the folder made."""
    if override:
        return Path(override)
    if platform == "win32":
        return Path(local or Path.home()) / "VRAM Lab" / "cache" / "traces"
    if platform == "darwin":
        return Path.home() / "Library" / "Caches" / "VRAM Lab" / "traces"
    return Path(xdg or Path.home() / ".cache") / "vramlab" / "traces"


_KEY_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"))  # json.dumps with these, made once


def key_digest(key: object) -> str:
    """A file name for a key: the SHA-256 of its canonical JSON."""
    return hashlib.sha256(_KEY_JSON.encode(key).encode()).hexdigest()
