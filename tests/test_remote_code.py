"""Configs only remote code can build: refused from the config alone, counted exactly from the headers.

Qwen-7B's first release (``model_type: "qwen"``, an ``auto_map`` to ``modeling_qwen.py``,
``intermediate_size: 22016`` which its code halves) was read as a Llama-style decoder and counted as
12.05B parameters instead of 7.72B, without a word. The safetensors files written here are sparse: a
real header and a hole the size of the data, so the real 7B shapes cost no disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.hub_server import safetensors_head
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.sources import remote_code
from vramlab.core.sources.folder import load_model_source
from vramlab.core.sources.hf_config import hf_config_to_spec
from vramlab.core.sources.remote_code import RemoteCodeError, remote_code_reason
from vramlab.core.spec.training import TrainingSetup

QWEN_7B: dict[str, Any] = {
    "architectures": ["QWenLMHeadModel"],
    "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                 "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
    "attn_dropout_prob": 0.0, "bf16": False, "emb_dropout_prob": 0.0, "fp16": False, "fp32": False,
    "hidden_size": 4096, "intermediate_size": 22016, "initializer_range": 0.02, "kv_channels": 128,
    "layer_norm_epsilon": 1e-06, "max_position_embeddings": 8192, "model_type": "qwen", "no_bias": True,
    "num_attention_heads": 32, "num_hidden_layers": 32, "onnx_safe": None, "rotary_emb_base": 10000,
    "rotary_pct": 1.0, "scale_attn_weights": True, "seq_length": 8192, "tie_word_embeddings": False,
    "tokenizer_class": "QWenTokenizer", "transformers_version": "4.32.0", "use_cache": True,
    "use_dynamic_ntk": True, "use_flash_attn": "auto", "use_logn_attn": True, "vocab_size": 151936,
}
QWEN_7B_PARAMS = 7_721_324_544  # the sum of the published checkpoint's tensor shapes


def qwen_tensors(cfg: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensor names and shapes of Qwen-7B's modeling_qwen.py (fused c_attn with bias, halved MLP)."""
    h, ff, v = cfg["hidden_size"], cfg["intermediate_size"] // 2, cfg["vocab_size"]
    out: dict[str, tuple[str, tuple[int, ...]]] = {"transformer.wte.weight": ("BF16", (v, h))}
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        out |= {p + "ln_1.weight": ("BF16", (h,)), p + "attn.c_attn.weight": ("BF16", (3 * h, h)),
                p + "attn.c_attn.bias": ("BF16", (3 * h,)), p + "attn.c_proj.weight": ("BF16", (h, h)),
                p + "ln_2.weight": ("BF16", (h,)), p + "mlp.w1.weight": ("BF16", (ff, h)),
                p + "mlp.w2.weight": ("BF16", (ff, h)), p + "mlp.c_proj.weight": ("BF16", (h, ff))}
    out |= {"transformer.ln_f.weight": ("BF16", (h,)), "lm_head.weight": ("BF16", (v, h))}
    return out


def write_sparse_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """The header and a file of the declared size, its data never written (a sparse file)."""
    head, size = safetensors_head(tensors)
    with path.open("wb") as f:
        f.write(head)
        f.truncate(size)


def qwen_folder(tmp_path: Path, cfg: dict[str, Any] = QWEN_7B, extra: dict | None = None) -> Path:
    folder = tmp_path / "Qwen-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    write_sparse_safetensors(folder / "model.safetensors", qwen_tensors(cfg) | (extra or {}))
    return folder


def test_a_remote_code_config_alone_is_refused_not_miscounted() -> None:
    with pytest.raises(RemoteCodeError) as e:
        hf_config_to_spec(QWEN_7B, id="qwen-7b", name="Qwen-7B", source="/q/config.json")
    msg = str(e.value)
    assert msg.startswith("/q/config.json: model_type 'qwen'")
    assert "remote code" in msg and "modeling_qwen.QWenLMHeadModel" in msg and "safetensors" in msg


def test_a_remote_code_folder_is_counted_exactly_from_its_headers(tmp_path: Path) -> None:
    m = load_model_source(qwen_folder(tmp_path))
    assert m.spec.param_count == QWEN_7B_PARAMS == m.spec.published_params == m.tensor_params
    note = next(w for w in m.warnings if "counted exactly from the safetensors headers" in w)
    assert "remote code" in note and "Llama-style" in note and "q/k/v bias" in note
    assert "intermediate_size 11008 (config.json says 22016)" in note
    result = estimate(m.spec, TrainingSetup(method="lora"))
    assert result.total_params == QWEN_7B_PARAMS


def test_headers_no_llama_reading_reproduces_are_refused(tmp_path: Path) -> None:
    folder = qwen_folder(tmp_path, extra={"transformer.odd.weight": ("BF16", (7,))})
    with pytest.raises(RemoteCodeError, match=f"hold {QWEN_7B_PARAMS + 7:,} parameters, which no Llama-style"):
        load_model_source(folder)


def test_a_remote_code_folder_without_safetensors_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "Qwen-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN_7B))
    with pytest.raises(RemoteCodeError, match="no safetensors to count"):
        load_model_source(folder)


def test_the_cli_refuses_it_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vramlab.core.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN_7B))
    assert main(["estimate", "-m", str(path), "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "remote code" in err


def test_types_transformers_ships_are_read_whatever_auto_map_says() -> None:
    pytest.importorskip("transformers")
    known = remote_code.transformers_model_types()
    assert known is not None
    _, types = known
    assert {"llama", "qwen2", "phi3", "gpt_neox", "falcon", "bloom"} <= types and "qwen" not in types
    cfg = {"model_type": "phi3", "auto_map": {"AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}}
    assert remote_code_reason(cfg, "phi3") is None


def test_without_transformers_an_auto_map_is_the_evidence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_code, "transformers_model_types", lambda: None)
    assert "remote code" in (remote_code_reason(QWEN_7B, "qwen") or "")
    plain = {k: v for k, v in QWEN_7B.items() if k != "auto_map"}
    assert remote_code_reason(plain, "qwen") is None  # read generically, with its warning
    with pytest.raises(SetupError):
        hf_config_to_spec(QWEN_7B, id="q", name="Q")


def test_an_auto_map_without_a_model_type_is_remote_code() -> None:
    cfg = {k: v for k, v in QWEN_7B.items() if k not in ("model_type", "architectures")}
    with pytest.raises(RemoteCodeError, match="a config without a model_type comes with remote code"):
        hf_config_to_spec(cfg, id="q", name="Q")


def test_the_refusal_names_the_family_transformers_ships_that_the_config_points_at() -> None:
    """MiniCPM-V's remote code stays unrun, but the refusal says what to do: the MiniCPM-V class transformers
    ships; a look-alike name of another family (MiMo: Mimi, an audio codec) is never offered."""
    pytest.importorskip("transformers")
    _, types = remote_code.transformers_model_types() or ("", frozenset())
    minicpmv = {"model_type": "minicpmv", "architectures": ["MiniCPMV"],
                "auto_map": {"AutoModel": "modeling_minicpmv.MiniCPMV"}}
    reason = remote_code_reason(minicpmv, "minicpmv") or ""
    shipped = sorted(t for t in types if t.startswith("minicpmv"))
    assert shipped and "closest architecture transformers ships" in reason
    assert any(repr(t) in reason for t in shipped)
    mimo = {"model_type": "mimo", "architectures": ["MiMoForCausalLM"],
            "auto_map": {"AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"}}
    assert "closest" not in (remote_code_reason(mimo, "mimo") or "x")
    wrapped = {"model_type": "odd_vlm", "auto_map": {"AutoModel": "m.M"}, "text_config": {"model_type": "qwen2"}}
    assert "'qwen2'" in (remote_code_reason(wrapped, "odd_vlm") or "")


def test_a_remote_code_vlm_folder_is_refused_with_its_header_count_and_the_shipped_family(tmp_path: Path) -> None:
    """A MiniCPM-V-like folder: its vision tensors leave no Llama-style reading of the headers, so it is refused,
    but the one line gives the exact count from the safetensors headers and the family transformers ships."""
    pytest.importorskip("transformers")
    cfg = {**QWEN_7B, "model_type": "minicpmv", "architectures": ["MiniCPMV"],
           "auto_map": {"AutoModel": "modeling_minicpmv.MiniCPMV"}}
    vision = {"vpm.encoder.layers.0.mlp.fc1.weight": ("BF16", (4304, 1152))}
    folder = qwen_folder(tmp_path, cfg, extra=vision)
    with pytest.raises(RemoteCodeError) as e:
        load_model_source(folder)
    msg = str(e.value)
    assert f"hold {QWEN_7B_PARAMS + 4304 * 1152:,} parameters" in msg
    assert "closest architecture transformers ships is 'minicpmv4" in msg and "\n" not in msg
