"""Writing and reading the user's files safely: every file VRAM Lab writes goes through :func:`write_atomic`.

A write goes to a temporary file in the target's own folder (so the rename stays on one file system),
is flushed and fsynced, and then replaces the target with :func:`os.replace`, which is atomic on POSIX
and Windows. A write that fails halfway (disk full, a signal, a crash) leaves the old file as it was
and no temporary file behind. Qt's ``QSettings`` writes its INI file the same way itself (``QSaveFile``).

:func:`read_json_file` is the matching reader for files a user hands us: a size limit, a depth limit
(Python's parser recurses on nested arrays) and every failure as :class:`FileProblem` with one line.
:func:`cache_dir` is where the caches VRAM Lab keeps for itself live (traced tapes, counted configs, the
simulation's stored fake-tensor answers).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

# Our JSON files (settings, scenarios, calibration, configs, safetensors headers) are kilobytes to a few MB.
MAX_JSON_BYTES = 64 * 2**20
MAX_JSON_DEPTH = 64


class FileProblem(ValueError):
    """A file that cannot be read or written; the message names it and says why, in one line."""


def write_atomic(path: str | os.PathLike[str], data: bytes | str | Callable[[BinaryIO], None],
                 encoding: str = "utf-8") -> Path:
    """Write ``data`` (bytes, text, or a function that writes to a binary file) to ``path`` atomically.

    The new file keeps the old one's permission bits (0o644 when there was none). Raises OSError as the
    system reports it; the target is then untouched."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:200]}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode(encoding) if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = target.stat().st_mode & 0o777
        except OSError:
            mode = 0o644
        with contextlib.suppress(OSError):
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def write_json(path: str | os.PathLike[str], data: Any) -> Path:
    """JSON with ``allow_nan=False``: a NaN or infinity never reaches a file other programs read."""
    return write_atomic(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def json_depth_ok(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the brackets of a JSON text nest at most ``limit`` deep (strings skipped). Linear, no recursion."""
    depth = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def parse_json(text: str, where: str) -> Any:
    """Parse JSON a user handed us: nesting, huge numbers and NaN/Infinity are refused with one line."""
    if not json_depth_ok(text):
        raise FileProblem(f"{where} nests deeper than {MAX_JSON_DEPTH} levels")

    def constant(name: str) -> Any:
        raise FileProblem(f"{where} holds {name}, which is not a number JSON allows")

    try:
        return json.loads(text, parse_constant=constant)
    except RecursionError:
        raise FileProblem(f"{where} nests too deeply") from None
    except json.JSONDecodeError as e:
        raise FileProblem(f"{where} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise FileProblem(f"{where}: {str(e).splitlines()[0]}") from None


def read_json_file(path: str | os.PathLike[str], max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Read and parse a JSON file a user handed us; :class:`FileProblem` with one line on any failure."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > max_bytes:
            raise FileProblem(f"{p.name} is {size:,} bytes; a file of this kind is at most {max_bytes:,}")
        raw = p.read_bytes()
    except OSError as e:
        raise FileProblem(f"cannot read {p.name}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise FileProblem(f"{p.name} is not a UTF-8 text file") from None
    return parse_json(text, p.name)


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
