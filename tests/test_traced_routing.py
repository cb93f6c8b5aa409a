"""What reaches transformers' own classes on the traced and simulated paths, and what comes back from them:
the file the user named, every value of a config as valid JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramlab.core.cli import main

pytest.importorskip("transformers")

SMALL = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)


def _json_of(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_hf_reads_the_config_file_named_not_its_folders(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``--model path/to/mine.json`` is that file: simulate --hf read the folder's config.json (another model
    beside it) and counted that one."""
    (tmp_path / "mine.json").write_text(json.dumps(SMALL))
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "hidden_size": 128, "num_hidden_layers": 3}))
    named = str(tmp_path / "mine.json")
    est = _json_of(capsys, "estimate", "--model", named, "--seq", "64", "--json")
    sim = _json_of(capsys, "simulate", "--hf", "--model", named, "--seq", "64", "--json")
    assert sim["total_params"] == est["total_params"]
    folder = _json_of(capsys, "simulate", "--hf", "--model", str(tmp_path), "--seq", "64", "--json")
    assert folder["total_params"] > est["total_params"]


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _granite4(tmp_path: Path) -> Path:
    """A small Granite 4 (granitemoehybrid) config as transformers 5 saves it: its default time_step_limit
    (0.0, inf) tagged as {"__float__": "Infinity"}."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("granitemoehybrid", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256, mamba_n_heads=4,
                               mamba_d_state=16, shared_intermediate_size=128, num_local_experts=0,
                               layer_types=["mamba", "attention"])
    assert cfg.time_step_limit[1] == float("inf")
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string(use_diff=False))
    return path


def test_a_non_finite_config_value_keeps_every_json_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Granite 4's default time_step_limit holds inf: its canonical form was refused (or, written as Python
    writes it, broke --json). It is tagged as transformers tags it, and read back as the float."""
    from vramlab.core.sources.files import load_config_json
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.tracing.capture import hf_config_at

    path = _granite4(tmp_path)
    for data in (load_config_json(path), {**load_config_json(path), "time_step_limit": [0.0, float("inf")]}):
        spec, _ = hf_config_to_spec(data, id="g", name="granite", source=str(path))
        _strict_json(spec.transformers_config)
        assert tuple(hf_config_at(spec.transformers_config, 2).time_step_limit) == (0.0, float("inf"))
    assert main(["estimate", "--model", str(path), "--seq", "64", "--json"]) == 0
    out = _strict_json(capsys.readouterr().out)
    assert isinstance(out, dict) and out["peak_allocated_bytes"] > 0


def test_lfm2_moe_adapts_its_q_proj_though_its_first_layers_have_none() -> None:
    """LFM2-MoE starts with convolution layers; its attention (q_proj ...) comes later. The trace cut it to its
    first two or three layers, found no q_proj there and refused the target; a model cut short of a target now
    runs whole, and LoRA on q_proj, v_proj trains the adapters of every attention layer."""
    from transformers import AutoConfig

    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.tracing.capture import hf_config_at

    types = ["conv", "conv", "full_attention", "conv", "conv", "full_attention"]
    cfg = AutoConfig.for_model("lfm2_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                               num_experts=4, num_experts_per_tok=2, num_dense_layers=2, layer_types=types)
    spec, _ = hf_config_to_spec(json.loads(cfg.to_json_string(use_diff=False)), id="lfm", name="lfm2-moe")
    setup = TrainingSetup(micro_batch=2, seq_len=64, method="lora", lora_targets=("q_proj", "v_proj"), lora_rank=8)
    est = estimate(spec, setup, match_simulation=True)
    q, v = 8 * (64 + 64), 8 * (64 + 2 * 16)  # rank x (in + out): q is 64 wide, v two heads of 16
    assert est.trainable_params == 2 * (q + v)
    ref = simulate(spec, setup, hf=True, hf_config=hf_config_at(spec.transformers_config, spec.num_layers))
    assert est.peak_allocated_bytes == ref.peak_allocated_bytes


FALCON = dict(model_type="falcon", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=256,
              new_decoder_architecture=True, num_kv_heads=2)


def test_the_lora_note_names_what_peft_wrapped_and_counts_what_trains() -> None:
    """Falcon fuses q, k, v into query_key_value and names its MLP dense_h_to_4h / dense_4h_to_h: the note listed
    the roles a Llama reading of the config has (o_proj, up_proj, down_proj) and counted their adapters, not
    what trains (27.9M of 32.6M on Falcon-7B). It names peft's modules and counts the step's trainable ones."""
    from vramlab.core.estimate import estimate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    spec, _ = hf_config_to_spec(FALCON, id="falcon", name="falcon")
    setup = TrainingSetup(micro_batch=1, seq_len=64, method="lora", lora_targets=("all-linear",), lora_rank=4)
    est = estimate(spec, setup)
    note = next(n for n in est.notes if n.startswith("LoRA r="))
    assert note.startswith("LoRA r=4 on query_key_value, dense, dense_h_to_4h, dense_4h_to_h:")
    h, qkv = 64, 64 + 2 * 2 * 16  # 4 query heads and 2 key/value heads of 16
    per_layer = 4 * ((h + qkv) + (h + h) + (h + 4 * h) + (4 * h + h))
    assert est.trainable_params == 3 * per_layer


def test_lora_takes_any_module_name_the_model_has() -> None:
    """DeepSeek-V2's latent attention is kv_a_proj_with_mqa and kv_b_proj: the names were checked against a
    fixed list and refused before the model was built. peft adapts any linear module by its name; so does the
    trace, matched against the model transformers builds. A hand-written family still refuses a name it lacks."""
    from transformers import AutoConfig

    from vramlab.core.catalog import find_model
    from vramlab.core.checks import SetupError
    from vramlab.core.estimate import estimate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    cfg = AutoConfig.for_model("deepseek_v2", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                               n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=3, kv_lora_rank=16,
                               q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                               n_shared_experts=1, n_group=1, topk_group=1)
    spec, _ = hf_config_to_spec(json.loads(cfg.to_json_string(use_diff=False)), id="dsv2", name="deepseek-v2")
    targets = ("kv_a_proj_with_mqa", "kv_b_proj")
    setup = TrainingSetup(micro_batch=1, seq_len=64, method="lora", lora_targets=targets, lora_rank=8)
    est = estimate(spec, setup)
    kv_a = 8 * (64 + 16 + 8)  # hidden -> kv_lora_rank + the rope dims
    kv_b = 8 * (16 + 4 * (8 + 16))  # kv_lora_rank -> heads x (nope + value dims)
    assert est.trainable_params == 3 * (kv_a + kv_b)
    assert any(n.startswith("LoRA r=8 on kv_a_proj_with_mqa, kv_b_proj:") for n in est.notes)
    with pytest.raises(SetupError, match="has no kv_b_proj module"):
        TrainingSetup(method="lora", lora_targets=("q_proj", "kv_b_proj")).validate(find_model("llama-3.2-1b"))
    with pytest.raises(SetupError, match="not a module name"):
        TrainingSetup(method="lora", lora_targets=("q_proj; v_proj",))


@pytest.mark.slow
def test_lora_dropout_peft_cannot_apply_is_left_out_and_said() -> None:
    """Trinity (afmoe): peft adapts its router and experts with ParamWrapper, which refuses lora_dropout, so the
    trace failed. The step runs without dropout on those parameters (the other adapters keep it) and says so;
    simulate --hf runs the same build."""
    from transformers import AutoConfig

    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.tracing.capture import hf_config_at

    cfg = AutoConfig.for_model("afmoe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=3, num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, vocab_size=256, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                               global_attn_every_n_layers=1, layer_types=["full_attention"] * 3)
    spec, _ = hf_config_to_spec(json.loads(cfg.to_json_string(use_diff=False)), id="afmoe", name="trinity")
    setup = TrainingSetup(micro_batch=2, seq_len=64, method="lora", lora_targets=("all-linear",), lora_dropout=0.05)
    est = estimate(spec, setup, match_simulation=True)
    assert "without LoRA dropout on gate.weight, experts.down_proj, experts.gate_up_proj" in est.notes[0]
    ref = simulate(spec, setup, hf=True, hf_config=hf_config_at(spec.transformers_config, spec.num_layers))
    assert est.peak_allocated_bytes == ref.peak_allocated_bytes
    assert any("without LoRA dropout" in w for w in ref.warnings)
    # the attention's adapters keep their dropout: more memory than no dropout at all
    none = estimate(spec, setup.replace(lora_dropout=0.0), match_simulation=True)
    assert est.peak_allocated_bytes > none.peak_allocated_bytes


@pytest.mark.parametrize("model_type", ["falcon", "gpt2", "llama"])
def test_quantized_storage_converts_what_transformers_quantizer_converts(model_type: str) -> None:
    """The emulated NF4 load converts the modules transformers' own bitsandbytes quantizer converts
    (``replace_with_bnb_linear``, run here on the meta device: bitsandbytes builds its layers without a GPU):
    nn.Linear itself and GPT-2's Conv1D. Falcon's FalconLinear is a subclass, left in 16-bit by transformers
    too: a Falcon QLoRA stores its projections as LoRA does, and the estimate says so."""
    pytest.importorskip("bitsandbytes")
    import torch
    from transformers import AutoConfig, BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.tracing import hfconfig, hfquant

    sizes = {"falcon": FALCON, "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256),
             "llama": {**SMALL}}[model_type]
    config = AutoConfig.for_model(**sizes)
    task = hfconfig.task_of(config)
    with torch.device("meta"):
        theirs = task.model_class._from_config(config, dtype=torch.bfloat16)
    theirs = replace_with_bnb_linear(theirs, modules_to_not_convert=get_keys_to_not_convert(theirs),
                                     quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    converted = {n for n, m in theirs.named_modules() if type(m).__module__.startswith("bitsandbytes")}
    setup = TrainingSetup(method="qlora", seq_len=64)
    with torch.device("meta"):
        ours = hfquant.load_quantized(task, config, setup, "meta")
    assert converted == {n for n, m in ours.named_modules() if isinstance(m, hfquant.EmulatedQuantLinear)}
    assert bool(converted) == (model_type != "falcon")
    note = hfquant.not_quantized_note(ours, setup)
    assert bool(note) == (model_type == "falcon")
    if note:
        assert "FalconLinear (query_key_value, dense, dense_h_to_4h, dense_4h_to_h)" in note[0]


def test_a_falcon_qlora_estimate_says_its_projections_stay_16_bit() -> None:
    from vramlab.core.estimate import estimate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    spec, _ = hf_config_to_spec(FALCON, id="falcon", name="falcon")
    est = estimate(spec, TrainingSetup(micro_batch=1, seq_len=64, method="qlora", lora_targets=("all-linear",)))
    assert "16-bit, not nf4: FalconLinear" in est.notes[0]


def test_a_traced_gemma3_text_model_is_gemma3_with_all_its_layer_kinds() -> None:
    """``--source traced`` on Gemma 3's text model traced a Qwen 3 (the spec's q/k norms read as Qwen 3's), cut to
    its first three layers (all sliding-window ones): the full-attention layer every six, its tables and the
    Gemma layers were left out (0.99 % low for Gemma 3 4B at 1 x 1024). It traces Gemma 3, and a stack whose
    layers are not alike from the third on is simulated whole instead of fitted."""
    import dataclasses

    from transformers import AutoConfig

    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.options import Attention
    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.tracing import hfconfig

    cfg = AutoConfig.for_model("gemma3_text", hidden_size=256, num_hidden_layers=7, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000,
                               query_pre_attn_scalar=64, sliding_window=64)
    spec, _ = hf_config_to_spec(json.loads(cfg.to_json_string(use_diff=False)), id="g3", name="gemma3")
    assert type(hfconfig.hf_config(spec, Attention.SDPA)).__name__ == "Gemma3TextConfig"
    setup = TrainingSetup(micro_batch=1, seq_len=128, optimizer_impl="fused")
    est = estimate(dataclasses.replace(spec, tape="traced"), setup, match_simulation=True)
    assert "not all alike from the third on (sliding_attention, full_attention)" in est.notes[0]
    ref = simulate(spec, setup, hf=True, hf_config=cfg)
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= 8 * 1024


def test_a_chunked_kernel_keeps_the_fit_within_one_chunk() -> None:
    """transformers' torch paths of the gated delta rule (Qwen3.5, Qwen3-Next) and of Mamba-2's scan (Granite 4,
    Falcon-H1, Nemotron-H) pad the sequence to a multiple of their chunk: the chunk is read from transformers' own
    source and config classes, and a traced fit stays inside the chunk holding the sequence."""
    import dataclasses

    from tests.support.traced_vlm import generic_configs
    from vramlab.core import traced
    from vramlab.core.sources.hf_config import spec_from_hf_config
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.tracing.hfconfig import chunk_periods

    qwen = generic_configs()["qwen3_5"]
    assert chunk_periods(qwen) == (64,)  # torch_chunk_gated_delta_rule's chunk_size default
    hybrid = {"model_type": "granitemoehybrid", "mamba_chunk_size": 128}
    assert chunk_periods(hybrid) == (128,)
    assert chunk_periods({"model_type": "granitemoehybrid"}) == (256,)  # the config class's default
    assert chunk_periods({"model_type": "llama"}) == ()
    spec = spec_from_hf_config(dict(qwen["text_config"], model_type="qwen3_5_text"), id="q", name="q")
    assert traced.piece(spec, 208) == (193, 257)
    assert traced.piece(spec, 64) == (1, 65)
    plain = dataclasses.replace(ModelSpec(id="m", name="m", num_layers=2, hidden_size=64, num_heads=4,
                                          num_kv_heads=2, intermediate_size=128, vocab_size=512), tape="traced")
    assert traced.piece(plain, 208)[1] - traced.piece(plain, 208)[0] > 4096


def test_a_fit_in_the_length_keeps_to_its_parity_where_the_completion_is_half_the_sequence(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DPO's completion is half the sequence rounded down by default, and TRL's fused LM head holds a 32,768-wide
    tile row per completion token: a fit over lengths of both parities (17, 33, 53 in Qwen3.5's first chunk) read
    seq // 2 as (seq - 1) / 2 and missed one tile row per row pair at an even length (64 KiB x micro batch here,
    whatever the vocabulary). The fit keeps to the length's parity, and the traced estimate equals transformers'
    class (within the 1 KiB a first simulation in a process adds at load)."""
    import dataclasses

    from tests.support.traced_vlm import generic_configs
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    cfg = dict(generic_configs()["qwen3_5"]["text_config"], model_type="qwen3_5_text")
    spec, _ = hf_config_to_spec(cfg, id="q", name="q")
    setup = TrainingSetup(method="lora", objective="dpo", micro_batch=2, seq_len=64, lora_rank=8, hub_kernels=False)
    est = estimate(spec, setup, match_simulation=True)
    assert est.source.startswith("traced")
    assert abs(est.peak_allocated_bytes - simulate(spec, setup, hf=True).peak_allocated_bytes) <= 1024
    fit, check = traced.fit_lengths(*traced.piece(spec, 45), traced.length_stride(setup), 45)
    assert all(x % 2 for x in (*fit, check))  # an odd length's fit: odd lengths only
    given = dataclasses.replace(setup, completion_len=20)  # a completion given: a constant, every length fits
    assert traced.length_stride(given) == 1 and traced.length_stride(setup.replace(objective="sft")) == 1


def test_dpo_past_the_fused_heads_tile_is_not_extrapolated_from_a_fit(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's fused LM head holds a tile of min(tokens, 4096) x 32,768: a fit at short lengths grew it with the
    tokens past 4096 (256 MiB too much at batch 2, sequence 4096 here: 8192 completion tokens a call, whatever the
    model). There the sizes asked are traced (the layers alone fitted), and the estimate equals transformers' class."""
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec = ModelSpec(id="m", name="m", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                     intermediate_size=128, vocab_size=512, tape="traced")
    setup = TrainingSetup(method="lora", objective="dpo", micro_batch=2, seq_len=4096, lora_rank=8)
    est = estimate(spec, setup, match_simulation=True)
    assert abs(est.peak_allocated_bytes - simulate(spec, setup, hf=True).peak_allocated_bytes) <= 1024
    assert any("fused LM head scores 8,192 tokens" in n for n in est.notes)


@pytest.mark.slow  # a speed fix (the fitted tape is used); the answer was exact before
def test_kto_is_fitted_for_the_batch_asked_as_it_halves_the_batch(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """KTOTrainer splits the micro batch into b // 2 desirable rows and the rest, which no polynomial in the batch
    follows: the fit over batches 2, 3 failed its verification at 5, then the one-length fit too, and every KTO
    estimate of a traced model was a full-depth simulation (about three traces). The step is fitted in sequence and
    rank for the batch asked, and still equals transformers' class."""
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec = ModelSpec(id="m", name="m", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                     intermediate_size=128, vocab_size=512, tape="traced")
    setup = TrainingSetup(method="lora", objective="kto", micro_batch=3, seq_len=64, lora_rank=8)
    est = estimate(spec, setup, match_simulation=True)
    assert est.source.startswith("traced") and any("for batch 3 only" in n for n in est.notes)
    assert abs(est.peak_allocated_bytes - simulate(spec, setup, hf=True).peak_allocated_bytes) <= 1024


def test_kbit_prepare_runs_on_transformers_classes() -> None:
    """peft's prepare_model_for_kbit_training runs on transformers' own classes (its fp32 upcast of what stays
    unquantized), so a traced architecture answers --kbit-prepare (it was refused before a trace) and the HF step
    agrees with the builder within HF's small buffers."""
    from tests.support.three_ways import held_three_ways
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

    spec = ModelSpec(id="llama", name="Llama-ish", num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2,
                     intermediate_size=256, vocab_size=512)
    setup = TrainingSetup(method="qlora", kbit_upcast=True, lora_targets="all-linear", seq_len=64)
    est, plain = held_three_ways(spec, setup, setup.replace(kbit_upcast=False))
    assert est.peak_allocated_bytes > plain.peak_allocated_bytes  # fp32 embeddings, norms and head


@pytest.mark.slow
def test_a_traced_architecture_answers_kbit_prepare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL))
    args = ("--model", str(cfg), "--method", "qlora", "--seq", "64", "--batch", "1", "--json")
    prepared = _json_of(capsys, "estimate", "--source", "traced", "--kbit-prepare", *args)
    plain = _json_of(capsys, "estimate", "--source", "traced", *args)
    assert prepared["peak_allocated_bytes"] > plain["peak_allocated_bytes"]
    assert prepared["peak_allocated_bytes"] == _json_of(capsys, "simulate", "--hf", "--kbit-prepare",
                                                        *args)["peak_allocated_bytes"]


def test_simulate_hf_of_a_traced_spec_builds_the_users_config_not_a_llama_like_one() -> None:
    """A family only traced (Qwen3.5's linear-attention layers) keeps its config.json in the spec; simulate(hf=True)
    without a config built transformers' class from the spec's Llama-style fields instead (176,576 parameters for
    the class's 174,080 here, and a 23 % lower peak from the estimate than from that other model)."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from tests.support.traced_vlm import generic_configs
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    cfg = dict(generic_configs()["qwen3_5"]["text_config"], model_type="qwen3_5_text")
    spec, _ = hf_config_to_spec(cfg, id="q", name="q")
    config = CONFIG_MAPPING["qwen3_5_text"].from_dict({k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    result = simulate(spec, TrainingSetup(method="lora", seq_len=32), hf=True, steps=1)
    assert result.total_params == params


def test_a_fit_keeps_a_prompt_beside_the_completion_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DPO with --completion-len 64 on a traced model: the fit's lengths start above the completion (its points
    at 17-41 tokens were setups the validation refuses, and the estimate was refused instead of answered)."""
    import dataclasses

    from tests.support.traced_vlm import tiny_configs
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = hf_config_to_spec(tiny_configs()["qwen2_vl"], id="q", name="q")
    setup = TrainingSetup(method="freeze", trainable_layers=1, objective="dpo", completion_len=64, seq_len=128,
                          images=1, image_width=320, image_height=240, vision_tuning="frozen")
    est = estimate(spec, setup, match_simulation=True)
    assert est.peak_allocated_bytes == simulate(dataclasses.replace(spec, tape="auto"), setup).peak_allocated_bytes
