"""Record what liger-kernel's own patch swaps in, per model type, into ``resources/liger_patches.json``.

For every type of liger's ``MODEL_TYPE_TO_APPLY_LIGER_FN`` that transformers ships, transformers' class of that type
(the one VRAM Lab builds: ``core/tracing/hfconfig.py`` ``task_of``, or the vision-language class for a multimodal
type) is built from its config class's defaults on the meta device, and liger's own
``apply_liger_kernel_to_<type>(model=...)`` (as HF Trainer's ``_apply_liger_kernel_to_instance`` calls it) runs on
it with every kernel switch it takes on, its RoPE and losses off; each module whose ``forward`` it rebound is
recorded by its path (layer numbers as ``*``), its class and the Liger module it now is (``_get_name``), with the
RMSNorm's offset, casting mode and ``in_place``. A second call with ``cross_entropy=True`` records whether its
cross-entropy goes in transformers' loss's place (``torch.nn.functional.cross_entropy``), and a call with only
``rope=True`` which of transformers' module-level RoPE functions it replaces, by which of liger's (``rope_binds``),
or liger's own error (``rope_error``). The liger library runs
on the CPU over a no-op triton (tests/support/liger_library.py); nothing of it is needed at run time.

    .venv/bin/python tools/liger_map.py            # rewrite resources/liger_patches.json
    .venv/bin/python tools/liger_map.py --check    # exit 1 where the file differs from the installed liger
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "resources" / "liger_patches.json"
SWITCHES_OFF = ("rope", "cross_entropy", "fused_linear_cross_entropy")


def _build(model_type: str) -> Any:
    """transformers' class VRAM Lab builds for ``model_type``, from its config class's defaults, on meta."""
    import torch
    from transformers.models.auto import modeling_auto as ma
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from vramlab.core.checks import SetupError
    from vramlab.core.tracing.hfconfig import task_of

    cfg = CONFIG_MAPPING[model_type]()
    # a few config classes leave these None by default (their checkpoints set them) and their classes then fail
    for key, fill in (("num_key_value_heads", "num_attention_heads"), ("head_dim", None)):
        try:
            unset = getattr(cfg, key, 0) is None
        except Exception:  # noqa: BLE001 - a per-layer attribute (Gemma 4) is not read globally
            unset = False
        if unset:
            setattr(cfg, key, getattr(cfg, fill) if fill else cfg.hidden_size // cfg.num_attention_heads)
    cls = ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(cfg)] if type(cfg) in ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING \
        else None
    if cls is None and type(cfg) in ma.MODEL_FOR_CAUSAL_LM_MAPPING or getattr(cfg, "is_encoder_decoder", False):
        task = task_of(cfg)
        cls, cfg = task.model_class, task.config
    elif cls is None:  # a tower or a language model liger patches inside a composite model (Pixtral's in LLaVA)
        if type(cfg) not in ma.MODEL_MAPPING:
            raise SetupError(f"transformers ships no model class of {model_type} alone")
        cls = ma.MODEL_MAPPING[type(cfg)]
    with torch.device("meta"):
        return cls._from_config(cfg)


def _snapshot() -> dict[str, dict[str, Any]]:
    """The namespaces liger's class-level swaps write into (restored after each call)."""
    return {n: dict(vars(m)) for n, m in list(sys.modules.items())
            if m is not None and (n.startswith("transformers.models.") or n in (
                "torch.nn", "torch.nn.functional", "transformers.loss.loss_utils"))}


def _restore(saved: dict[str, dict[str, Any]]) -> None:
    for n, d in saved.items():
        mod = sys.modules[n]
        for k in [k for k in vars(mod) if k not in d]:
            delattr(mod, k)
        vars(mod).update(d)


def _kernel(module: Any) -> dict[str, Any] | None:
    """What liger made of ``module``: None where it left its ``forward`` as the class's."""
    if "forward" not in vars(module) or "_get_name" not in vars(module):
        return None
    forward = getattr(vars(module)["forward"], "__func__", vars(module)["forward"])
    row: dict[str, Any] = {"liger": module._get_name(), "class": type(module).__name__,
                           "forward": getattr(forward, "__qualname__", "")}
    if row["liger"].startswith("LigerRMSNorm"):
        row.update(offset=float(module.offset), casting_mode=str(module.casting_mode),
                   in_place=bool(module.in_place))
    return row


def _rope(model_type: str, fn: Any, switches: dict[str, bool]) -> dict[str, Any]:
    """What ``fn`` with ``rope=True`` (and nothing else) binds in transformers' modeling modules: each module-level
    function it replaced (``modeling_llama.apply_rotary_pos_emb``) and liger's function now there; or why it fails
    (liger raises for the types its RoPE does not fit)."""
    before = {n: dict(vars(m)) for n, m in sys.modules.items()
              if m is not None and n.startswith("transformers.models.")}
    try:
        fn(model=_build(model_type), **switches)
    except Exception as e:  # noqa: BLE001 - liger's own refusal (NotImplementedError for Glm4, Qwen 3.5)
        return {"rope_error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}
    binds = {f"{n.rsplit('.', 1)[-1]}.{k}": getattr(v, "__name__", type(v).__name__)
             for n, d in before.items() for k, v in vars(sys.modules[n]).items()
             if d.get(k) is not v and callable(v) and str(getattr(v, "__module__", "")).startswith("liger_kernel")}
    return {"rope_binds": dict(sorted(binds.items()))}


def record(model_type: str, fn: Any) -> dict[str, Any]:
    """What ``fn`` (liger's apply function of ``model_type``) swaps in on transformers' class of that type."""
    import torch

    from vramlab.core.checks import SetupError

    params = inspect.signature(fn).parameters
    switches = {k: p.default for k, p in params.items() if isinstance(p.default, bool)}
    on = {k: k not in SWITCHES_OFF for k in switches}
    out: dict[str, Any] = {"switches": switches}
    saved = _snapshot()
    try:
        model = _build(model_type)
        fn(model=model, **on)
        rows: dict[tuple, dict[str, Any]] = {}
        prefix = f"{model.base_model_prefix}." if isinstance(getattr(model, model.base_model_prefix, None),
                                                               torch.nn.Module) else ""
        for name, module in model.named_modules():
            row = _kernel(module)
            if row is not None:
                path = re.sub(r"\.\d+(?=\.|$)", ".*", name)
                # the path under the base model: where a composite model's patch finds this type as its part
                row = {"path": path, "base_path": path[len(prefix):] if path.startswith(prefix) else path, **row}
                rows[tuple(sorted(row.items()))] = row
        out["model_class"] = type(model).__name__
        out["modules"] = sorted(rows.values(), key=lambda r: r["path"])
        _restore(saved)
        if "rope" in switches:
            out.update(_rope(model_type, fn, {**dict.fromkeys(switches, False), "rope": True}))
            _restore(saved)
        if "cross_entropy" in switches:
            plain = torch.nn.functional.cross_entropy
            fn(model=_build(model_type), **{**on, "cross_entropy": True})
            out["cross_entropy"] = ("transformers_loss" if torch.nn.functional.cross_entropy is not plain
                                    else "not_in_transformers_loss")
    except SetupError as e:  # a type VRAM Lab builds no class of (a multimodal model's text part alone)
        out = {"switches": switches, "error": None, "unbuilt": str(e)}
    except Exception as e:  # noqa: BLE001 - a type liger cannot patch on this transformers is recorded with why
        line = re.sub(r" \(/[^)]*\)?", "", str(e).splitlines()[0] if str(e) else "")  # no path of this machine
        out["error"] = f"{type(e).__name__}: {line}"[:200]
    finally:
        _restore(saved)
    return out


def _import_modeling(mapping: Any) -> None:
    """transformers' modeling module of every type liger's table names, imported before the triton stub (liger
    imports their output classes, which a stubbed triton would make fail)."""
    import importlib
    from importlib import util

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    spec = util.find_spec("liger_kernel")
    source = Path(spec.origin).parent / "transformers" / "monkey_patch.py"  # type: ignore[union-attr, arg-type]
    for t in re.findall(r'"(\w+)": apply_liger_kernel_to_', source.read_text(encoding="utf-8")):
        if t in mapping:
            name = model_type_to_module_name(t)
            try:
                importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            except ImportError:
                continue


def build_map() -> dict[str, Any]:
    """Every type of liger's table recorded (liger imported over a no-op triton)."""
    import pytest
    import transformers
    from transformers import PreTrainedModel  # noqa: F401 - imported before the triton stub, as the tests do
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    sys.path.insert(0, str(ROOT))
    from tests.support import liger_library

    _import_modeling(CONFIG_MAPPING)

    with pytest.MonkeyPatch.context() as mp:
        gen = liger_library.imported(mp)
        next(gen)
        from liger_kernel.transformers import monkey_patch

        types = {t: record(t, fn) for t, fn in sorted(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.items())
                 if t in CONFIG_MAPPING}
        next(gen, None)
    return {"liger-kernel": liger_library.VERSION, "transformers": transformers.__version__, "types": types}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = parser.parse_args()
    text = json.dumps(build_map(), indent=1, sort_keys=True) + "\n"
    if args.check:
        same = OUT.read_text(encoding="utf-8") == text
        print("liger_patches.json matches the installed liger-kernel" if same else "liger_patches.json differs")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
