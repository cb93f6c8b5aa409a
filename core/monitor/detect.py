"""Which GPUs a training process will see, answered without torch and without a CUDA context.

The GUI process must not create a CUDA context (it would hold device memory for as long as the window
is open and break ``fork``), and should not import torch before its window shows. So GPU detection
here uses NVML only, the way ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` makes torch answer
``torch.cuda.is_available()``:

- :func:`visible_devices` maps CUDA ordinals to NVML devices *by UUID*, applying
  ``CUDA_VISIBLE_DEVICES`` with the rules CUDA uses (and torch mirrors in ``_parse_visible_devices``):
  unset means all GPUs; entries are all integers, all ``GPU-<uuid>`` (full or a unique prefix) or all
  ``MIG-<uuid>``; the first invalid entry ends the list; a repeated device means no device at all;
  empty, ``-1`` or ``NoDevFiles`` (Slurm) mean none.
- :func:`cuda_available_without_context` says whether any usable NVIDIA GPU is visible.
- :func:`describe_gpus` is the data behind ``vramlab gpus [--json]``.

- :func:`cuda_devices` / :func:`cuda_device` are the one mapping from CUDA ordinals to NVML devices that
  the CLI, the profile watcher and the window use; they say whether the mapping is certain.

CUDA numbers GPUs in PCI bus order (NVML's) only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; by default
(``FASTEST_FIRST``) it puts the fastest GPU first by a heuristic NVML cannot reproduce. The order is then
still known when every GPU is the same model (ties keep PCI order), or when ``CUDA_VISIBLE_DEVICES``
names GPUs by UUID. Otherwise :func:`cuda_devices` reports the PCI-order guess as *uncertain*, and the
profile watcher waits for the run's own report of its GPU's UUID (``torch.cuda.get_device_properties``)
before it attributes readings; :func:`describe_gpus` says so in its notes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vramlab.core.monitor.types import GpuInfo, GpuReading, GpuSampler
from vramlab.core.units import fmt_bytes

ENV_VAR = "CUDA_VISIBLE_DEVICES"


def _strtoul(text: str) -> int:
    """The integer a C ``strtoul`` reads from the start of ``text`` ("1gpu" -> 1), or -1 for none."""
    end = 0
    for i, char in enumerate(text):
        if char.isdigit() or (i == 0 and char in "+-"):
            end = i + 1
        else:
            break
    digits = text[:end]
    if not digits or digits in "+-":
        return -1
    return int(digits)


def parse_cuda_visible_devices(value: str | None) -> list[int] | list[str] | None:
    """Parse ``CUDA_VISIBLE_DEVICES`` into ordinals or UUID strings. None means "unset: all GPUs".

    >>> parse_cuda_visible_devices("1,0")
    [1, 0]
    >>> parse_cuda_visible_devices("0,2,-1,3")  # a negative entry ends the list
    [0, 2]
    >>> parse_cuda_visible_devices("0,0")  # a repeated ordinal hides every GPU
    []
    """
    if value is None:
        return None
    value = value.strip()
    for prefix in ("GPU-", "MIG-"):
        if value.startswith(prefix):
            uuids: list[str] = []
            for entry in (e.strip() for e in value.split(",")):
                if not entry.startswith(prefix):
                    break  # anything else ends the list
                if entry in uuids:
                    return []
                uuids.append(entry)
            return uuids
    ordinals: list[int] = []
    for entry in value.split(","):
        ordinal = _strtoul(entry.strip())
        if ordinal < 0:
            break  # "", "-1", "NoDevFiles", "abc": end of the list
        if ordinal in ordinals:
            return []
        ordinals.append(ordinal)
    return ordinals


def _match_prefix(candidate: str, uuids: Sequence[str]) -> int:
    """Position of the one uuid that starts with ``candidate``; -1 when none or ambiguous."""
    candidate = candidate.lower()
    hits = [i for i, uuid in enumerate(uuids) if uuid.lower().startswith(candidate)]
    return hits[0] if len(hits) == 1 else -1


def resolve_visible_devices(value: str | None, devices: Sequence[GpuInfo]) -> list[GpuInfo]:
    """The GPUs a CUDA process sees under ``CUDA_VISIBLE_DEVICES=value``, in CUDA order.

    Each returned GpuInfo has ``index`` set to its CUDA ordinal and keeps its ``nvml_index``; an entry
    that matches no GPU (an ordinal past the last GPU, an unknown or ambiguous UUID prefix) ends the
    list, like CUDA does. For ``MIG-`` entries the parent GPU is returned with ``visible_mig_uuid`` set.
    """
    ordered = sorted(devices, key=lambda d: d.nvml_index)
    parsed = parse_cuda_visible_devices(value)
    if parsed is None:
        return [d.with_cuda_index(i) for i, d in enumerate(ordered)]

    chosen: list[tuple[GpuInfo, str | None]] = []
    by_nvml = {d.nvml_index: d for d in ordered}
    gpu_uuids = [d.uuid for d in ordered]
    for entry in parsed:
        mig_uuid: str | None = None
        if isinstance(entry, int):
            device = by_nvml.get(entry)
        elif entry.startswith("GPU-"):
            hit = _match_prefix(entry, gpu_uuids)
            device = ordered[hit] if hit >= 0 else None
        elif entry.startswith("MIG-GPU-"):  # CUDA 11.0 form: MIG-GPU-<gpu uuid>/<gi>/<ci>
            hit = _match_prefix(entry[len("MIG-") :].split("/", 1)[0], gpu_uuids)
            device, mig_uuid = (ordered[hit], entry) if hit >= 0 else (None, None)
        else:
            owners = [(d, m) for d in ordered for m in d.mig_uuids]
            hit = _match_prefix(entry, [m for _, m in owners])
            device, mig_uuid = owners[hit] if hit >= 0 else (None, None)
        if device is None:
            break
        if any(device.nvml_index == d.nvml_index and mig_uuid == m for d, m in chosen):
            return []  # the same device twice: CUDA shows none
        chosen.append((device, mig_uuid))
    return [d.with_cuda_index(i, visible_mig_uuid=m) for i, (d, m) in enumerate(chosen)]


def visible_devices(sampler: GpuSampler, environ: Mapping[str, str] | None = None) -> list[GpuInfo]:
    """The sampler's GPUs that a CUDA process started with ``environ`` (default ``os.environ``) sees."""
    env = os.environ if environ is None else environ
    if not sampler.available():
        return []
    return resolve_visible_devices(env.get(ENV_VAR), sampler.devices())


ORDER_VAR = "CUDA_DEVICE_ORDER"


def order_is_certain(devices: Sequence[GpuInfo], environ: Mapping[str, str] | None = None) -> bool:
    """Does NVML's order give CUDA's numbering on this machine under ``environ``? True with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, with a single GPU model (FASTEST_FIRST keeps PCI order between equal
    GPUs), or with ``CUDA_VISIBLE_DEVICES`` given as UUIDs (CUDA then numbers them in the order listed)."""
    env = os.environ if environ is None else environ
    if env.get(ORDER_VAR, "FASTEST_FIRST").strip().upper() == "PCI_BUS_ID":
        return True
    parsed = parse_cuda_visible_devices(env.get(ENV_VAR))
    if parsed and all(isinstance(entry, str) for entry in parsed):
        return True
    return len({d.name for d in devices}) <= 1


def cuda_devices(sampler: GpuSampler, environ: Mapping[str, str] | None = None) -> tuple[list[GpuInfo], bool]:
    """The GPUs a CUDA process started with ``environ`` sees, in CUDA order (``index`` = CUDA ordinal,
    ``nvml_index`` = the NVML device), and whether that order is certain (see :func:`order_is_certain`).
    Never raises: NVML trouble gives ``([], True)``."""
    try:
        if not sampler.available():
            return [], True
        devices = sampler.devices()
    except Exception:  # noqa: BLE001 - the protocol says samplers do not raise; be safe anyway
        return [], True
    env = os.environ if environ is None else environ
    return resolve_visible_devices(env.get(ENV_VAR), devices), order_is_certain(devices, env)


def cuda_device(sampler: GpuSampler, cuda_index: int = 0,
                environ: Mapping[str, str] | None = None) -> GpuInfo | None:
    """The NVML device behind ``cuda:<cuda_index>`` (None when there is none)."""
    visible, _certain = cuda_devices(sampler, environ)
    return next((d for d in visible if d.index == cuda_index), None)


def same_uuid(a: str, b: str) -> bool:
    """NVML writes ``GPU-<uuid>`` / ``MIG-<uuid>``; torch's ``device_properties.uuid`` the bare UUID."""
    def bare(u: str) -> str:
        u = u.strip().lower()
        return u.split("-", 1)[1] if u.startswith(("gpu-", "mig-")) else u

    return bool(a and b) and bare(a) == bare(b)


def cuda_available_without_context(
    sampler: GpuSampler | None = None, environ: Mapping[str, str] | None = None
) -> bool:
    """Is there a usable NVIDIA GPU? Answered from NVML alone: no torch import, no CUDA context.

    The same question ``torch.cuda.is_available()`` answers under ``PYTORCH_NVML_BASED_CUDA_CHECK=1``:
    the driver loads and at least one GPU survives ``CUDA_VISIBLE_DEVICES``. It cannot tell whether the
    installed torch was built with CUDA, or whether the driver is new enough for it.
    """
    own = sampler is None
    if sampler is None:
        from vramlab.core.monitor.nvml import NvmlSampler

        sampler = NvmlSampler(process_names=False)
    try:
        return bool(visible_devices(sampler, environ))
    finally:
        if own:
            sampler.close()


@dataclass(frozen=True)
class GpuListing:
    """What ``vramlab gpus`` prints: plain data for ``--json`` and text for people.

    ``available`` is True when at least one GPU is visible to CUDA; otherwise ``reason`` says why.
    ``gpus`` has one plain dict per GPU NVML sees (``cuda_index`` None when CUDA_VISIBLE_DEVICES hides
    it). ``text`` is one line per GPU, or the single line "No NVIDIA GPU found: <reason>".
    """

    available: bool
    reason: str
    cuda_visible_devices: str | None
    gpus: tuple[dict[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    text: str = ""
    visible_count: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready object (lists and plain values only)."""
        return {
            "available": self.available,
            "reason": self.reason or None,
            "cuda_visible_devices": self.cuda_visible_devices,
            "visible_count": self.visible_count,
            "gpus": [dict(g) for g in self.gpus],
            "notes": list(self.notes),
        }


def _gpu_dict(info: GpuInfo, cuda_index: int | None, reading: GpuReading | None) -> dict[str, Any]:
    capability = info.compute_capability
    return {
        "nvml_index": info.nvml_index,
        "cuda_index": cuda_index,
        "name": info.name,
        "uuid": info.uuid,
        "pci_bus_id": info.pci_bus_id,
        "memory_total_bytes": info.memory_total_bytes,
        "memory_used_bytes": reading.memory_used_bytes if reading else None,
        "memory_reserved_bytes": reading.memory_reserved_bytes if reading else None,
        "driver_version": info.driver_version,
        "cuda_driver_version": info.cuda_driver_version,
        "compute_capability": f"{capability[0]}.{capability[1]}" if capability else None,
        "mig_uuids": list(info.mig_uuids),
        "lost": bool(reading and reading.lost),
        "processes": [
            {"pid": p.pid, "used_bytes": p.used_bytes, "name": p.name}
            for p in (reading.processes if reading else ())
        ],
        "missing": sorted(reading.missing) if reading else [],
    }


def _gpu_line(gpu: Mapping[str, Any]) -> str:
    where = f"cuda:{gpu['cuda_index']}" if gpu["cuda_index"] is not None else "hidden"
    parts = [f"{where} (nvml {gpu['nvml_index']}): {gpu['name']}"]
    if gpu["lost"]:
        parts.append("GPU is lost")
    elif gpu["memory_total_bytes"] is not None:
        memory = f"{fmt_bytes(gpu['memory_total_bytes'])} total"
        if gpu["memory_used_bytes"] is not None:
            memory += f", {fmt_bytes(gpu['memory_used_bytes'])} used"
        parts.append(memory)
    if gpu["compute_capability"]:
        parts.append(f"compute {gpu['compute_capability']}")
    if gpu["driver_version"]:
        cuda = f" (CUDA {gpu['cuda_driver_version']})" if gpu["cuda_driver_version"] else ""
        parts.append(f"driver {gpu['driver_version']}{cuda}")
    parts.append(gpu["uuid"])
    return ", ".join(parts)


def describe_gpus(sampler: GpuSampler | None = None, environ: Mapping[str, str] | None = None) -> GpuListing:
    """Detect GPUs via NVML (one sample for current memory use). Never raises, never imports torch.

    A sampler passed in stays open; one created here is closed before returning.
    """
    env = os.environ if environ is None else environ
    cvd = env.get(ENV_VAR)
    own = sampler is None
    if sampler is None:
        from vramlab.core.monitor.nvml import NvmlSampler

        sampler = NvmlSampler()
    try:
        if not sampler.available():
            reason = sampler.reason() or "unknown reason"
            return GpuListing(False, reason, cvd, text=f"No NVIDIA GPU found: {reason}")
        devices = sampler.devices()
        visible = resolve_visible_devices(cvd, devices)
        cuda_index = {d.nvml_index: d.index for d in visible}
        sample = sampler.sample()
        gpus = tuple(_gpu_dict(d, cuda_index.get(d.nvml_index), sample.get(d.nvml_index)) for d in devices)
    finally:
        if own:
            sampler.close()

    notes = []
    parsed = parse_cuda_visible_devices(cvd)
    by_ordinal = parsed is None or all(isinstance(entry, int) for entry in parsed)
    if by_ordinal and not order_is_certain(devices, env):
        notes.append(
            "CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; the cuda indices "
            "shown follow PCI bus order"
        )
    if not visible:
        reason = f"{ENV_VAR}={cvd!r} hides all {len(devices)} GPU(s)"
        return GpuListing(False, reason, cvd, gpus, tuple(notes), f"No NVIDIA GPU found: {reason}", 0)
    lines = [_gpu_line(g) for g in gpus] + [f"note: {n}" for n in notes]
    return GpuListing(True, "", cvd, gpus, tuple(notes), "\n".join(lines), len(visible))
