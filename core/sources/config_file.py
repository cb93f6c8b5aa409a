"""One training config file read as data: JSON, YAML (``yaml.safe_load``) or a shell script running ms-swift."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.sources.swift import is_command, parse_command

MAX_CONFIG_BYTES = 4 * 1024**2  # a training config is a few KiB


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A JSON or YAML file as a dict (``yaml.safe_load``: no tags, no code). ``.json`` files are read as
    JSON, everything else as YAML (YAML also reads most JSON)."""
    import yaml

    p = Path(path).expanduser()
    try:
        if not p.is_file():
            raise SetupError(f"{p}: " + ("no such file" if not p.exists() else "not a regular file"))
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise SetupError(f"{p}: {size:,} bytes is far too large for a training config")
        with p.open("rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise SetupError(f"{p}: far too large for a training config")
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SetupError(f"{p}: not UTF-8 text (byte {e.start})") from e
    except OSError as e:
        raise SetupError(f"{p}: cannot read ({e.strerror or e})") from e

    if p.suffix.lower() in (".sh", ".bash", ".txt", "") and is_command(text):
        return parse_command(text, str(p))
    try:
        if p.suffix.lower() == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise SetupError(f"{p}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
        else:
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                problem = getattr(e, "problem", None) or type(e).__name__
                raise SetupError(f"{p}: not valid YAML ({problem}{at})") from e
    except RecursionError as e:
        raise SetupError(f"{p}: nested too deeply to be a config") from e
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise SetupError(f"{p}: a config must be a mapping of keys to values, not {kind}")
    return data
