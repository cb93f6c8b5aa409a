"""A small Hugging Face Hub for tests: a real HTTP server on 127.0.0.1 (random port) that answers the
``/{repo}/resolve/{revision}/{file}`` requests huggingface_hub makes, as the Hub does (``X-Repo-Commit``,
``ETag``, byte ranges with ``Content-Range``, and the ``X-Error-Code`` of its errors), and logs every request
with the byte ranges it served, so a test can prove that no tensor data left the server.

Repositories (all tiny Llama-style models written here, weights as zero bytes):

* ``acme/tiny-llama``      public, one ``model.safetensors``
* ``acme/gated-llama``     gated: 401 ``GatedRepo`` without ``Authorization: Bearer <TOKEN>``
* ``acme/sharded-llama``   ``model.safetensors.index.json`` + two shards
* ``acme/tiny-lora``       a peft adapter: ``adapter_config.json`` naming ``acme/tiny-llama``
* ``acme/no-config``       a repository with a README only
* ``acme/slow``            answers after ``SLOW_S`` seconds (a timeout)
* anything else            404 ``RepoNotFound``
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

TOKEN = "hf_test_token_123"
SLOW_S = 3.0

# the tiny model: Llama layout, hidden 64, 2 layers, 4 heads (2 KV), MLP 128, vocab 256, untied
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def tiny_tensors(cfg: dict[str, Any] = TINY_CONFIG) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the tiny model, as transformers names them."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,)}
    out |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return out


_DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def safetensors_head(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[bytes, int]:
    """The header bytes of a safetensors file holding ``tensors`` (name -> (dtype, shape)) of zeros, and the
    file's total size. Tests write files of any declared size from it without writing the data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = _DTYPE_BYTES[dtype] * _numel(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return head, len(head) + offset


def safetensors_bytes(shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> bytes:
    """A valid safetensors file (zero data) and nothing else."""
    head, size = safetensors_head({name: (dtype, shape) for name, shape in shapes.items()})
    return head + bytes(size - len(head))


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    gated: bool = False
    slow: bool = False
    # big files made up on demand: name -> (the bytes up to the end of the safetensors header, total size);
    # everything after the header reads as zeros (a real checkpoint's size without holding it in memory)
    virtual: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    delay_s: float = 0.0  # each answer waits this long (to watch a lookup in the window)

    def size(self, name: str) -> int | None:
        if name in self.files:
            return len(self.files[name])
        return self.virtual[name][1] if name in self.virtual else None

    def read(self, name: str, first: int, last: int) -> bytes:
        if name in self.files:
            return self.files[name][first:last + 1]
        head, _ = self.virtual[name]
        data = head[first:last + 1]
        return data + bytes(last + 1 - first - len(data))


def virtual_safetensors(shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> tuple[bytes, int]:
    """A safetensors file of zeros as (header bytes, total size), for :attr:`Repo.virtual`."""
    return safetensors_head({name: (dtype, shape) for name, shape in shapes.items()})


def _commit(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


def fixture_repos() -> dict[str, Repo]:
    cfg = json.dumps(TINY_CONFIG).encode()
    shapes = tiny_tensors()
    single = safetensors_bytes(shapes)
    names = list(shapes)
    half = len(names) // 2
    shard_names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    shard_a = safetensors_bytes({k: shapes[k] for k in names[:half]})
    shard_b = safetensors_bytes({k: shapes[k] for k in names[half:]})
    index = {"metadata": {"total_size": 2 * sum(_numel(s) for s in shapes.values())},
             "weight_map": {k: shard_names[0] if j < half else shard_names[1] for j, k in enumerate(names)}}
    adapter = {"peft_type": "LORA", "base_model_name_or_path": "acme/tiny-llama", "r": 16, "lora_alpha": 32,
               "lora_dropout": 0.05, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
               "task_type": "CAUSAL_LM", "bias": "none"}
    return {
        "acme/tiny-llama": Repo({"config.json": cfg, "model.safetensors": single}, _commit("tiny")),
        "acme/gated-llama": Repo({"config.json": cfg, "model.safetensors": single}, _commit("gated"), gated=True),
        "acme/sharded-llama": Repo({"config.json": cfg, "model.safetensors.index.json": json.dumps(index).encode(),
                                    shard_names[0]: shard_a, shard_names[1]: shard_b}, _commit("sharded")),
        "acme/tiny-lora": Repo({"adapter_config.json": json.dumps(adapter).encode(),
                                "adapter_model.safetensors": safetensors_bytes({"x": (16, 64)}, "F32")},
                               _commit("lora")),
        "acme/no-config": Repo({"README.md": b"# nothing here\n"}, _commit("none")),
        "acme/slow": Repo({"config.json": cfg}, _commit("slow"), slow=True),
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class Served:
    """One request: method, repository, file, and the byte span of the file sent (``None``: nothing)."""

    method: str
    repo: str
    filename: str
    status: int
    span: tuple[int, int] | None  # [first, last] inclusive
    authorized: bool


@dataclass
class HubServer:
    repos: dict[str, Repo] = field(default_factory=fixture_repos)
    log: list[Served] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> str:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                server._answer(self, head=True)

            def do_GET(self) -> None:
                server._answer(self, head=False)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def stop(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    # ---- requests --------------------------------------------------------------------------------------

    def weight_bytes_sent(self) -> int:
        """Bytes of tensor data (past each safetensors header) that left the server."""
        sent = 0
        for r in self.log:
            if r.span is None or not r.filename.endswith(".safetensors"):
                continue
            data_start = 8 + struct.unpack("<Q", self.repos[r.repo].read(r.filename, 0, 7))[0]
            first, last = r.span
            sent += max(0, last + 1 - max(first, data_start))
        return sent

    def _answer(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", h.path.split("?")[0])
        if m is None:
            return self._error(h, 404, "", "", None, head)
        repo_id, rev, filename = m[1], m[2], m[3]
        repo = self.repos.get(repo_id)
        authorized = h.headers.get("authorization") == f"Bearer {TOKEN}"
        if repo is None:
            return self._error(h, 404, repo_id, filename, "RepoNotFound", head, authorized)
        if repo.slow or repo.delay_s:
            self._stop.wait(repo.delay_s or SLOW_S)
        if repo.gated and not authorized:
            return self._error(h, 401, repo_id, filename, "GatedRepo", head, authorized)
        if rev not in ("main", repo.commit):
            return self._error(h, 404, repo_id, filename, "RevisionNotFound", head, authorized)
        size = repo.size(filename)
        if size is None:
            return self._error(h, 404, repo_id, filename, "EntryNotFound", head, authorized, repo.commit)
        status, first, last = 200, 0, size - 1
        rng = h.headers.get("range")
        if rng:
            rm = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if rm is None or int(rm[1]) >= size:
                return self._error(h, 416, repo_id, filename, None, head, authorized, repo.commit)
            first = int(rm[1])
            last = min(int(rm[2]) if rm[2] else size - 1, size - 1)
            status = 206
        h.send_response(status)
        h.send_header("X-Repo-Commit", repo.commit)
        h.send_header("ETag", f'"{hashlib.sha256(f"{repo.commit}/{filename}".encode()).hexdigest()}"')
        h.send_header("Content-Length", str(last - first + 1))
        h.send_header("Accept-Ranges", "bytes")
        if status == 206:
            h.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        h.end_headers()
        self.log.append(Served("HEAD" if head else "GET", repo_id, filename, status,
                               None if head else (first, last), authorized))
        if not head:
            try:
                h.wfile.write(repo.read(filename, first, last))
            except OSError:  # the client hung up
                pass

    def _error(self, h: BaseHTTPRequestHandler, status: int, repo: str, filename: str, code: str | None,
               head: bool, authorized: bool = False, commit: str | None = None) -> None:
        self.log.append(Served("HEAD" if head else "GET", repo, filename, status, None, authorized))
        body = json.dumps({"error": code or "error"}).encode()
        try:
            h.send_response(status)
            if code:
                h.send_header("X-Error-Code", code)
            if commit:
                h.send_header("X-Repo-Commit", commit)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            if not head:
                h.wfile.write(body)
        except OSError:
            pass



def serve_hub(tmp_path: Path, monkeypatch: Any) -> Iterator[HubServer]:
    """Body of a ``hub`` fixture: the server started, ``HF_ENDPOINT`` at it, every cache (huggingface_hub's
    and VRAM Lab's header cache) in ``tmp_path``, no token and not offline, whatever the developer exported."""
    import huggingface_hub.constants as hf_constants

    server = HubServer()
    url = server.start()
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "5")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))  # no saved login
    try:
        yield server
    finally:
        server.stop()
