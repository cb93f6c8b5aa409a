"""What FakeTensorMode answered for the fast simulation, kept on disk between processes.

The fast simulation (:mod:`.metasim`) asks the reference, FakeTensorMode on fake CPU tensors, two things:
the layout of an op's outputs the first time it sees an op key (:func:`.metasim._on_fake`), and the ATen
ops ``F.scaled_dot_product_attention`` dispatches for a new input layout (:func:`.composite.sdpa`). Both
answers are a pure function of the torch build, the op (or the attention call) and its arguments' metadata
and values, which is what the keys hold: FakeTensorMode computes them from nothing else (its own dispatch
cache rests on the same fact). A process that starts FakeTensorMode pays for importing ``torch._dynamo``
(about 1.5 s: ``FakeTensorMode.__init__`` imports ``torch._dynamo.config``) and for the fake dispatch of
each new key; a setup simulated before on the same torch build finds every answer here and pays neither.

The answers are kept exactly, as FakeTensorMode gave them, in a text file (:class:`FakeReferences`: a
JSON header, then a JSON answer a line; no pickle: what it holds is data, and the ops it names are looked
up in ``torch.ops.aten`` and ``torch.ops.prim`` only) in the user's cache folder beside the traced tapes
(``VRAMLAB_CACHE_DIR`` honoured), keyed by the SHA-256 of the key's ``repr`` and valid for one torch build
only (``torch.__version__``, the git commit it was built from and the CPU capability its kernels were
chosen for): a file from another build is ignored and replaced. At most :data:`MAX_ENTRIES` answers and
:data:`MAX_BYTES` bytes (the oldest go first). Written atomically, merged with what the file holds when it
is written (two processes writing at the same moment may lose one's new answers: a later miss, never a
wrong answer); a file that cannot be read or is damaged is a miss, never an error, and a cache folder that
cannot be found or written leaves the answers in this process only.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from pathlib import Path
from typing import Any

import torch

from vramlab.core.cache import cache_dir
from vramlab.core.fileio import write_atomic

FORMAT = 1  # bumped when the file's layout or the meaning of a stored value changes
FILE_NAME = "fake-reference.txt"
MAX_ENTRIES = 32768  # a Llama-2-7B setup keeps about a hundred
MAX_BYTES = 8 * 2**20  # read (not parsed) at the first simulation of a process: milliseconds
MISSING = object()
_OP_NAMESPACES = ("aten", "prim")


class Ref:
    """A tensor of a recorded composite, named by its index (:mod:`.metasim`'s attention programs)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and other.index == self.index

    def __hash__(self) -> int:
        return hash(self.index)

    def __repr__(self) -> str:
        return f"Ref({self.index})"


class Unstorable(Exception):
    """A value the file format has no exact form for (it stays in memory only)."""


def torch_build() -> str:
    """The torch build the answers hold for: its version, commit and the CPU kernels it picked."""
    return f"{torch.__version__} {torch.version.git_version} {torch.backends.cpu.get_cpu_capability()}"


def digest(key: object) -> str:
    """The stored name of a key: SHA-256 of its ``repr`` (a key holds tuples, numbers, strings, dtypes,
    devices and types, whose ``repr`` is the same in every process of one torch build)."""
    return hashlib.sha256(repr(key).encode()).hexdigest()


def encode(x: Any) -> Any:  # noqa: PLR0911
    """``x`` as JSON values, tuples, dtypes and ops tagged so that :func:`decode` gives ``x`` back equal."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        if not math.isfinite(x):
            raise Unstorable(x)
        return x
    if isinstance(x, tuple):
        return {"t": [encode(v) for v in x]}
    if isinstance(x, list):
        return [encode(v) for v in x]
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        return {"d": {k: encode(v) for k, v in x.items()}}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, (torch.layout, torch.memory_format)):
        return {"enum": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if x is tuple or x is list:
        return {"type": x.__name__}
    if isinstance(x, Ref):
        return {"ref": x.index}
    if isinstance(x, torch._ops.OpOverload) and x.namespace in _OP_NAMESPACES:
        return {"op": [x.namespace, x._opname, x._overloadname]}
    raise Unstorable(type(x).__name__)


def decode(x: Any) -> Any:  # noqa: PLR0911
    """The value :func:`encode` was given; raises (KeyError, TypeError, ValueError, AttributeError) on what
    it never writes."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [decode(v) for v in x]
    (tag, v), = x.items()
    if tag == "t":
        return tuple(decode(u) for u in v)
    if tag == "d":
        return {k: decode(u) for k, u in v.items()}
    if tag == "ref":
        if not isinstance(v, int):
            raise TypeError(v)
        return Ref(v)
    if tag == "type":
        return {"tuple": tuple, "list": list}[v]
    if tag == "device":
        return torch.device(v)
    if tag in ("dtype", "enum"):
        value = getattr(torch, v)
        if not isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            raise TypeError(v)
        return value
    if tag == "op":
        namespace, name, overload = v
        if namespace not in _OP_NAMESPACES:
            raise ValueError(namespace)
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(v)
        return op
    raise KeyError(tag)


class FakeReferences:
    """FakeTensorMode's answers by key: read from disk at the first :meth:`get`, written by :meth:`save`.

    The file is a header line (JSON: the format and the torch build) and then one line per answer, its key's
    digest and its JSON, the oldest first: a process reads the lines and parses only the answers it asks for
    (a full file holds tens of thousands, which parsed whole would cost tens of MB and a noticeable part of
    a second)."""

    def __init__(self, folder: Path | None = None) -> None:
        self._folder = folder
        self._lock = threading.Lock()
        self._entries: dict[str, str] | None = None  # digest -> the answer's JSON, oldest first
        self._new: dict[str, str] = {}  # answers this process found and has not written yet
        self.hits = self.misses = 0
        self._last: tuple[object, str] = (object(), "")

    @property
    def path(self) -> Path:
        if self._folder is not None:
            return self._folder / FILE_NAME
        return cache_dir() / FILE_NAME  # beside the traced tapes

    def _name(self, key: object) -> str:
        """``digest(key)``, once for a :meth:`get` and the :meth:`put` of the same key object that follows
        it (a foreach op's key holds hundreds of tensors' layouts)."""
        last = self._last
        if last[0] is key:
            return last[1]
        name = digest(key)
        self._last = (key, name)
        return name

    def get(self, key: object) -> Any:
        """The stored answer for ``key``, or :data:`MISSING`."""
        name = self._name(key)
        with self._lock:
            if self._entries is None:
                self._entries = self._read()
            text = self._entries.get(name)
        if text is not None:
            try:
                value = decode(json.loads(text))
            except (KeyError, TypeError, ValueError, AttributeError, RuntimeError):
                value = MISSING  # not what we write: asked again, and replaced
            else:
                self.hits += 1
                return value
        self.misses += 1
        return MISSING

    def put(self, key: object, value: Any) -> None:
        try:
            text = json.dumps(encode(value), separators=(",", ":"), allow_nan=False)
        except (Unstorable, ValueError):
            return
        name = self._name(key)
        with self._lock:
            if self._entries is None:
                self._entries = self._read()
            self._entries[name] = text
            self._new[name] = text

    def save(self) -> None:
        """Add this process's new answers to the file (merged with what is there now, bounded)."""
        with self._lock:
            if not self._new:
                return
            new, self._new = self._new, {}
        try:
            path = self.path
        except (OSError, RuntimeError):  # no home folder to put a cache in
            return
        entries = self._read()
        for name, text in new.items():
            entries.pop(name, None)
            entries[name] = text  # newest last
        header = json.dumps({"format": FORMAT, "torch": torch_build()}) + "\n"
        lines = [f"{name} {text}\n" for name, text in entries.items()][-MAX_ENTRIES:]
        size = len(header) + sum(map(len, lines))
        first = 0
        while first < len(lines) and size > MAX_BYTES:
            size -= len(lines[first])
            first += 1
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, header + "".join(lines[first:]))
        except OSError:
            pass

    def forget_memory(self) -> None:
        """Read the file again at the next :meth:`get` (answers not saved yet are dropped)."""
        with self._lock:
            self._entries = None
            self._new = {}

    def _read(self) -> dict[str, str]:
        try:
            with open(self.path, "rb") as f:  # Path.home() raises RuntimeError where there is none
                data = f.read(MAX_BYTES + 1)
            if len(data) > MAX_BYTES:
                return {}
            header, *lines = data.decode("utf-8").split("\n")
            doc = json.loads(header)
        except (OSError, RuntimeError, ValueError):  # RecursionError is a RuntimeError
            return {}
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("torch") != torch_build():
            return {}
        entries = {}
        for line in lines:
            name, _, text = line.partition(" ")
            if len(name) == 64 and text:  # a line of anything else is not ours: skipped
                entries[name] = text
        return entries


STORE = FakeReferences()
