"""A model named by its Hugging Face Hub id (``org/name`` or ``org/name@revision``), read without weights.

What is read: ``config.json`` (or an adapter's ``adapter_config.json``) and ``model.safetensors.index.json``
through :func:`huggingface_hub.hf_hub_download` (so they land in, and are found in, the usual cache), and
the JSON header of each safetensors file through two HTTP range requests (the 8-byte length, then exactly
the header): never a byte of tensor data. The headers are validated as a local file's are
(:func:`vramlab.core.sources.files.parse_safetensors_header`, with the file size from ``Content-Range``) and kept
in VRAM Lab's own cache per commit, so the next lookup needs no network.

``huggingface_hub.get_safetensors_metadata`` is not used: it asks for the first 100,000 bytes of every file
(tensor data whenever the header is shorter) and drops the file size, which the validation needs.

Environment, read at each call (so a running window follows a changed environment): ``HF_ENDPOINT``,
``HF_HOME`` / ``HF_HUB_CACHE`` (the cache), ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``),
``HF_HUB_ETAG_TIMEOUT`` (seconds per request, default 10), and the token from ``HF_TOKEN`` or a saved
``hf auth login``. A model whose config is in the cache is read from there with no request at all.

Errors are :class:`~vramlab.core.checks.SetupError` with one line that says what to do.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from vramlab.core.checks import SetupError
from vramlab.core.sources.config_file import read_config_file
from vramlab.core.sources.files import (
    SafetensorsIndex,
    TensorInfo,
    load_config_json,
    parse_safetensors_header,
    read_safetensors_index,
)
from vramlab.core.sources.folder import ImportedModel, import_from_parts, load_model_source, processor_files

__all__ = [
    "HubModel",
    "HubRef",
    "HubSettings",
    "LookupCancelled",
    "NotCached",
    "cached_model_ids",
    "load_hub_model",
    "parse_hub_id",
]

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]{{0,199}}))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
_HEADER_CACHE_VERSION = 1
_ADAPTER_DEPTH = 2  # an adapter naming an adapter naming a model is already unusual


class LookupCancelled(Exception):
    """The caller's ``cancelled()`` said stop between two requests."""


class NotCached(SetupError):
    """Offline (or looking in the caches only) and the model is not in the local cache."""


class Unreachable(NotCached):
    """The Hub cannot be reached (no network, a timeout) and the model is not in the local cache."""


class _NoSuchFile(Exception):
    """The repository exists but has no file of that name (HTTP 404 EntryNotFound)."""


@dataclass(frozen=True)
class HubRef:
    """``org/name`` and an optional revision (branch, tag or commit; ``None`` is ``main``)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(text: str) -> HubRef | None:
    """``org/name[@revision]`` as a :class:`HubRef`, or ``None`` when ``text`` is not shaped like one.

    The caller decides whether a local path of the same spelling wins (it does in :mod:`catalog`)."""
    m = _HUB_ID.fullmatch(text.strip())
    if m is None or ".." in m["repo"] or "--" in m["repo"] or ".." in (m["rev"] or ""):
        return None
    return HubRef(m["repo"], m["rev"])


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


@dataclass(frozen=True)
class HubSettings:
    """Where and how to reach the Hub; :meth:`from_env` reads what huggingface_hub documents."""

    endpoint: str
    cache_dir: Path
    offline: bool
    timeout_s: float
    header_cache: Path  # VRAM Lab's cache of safetensors headers, per repository and commit
    offline_reason: str = "HF_HUB_OFFLINE is set"  # why no request is made, for the messages

    @classmethod
    def from_env(cls) -> HubSettings:
        env = os.environ
        home = Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                    / "huggingface").expanduser()
        cache = Path(env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or home / "hub").expanduser()
        try:
            timeout = float(env.get("HF_HUB_ETAG_TIMEOUT") or 10)
        except ValueError:
            timeout = 10.0
        ours = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "vramlab" / "hub-headers"
        return cls(endpoint=(env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/"), cache_dir=cache,
                   offline=_env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE"),
                   timeout_s=max(0.1, timeout), header_cache=ours)


@dataclass(frozen=True)
class HubModel:
    """A Hub model read into a spec. ``adapter`` is the ``adapter_config.json`` when the id named a peft
    adapter (``imported`` is then its base model, ``adapter_repo`` the adapter's id)."""

    ref: HubRef
    commit: str
    imported: ImportedModel
    snapshot: str  # the cache folder holding config.json (for transformers' AutoConfig in --hf)
    # HTTP requests this lookup started (0: everything came from the caches, no network at all); a download
    # through huggingface_hub counts once, though it may make two (HEAD, then GET)
    requests: int = 0
    headers_read: int = 0  # safetensors headers fetched by byte range in this lookup
    adapter: dict[str, Any] | None = None
    adapter_repo: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def origin(self) -> str:
        """One line for people: which repository and commit, and whether the network was used."""
        if self.requests == 0:
            how = "local cache, no network"
        elif self.headers_read:
            how = f"Hub: config and {self.headers_read} safetensors header(s), no weights"
        else:
            how = "Hub: config, no weights"
        head = f"{self.adapter_repo} (adapter) on " if self.adapter_repo else ""
        return f"{head}{self.ref.repo_id} @ {self.commit[:12]} ({how})"


class LookupStep(NamedTuple):
    """One step of a lookup, as its progress callback receives it: what is done now, and whether it goes to
    the network (a request to the Hub) or reads this machine (the local cache, a folder)."""

    text: str
    network: bool


Progress = Callable[[LookupStep], None]


class _Lookup:
    """One lookup: the settings, the request count, progress and cancellation."""

    def __init__(self, settings: HubSettings, progress: Progress | None, cancelled: Callable[[], bool] | None):
        self.s = settings
        self.requests = 0
        self.headers_read = 0
        self._progress = progress
        self._cancelled = cancelled

    def step(self, message: str, network: bool) -> None:
        if self._cancelled is not None and self._cancelled():
            raise LookupCancelled(message)
        if self._progress is not None:
            self._progress(LookupStep(message, network))

    # ---- errors --------------------------------------------------------------------------------------

    def error(self, ref: HubRef, e: BaseException) -> SetupError:
        """One line for anything huggingface_hub or the connection raised."""
        from huggingface_hub import errors

        where = self.s.endpoint
        if isinstance(e, errors.GatedRepoError):
            if _has_token():
                return SetupError(f"{ref}: gated repository, and your token has no access: accept its terms "
                                  f"on {where}/{ref.repo_id}")
            return SetupError(f"{ref}: gated repository: accept its terms on the Hub, then set HF_TOKEN or run "
                              "`hf auth login`")
        if isinstance(e, errors.RevisionNotFoundError):
            return SetupError(f"{ref}: the repository has no revision {ref.revision!r}")
        if isinstance(e, errors.RepositoryNotFoundError):
            private = "" if _has_token() else " (if it is private, set HF_TOKEN or run `hf auth login`)"
            return SetupError(f"{ref}: no such model repository on {where}{private}")
        if isinstance(e, errors.OfflineModeIsEnabled):
            return self.offline_error(ref)
        chain = _chain(e)
        if any("Timeout" in type(x).__name__ for x in chain):
            return Unreachable(f"{ref}: {where} did not answer within {self.s.timeout_s:g} s (HF_HUB_ETAG_TIMEOUT); "
                               "try again, or set HF_HUB_OFFLINE=1 to use only the local cache")
        if isinstance(e, errors.HfHubHTTPError) and e.response is not None:
            return SetupError(f"{ref}: {where} answered HTTP {e.response.status_code} "
                              f"({e.response.reason_phrase or 'error'})")
        if any(isinstance(x, OSError | ConnectionError) or "Connect" in type(x).__name__ for x in chain):
            return Unreachable(f"{ref}: cannot reach {where} and the model is not in the local cache "
                               f"({self.s.cache_dir})")
        return SetupError(f"{ref}: Hub lookup failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")

    def offline_error(self, ref: HubRef) -> NotCached:
        hint = "look it up once online, or unset HF_HUB_OFFLINE" if "HF_HUB_OFFLINE" in self.s.offline_reason \
            else "look it up on the Hub"
        return NotCached(f"{ref}: not in the local Hugging Face cache ({self.s.cache_dir}) and "
                         f"{self.s.offline_reason}: {hint}")

    # ---- files through huggingface_hub's cache ----------------------------------------------------------

    def download(self, ref: HubRef, filename: str, revision: str | None) -> Path | None:
        """A small file through hf_hub_download (cached as huggingface_hub caches); ``None`` when the
        repository has no such file."""
        from huggingface_hub import errors, hf_hub_download

        self.step(f"fetching {filename} of {ref.repo_id}", network=True)
        if not self.s.offline and not self.probe(ref, filename, revision):
            return None
        self.requests += 1
        try:
            return Path(hf_hub_download(ref.repo_id, filename, revision=revision, cache_dir=self.s.cache_dir,
                                        endpoint=self.s.endpoint, etag_timeout=self.s.timeout_s,
                                        local_files_only=self.s.offline))
        except errors.RemoteEntryNotFoundError:
            return None
        except errors.LocalEntryNotFoundError as e:
            if self.s.offline:
                raise self.offline_error(ref) from e
            raise self.error(ref, e.__cause__ or e) from e
        except Exception as e:  # huggingface_hub's errors and the transport's (not OSErrors)
            raise self.error(ref, e) from e

    def probe(self, ref: HubRef, filename: str, revision: str | None) -> bool:
        """One HEAD request, within the timeout and without retries, before huggingface_hub's download
        (which retries a silent server for minutes): False when the repository has no such file."""
        from huggingface_hub import errors, get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

        self.requests += 1
        url = hf_hub_url(ref.repo_id, filename, revision=revision, endpoint=self.s.endpoint)
        try:
            r = get_session().head(url, headers=build_hf_headers(), timeout=self.s.timeout_s, follow_redirects=False)
            hf_raise_for_status(r)
        except errors.RemoteEntryNotFoundError:
            return False
        except Exception as e:  # huggingface_hub's errors and the transport's (timeouts, refused connections)
            raise self.error(ref, e) from e
        return True

    # ---- safetensors headers over HTTP ranges ----------------------------------------------------------

    def _range(self, ref: HubRef, url: str, first: int, last: int) -> tuple[bytes, int]:
        """Bytes ``first..last`` (inclusive) of a remote file and the file's total size."""
        from huggingface_hub import errors, get_session
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

        self.requests += 1
        headers = {**build_hf_headers(), "Range": f"bytes={first}-{last}", "Accept-Encoding": "identity"}
        try:
            with get_session().stream("GET", url, headers=headers, timeout=self.s.timeout_s,
                                      follow_redirects=True) as r:
                if r.status_code >= 400:
                    r.read()
                    hf_raise_for_status(r)
                if r.status_code != 206:  # a server that ignores Range would send the weights: stop at once
                    raise SetupError(f"{ref}: {url} ignored the byte range (HTTP {r.status_code}); VRAM Lab "
                                     "reads safetensors headers only and never downloads weights")
                data = b""
                for chunk in r.iter_bytes():
                    data += chunk
                    if len(data) > last - first + 1:
                        break
                total = _total_from_content_range(r.headers.get("Content-Range", ""))
        except SetupError:
            raise
        except errors.RemoteEntryNotFoundError as e:
            raise _NoSuchFile(url) from e
        except errors.HfHubHTTPError as e:
            raise self.error(ref, e) from e
        except Exception as e:  # transport errors (timeouts, refused connections)
            raise self.error(ref, e) from e
        if total is None or len(data) != last - first + 1:
            raise SetupError(f"{ref}: {url}: the server's byte-range answer is malformed "
                             f"({len(data)} bytes, Content-Range {r.headers.get('Content-Range')!r})")
        return data, total

    def header(self, ref: HubRef, commit: str, filename: str) -> tuple[str, int]:
        """The JSON header text of one remote safetensors file and the file's size in bytes."""
        from huggingface_hub import hf_hub_url

        self.step(f"reading the header of {filename}", network=True)
        url = hf_hub_url(ref.repo_id, filename, revision=commit, endpoint=self.s.endpoint)
        head, total = self._range(ref, url, 0, 7)
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > total:
            raise SetupError(f"{ref}: {filename} is not a safetensors file (header length {n:,} bytes in a "
                             f"file of {total:,})")
        raw, _ = self._range(ref, url, 8, 8 + n - 1)
        self.headers_read += 1
        try:
            return raw.decode("utf-8"), total
        except UnicodeDecodeError as e:
            raise SetupError(f"{ref}: {filename}: safetensors header is not UTF-8 text (byte {e.start})") from e


def _chain(e: BaseException) -> list[BaseException]:
    out, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _total_from_content_range(value: str) -> int | None:
    m = re.fullmatch(r"\s*bytes\s+\d+-\d+/(\d+)\s*", value)
    return int(m[1]) if m else None


def _has_token() -> bool:
    from huggingface_hub import get_token

    try:
        return bool(get_token())
    except Exception:  # an unreadable token file is no token
        return False


# ---- VRAM Lab's header cache -----------------------------------------------------------------------------


def _header_cache_file(s: HubSettings, repo_id: str, commit: str) -> Path:
    return s.header_cache / ("models--" + repo_id.replace("/", "--")) / f"{commit}.json"


def _read_header_cache(s: HubSettings, repo_id: str, commit: str) -> dict[str, Any] | None:
    path = _header_cache_file(s, repo_id, commit)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != _HEADER_CACHE_VERSION \
            or not isinstance(data.get("files"), dict):
        return None
    return data


def _write_header_cache(s: HubSettings, repo_id: str, commit: str, files: dict[str, Any]) -> None:
    """Best effort (a read-only home still gets its answer): temporary file, then rename."""
    path = _header_cache_file(s, repo_id, commit)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"version": _HEADER_CACHE_VERSION, "files": files}, f)
        os.replace(tmp, path)
    except OSError:
        pass


# ---- the lookup ------------------------------------------------------------------------------------------


def _cached_snapshot(ref: HubRef, s: HubSettings) -> Path | None:
    """The cache's snapshot folder for the ref (branch and tag names through ``refs/``), when it holds a
    config.json or an adapter_config.json. Reads the disk only."""
    repo = s.cache_dir / ("models--" + ref.repo_id.replace("/", "--"))
    rev = ref.revision or "main"
    commit = rev
    ref_file = repo / "refs" / rev
    try:
        if ref_file.is_file():
            commit = ref_file.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    if not _COMMIT.fullmatch(commit):
        return None
    snap = repo / "snapshots" / commit
    if (snap / "config.json").is_file() or (snap / "adapter_config.json").is_file():
        return snap
    return None


def _weights_complete(snap: Path) -> bool:
    """The snapshot holds the whole safetensors checkpoint (the user downloaded the model)."""
    if (snap / "model.safetensors").is_file():
        return True
    index = snap / "model.safetensors.index.json"
    if not index.is_file():
        return False
    try:
        return all((snap / shard).is_file() for shard in read_safetensors_index(index).shards)
    except SetupError:
        return False


def load_hub_model(ref: HubRef | str, *, settings: HubSettings | None = None, progress: Progress | None = None,
                   cancelled: Callable[[], bool] | None = None) -> HubModel:
    """Read a Hub model's config and safetensors headers (see the module docstring).

    ``progress(message)`` is called before each request; ``cancelled()`` is checked there too and raises
    :class:`LookupCancelled`. Raises :class:`SetupError` with one line for every failure.
    """
    if isinstance(ref, str):
        parsed = parse_hub_id(ref)
        if parsed is None:
            raise SetupError(f"{ref!r} is not a Hub id (org/name or org/name@revision)")
        ref = parsed
    look = _Lookup(settings or HubSettings.from_env(), progress, cancelled)
    return _load(ref, look, depth=0)


def _load(ref: HubRef, look: _Lookup, depth: int) -> HubModel:
    s = look.s
    snap = _cached_snapshot(ref, s)
    if snap is None:
        if s.offline:
            raise look.offline_error(ref)
        path = look.download(ref, "config.json", ref.revision)
        if path is None:
            path = look.download(ref, "adapter_config.json", ref.revision)
        if path is None:
            raise SetupError(f"{ref}: the repository has no config.json (nor adapter_config.json): not a "
                             "transformers model")
        snap = path.parent
    commit = snap.name
    if not (snap / "config.json").is_file():
        return _adapter(ref, snap, look, depth)
    if _weights_complete(snap):  # the model itself was downloaded: read it as a local folder
        look.step(f"reading {ref.repo_id} from the local cache", network=False)
        imported = load_model_source(snap)
        imported = _renamed(imported, ref.repo_id)
        return HubModel(ref=ref, commit=commit, imported=imported, snapshot=str(snap), requests=look.requests,
                    headers_read=look.headers_read)
    headers, index, notes = _headers(ref, commit, snap, look)
    cfg = load_config_json(snap / "config.json")
    imported = import_from_parts(cfg, name=ref.repo_id, source_path=f"{ref.repo_id}@{commit}",
                                 config_source=f"{ref.repo_id}/config.json", shard_headers=headers, index=index,
                                 warnings=notes, processor=processor_files(snap, notes))  # in the cache already
    return HubModel(ref=ref, commit=commit, imported=imported, snapshot=str(snap), requests=look.requests,
                    headers_read=look.headers_read)


def _renamed(imported: ImportedModel, repo_id: str) -> ImportedModel:
    import dataclasses

    return dataclasses.replace(imported, source_path=f"{repo_id} ({imported.source_path})")


def _headers(ref: HubRef, commit: str, snap: Path, look: _Lookup
             ) -> tuple[list[dict[str, TensorInfo]] | None, SafetensorsIndex | None, list[str]]:
    """One validated header per weight file (from our cache or the Hub), the index, and notes."""
    s = look.s
    cached = _read_header_cache(s, ref.repo_id, commit)
    files: dict[str, Any]
    if cached is not None:
        files = cached["files"]
    elif s.offline:
        return None, None, [f"{s.offline_reason} and the safetensors headers of this commit are not cached: "
                            "the parameter count comes from config.json only"]
    else:
        index_path = snap / "model.safetensors.index.json"
        if not index_path.is_file():
            index_path = look.download(ref, "model.safetensors.index.json", commit)
        names = read_safetensors_index(index_path).shards if index_path is not None else ("model.safetensors",)
        files = {}
        for name in names:
            try:
                text, size = look.header(ref, commit, name)
            except _NoSuchFile as e:
                if index_path is None:  # neither an index nor model.safetensors: no safetensors at all
                    break
                raise SetupError(f"{ref}: the index lists {name}, which the repository does not have") from e
            files[name] = {"header": text, "size": size}
        files = {"index": index_path is not None, "shards": files}
        _write_header_cache(s, ref.repo_id, commit, files)
    shards = files.get("shards") or {}
    if not shards:
        return None, None, [f"{ref.repo_id} has no safetensors weights (model.safetensors or an index): the "
                            "parameter count comes from config.json only"]
    index = None
    if files.get("index"):
        index_file = snap / "model.safetensors.index.json"
        if not index_file.is_file():
            index_file = look.download(ref, "model.safetensors.index.json", commit)
        index = read_safetensors_index(index_file) if index_file is not None else None
    headers = []
    for name, entry in sorted(shards.items()):
        text, size = entry["header"], int(entry["size"])
        raw = text.encode("utf-8")
        headers.append(parse_safetensors_header(raw, data_size=size - 8 - len(raw),
                                                source=f"{ref.repo_id}/{name}"))
    return headers, index, []


def _adapter(ref: HubRef, snap: Path, look: _Lookup, depth: int) -> HubModel:
    cfg = read_config_file(snap / "adapter_config.json")
    base = cfg.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip():
        raise SetupError(f"{ref}: adapter_config.json names no base_model_name_or_path: give the base model "
                         "with -m and the adapter with --config")
    base_ref = parse_hub_id(base)
    if base_ref is None or depth >= _ADAPTER_DEPTH:
        raise SetupError(f"{ref}: the adapter's base model {base!r} is not a Hub id: give it with -m and the "
                         "adapter_config.json with --config")
    model = _load(base_ref, look, depth + 1)
    import dataclasses

    return dataclasses.replace(model, adapter=cfg, adapter_repo=f"{ref}", requests=look.requests,
                               headers_read=look.headers_read)


# ---- what the window offers -------------------------------------------------------------------------------


def cached_model_ids(settings: HubSettings | None = None) -> list[str]:
    """Ids of the model repositories in the local Hugging Face cache that hold a config (disk only)."""
    s = settings or HubSettings.from_env()
    out = []
    try:
        folders = sorted(s.cache_dir.glob("models--*--*"))
    except OSError:
        return []
    for folder in folders:
        repo_id = folder.name.removeprefix("models--").replace("--", "/", 1)
        if parse_hub_id(repo_id) is not None and _cached_snapshot(HubRef(repo_id), s) is not None:
            out.append(repo_id)
    return out
