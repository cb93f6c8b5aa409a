"""Export the other way (axolotl, LLaMA-Factory, TRL, DeepSpeed), and the round trip: reading an exported
file gives back the setup that was exported, for every setup the format can express (hypothesis draws them);
a setup it cannot express is refused, never written approximately."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from vramlab.core.catalog import find_model
from vramlab.core.checks import SetupError
from vramlab.core.sources.export import EXPORT_FORMATS, export_setup
from vramlab.core.sources.training import read_training_configs
from vramlab.core.spec.targets import ATTN_TARGETS, MLP_TARGETS
from vramlab.core.spec.training import TrainingSetup

MODEL = find_model("llama-2-7b")
DS_FIELDS = ("sharding", "offload", "compute", "micro_batch", "grad_accum")


def round_trip(setup: TrainingSetup, fmt: str) -> TrainingSetup:
    exported = export_setup(setup, fmt, model="meta-llama/Llama-2-7b-hf")
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in exported.files.items():
            (Path(tmp) / name).write_text(text)
        source = read_training_configs([Path(tmp) / exported.main])
    assert not source.refused
    back = TrainingSetup().replace(**source.changes).replace(gpus=setup.gpus)
    if fmt == "llamafactory":  # LLaMA-Factory 0.9.5's transformers (<= 5.6.0) loads without the Hub kernels
        assert back.hub_kernels is False
        back = back.replace(hub_kernels=setup.hub_kernels)
    if fmt == "axolotl" and back.uses_lora:  # axolotl 0.19.0's load_adapter: enable_input_require_grads, always
        assert back.input_grads is True
        back = back.replace(input_grads=setup.input_grads)
    return back


def same(a: TrainingSetup, b: TrainingSetup, fields: tuple[str, ...] | None = None) -> None:
    ra, rb = a.resolved(), b.resolved()  # defaults filled in; amp as the autocast it means
    if fields:
        ra, rb = {k: ra[k] for k in fields}, {k: rb[k] for k in fields}
    assert ra == rb


@st.composite
def setups(draw) -> TrainingSetup:
    method = draw(st.sampled_from(["full", "lora", "qlora", "freeze"]))
    kw: dict = {"method": method}
    if method in ("lora", "qlora"):
        kw["lora_rank"] = draw(st.sampled_from([4, 8, 16, 64]))
        kw["lora_alpha"] = draw(st.sampled_from([None, 16.0, 32.0]))
        kw["lora_dropout"] = draw(st.sampled_from([0.0, 0.05, 0.1]))
        kw["lora_targets"] = tuple(draw(st.sets(st.sampled_from(ATTN_TARGETS + MLP_TARGETS), min_size=1)))
        kw["use_dora"] = method == "lora" and draw(st.booleans())
        kw["use_rslora"] = draw(st.booleans())
    if method == "qlora":
        kw["double_quant"] = draw(st.booleans())
    if method == "freeze":
        kw["trainable_layers"] = draw(st.integers(1, 8))
        kw["trainable_fp32"] = draw(st.booleans())  # LLaMA-Factory's upcast of the trained layers
    weights = {"full": [None, "bf16", "fp32", "fp16"], "freeze": [None, "bf16", "fp32"],
               "lora": [None, "bf16", "fp16", "int8"], "qlora": [None]}[method]
    kw["weights"] = draw(st.sampled_from(weights))
    kw["compute"] = draw(st.sampled_from(["bf16", "fp16", "fp32"]))
    kw["amp"] = draw(st.sampled_from([None, True, False]))
    opt, impl = draw(st.sampled_from([("adamw", "foreach"), ("adamw", "fused"), ("adamw", "single"),
                                      ("adamw8bit", None), ("paged_adamw8bit", None), ("sgd", "foreach"),
                                      ("adafactor", "single"), ("lion", "single"), ("sgd_momentum", None),
                                      ("paged_adamw_32bit", None), ("adamw_torch_8bit", None),
                                      ("adamw_torch_4bit", None)]))
    kw |= {"optimizer": opt, "optimizer_impl": impl}
    kw |= {"micro_batch": draw(st.integers(1, 16)), "seq_len": draw(st.sampled_from([128, 512, 2048, 8192])),
           "grad_accum": draw(st.integers(1, 32)), "grad_ckpt": draw(st.booleans()),
           "attention": draw(st.sampled_from(["sdpa", "eager"])), "chunked_loss": draw(st.booleans()),
           "hub_kernels": draw(st.booleans()),
           "loss_kernel": draw(st.sampled_from(["hf", "cce", "trl", "liger"])),
           "liger_kernels": draw(st.sampled_from([(), ("rms_norm",), ("glu",), ("rms_norm", "glu"),
                                                  ("rms_norm", "glu", "cross_entropy"),
                                                  ("rms_norm", "glu", "layer_norm")])),
           # a text model ignores the vision tuning; LLaMA-Factory's freeze_vision_tower / _multi_modal_projector
           # carry it, the other formats refuse it
           "vision_tuning": draw(st.sampled_from(["frozen", "frozen", "projector", "full", "lora"]))}
    if kw["vision_tuning"] == "lora" and method in ("lora", "qlora"):
        kw["lora_targets"] = draw(st.sampled_from([kw["lora_targets"], ("all-linear",)]))
    gpus = draw(st.sampled_from([1, 2, 8]))
    sharding = "none" if gpus == 1 else draw(st.sampled_from(["none", "zero1", "zero2", "zero3", "fsdp"]))
    offload = "none" if sharding == "none" else draw(st.sampled_from(["none", "optimizer", "params"]))
    kw |= {"gpus": gpus, "sharding": sharding, "offload": offload}
    try:
        setup = TrainingSetup(**kw)
        setup.validate(MODEL)
    except SetupError:
        assume(False)
    return setup


@pytest.mark.parametrize("fmt", list(EXPORT_FORMATS))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups())
def test_export_then_import_is_the_identity(fmt, setup):
    try:
        back = round_trip(setup, fmt)
    except SetupError as e:
        assert "cannot express" in str(e)
        event("refused")
        return
    event("exported")
    same(back, setup, DS_FIELDS if fmt == "deepspeed" else None)


COMMON = {
    "LoRA, bf16 autocast": TrainingSetup(method="lora", lora_rank=16, weights="bf16", compute="bf16", amp=True,
                                         lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), grad_ckpt=True),
    "QLoRA, paged AdamW": TrainingSetup(method="qlora", optimizer="paged_adamw8bit", micro_batch=4, seq_len=2048,
                                        lora_targets=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")),
    "full, VRAM Lab's default precision (pure bf16)": TrainingSetup(),
}


@pytest.mark.parametrize("fmt", ["axolotl", "llamafactory", "trl"])
@pytest.mark.parametrize("name", list(COMMON))
def test_common_setups_export_to_every_framework(fmt, name):
    setup = COMMON[name]
    if fmt == "trl" and setup.method.value == "qlora":  # TRL 1.16 casts a quantized model's adapters to bf16
        with pytest.raises(SetupError, match="LoRA weights in fp32"):
            round_trip(setup.replace(loss_kernel="trl"), fmt)
        setup = setup.replace(adapter_dtype="bf16")
    if fmt == "trl":  # TRL 1.16's SFTTrainer computes the loss through its fused LM head only
        with pytest.raises(SetupError, match="--loss-kernel trl"):
            round_trip(setup, fmt)
        setup = setup.replace(loss_kernel="trl")
    elif setup.loss_kernel.value == "hf":  # only TRL's trainers run TRL's fused head
        with pytest.raises(SetupError, match="TRL's fused LM head"):
            round_trip(setup.replace(loss_kernel="trl"), fmt)
    same(round_trip(setup, fmt), setup)


def test_zero3_exports_a_deepspeed_json_beside_the_yaml():
    setup = TrainingSetup(method="full", weights="bf16", compute="bf16", amp=True, gpus=4, sharding="zero3",
                          offload="params", micro_batch=2, grad_accum=8, grad_ckpt=True)
    out = export_setup(setup, "axolotl", model="meta-llama/Llama-2-7b-hf")
    assert list(out.files) == ["axolotl.yaml", "deepspeed.json"]
    assert "deepspeed: deepspeed.json" in out.files["axolotl.yaml"] and "num_processes 4" in out.files["axolotl.yaml"]
    same(round_trip(setup, "axolotl"), setup)


def test_trl_export_carries_the_python_snippet():
    text = export_setup(COMMON["QLoRA, paged AdamW"].replace(loss_kernel="trl", adapter_dtype="bf16"), "trl",
                        model="m/x").files["trl_sft.yaml"]
    assert "# args = SFTConfig(" in text and "# peft_config = LoraConfig(" in text and "nf4" in text


@pytest.mark.parametrize(("setup", "fmt", "needle"), [
    (TrainingSetup(optimizer="sgd_momentum"), "axolotl", "optimizer sgd_momentum"),
    (TrainingSetup(optimizer="adamw", optimizer_impl="single", loss_kernel="trl"), "trl", "adamw (single)"),
    (TrainingSetup(), "trl", "its fused LM head: use --loss-kernel trl"),
    (TrainingSetup(chunked_loss=True), "trl", "a chunked loss"),
    (TrainingSetup(method="freeze", trainable_layers=2), "axolotl", "freeze"),
    (TrainingSetup(weights="fp16", compute="fp16", amp=False), "llamafactory", "without autocast"),
    (TrainingSetup(gpus=2, sharding="fsdp"), "deepspeed", "FSDP"),
    (TrainingSetup(master_weights=True), "axolotl", "master copy"),
])
def test_what_a_format_cannot_express_is_refused(setup, fmt, needle):
    with pytest.raises(SetupError, match="cannot express") as e:
        export_setup(setup, fmt, model="m/x")
    assert needle in str(e.value)


def test_cli_export_writes_files_that_import_to_the_same_setup(tmp_path, capsys):
    from vramlab.core.cli import main

    flags = ["-m", "llama-2-7b", "--method", "qlora", "--lora-targets", "all-linear", "--grad-ckpt", "--batch", "4",
             "--gpus", "2", "--sharding", "zero2", "--offload", "optimizer"]
    assert main(["export", "axolotl", *flags]) == 2  # two files (YAML + DeepSpeed JSON) need a folder
    assert "--out" in capsys.readouterr().err
    assert main(["export", "axolotl", *flags, "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["axolotl.yaml", "deepspeed.json"]
    assert "base_model: meta-llama/Llama-2-7b-hf" in (tmp_path / "axolotl.yaml").read_text()
    capsys.readouterr()
    main(["estimate", "--fast", "--json", *flags])
    by_flags = json.loads(capsys.readouterr().out)["setup"]
    main(["estimate", "--fast", "--json", "-m", "llama-2-7b", "--gpus", "2",
          "--config", str(tmp_path / "axolotl.yaml")])
    assert json.loads(capsys.readouterr().out)["setup"] == by_flags


@pytest.mark.parametrize("fmt", ["axolotl", "llamafactory", "trl"])
def test_an_exported_config_reads_back_offline_with_no_model_flag(tmp_path, capsys, monkeypatch, fmt):
    """Issue 27: the exported file names the Hub id (what the framework needs); offline, reading it back with
    --config alone gives the same model and setup as the flags, from the preset made from that repository."""
    from vramlab.core.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    flags = ["-m", "qwen2.5-0.5b", "--method", "lora", "--lora-rank", "16", "--grad-ckpt", "--batch", "2"]
    if fmt == "trl":  # TRL 1.16's SFTTrainer computes the loss through its fused LM head, whatever loss_type
        flags += ["--loss-kernel", "trl"]
    if fmt == "llamafactory":  # its transformers (<= 5.6.0) loads without the Hub kernels
        flags += ["--no-hub-kernels"]
    assert main(["export", fmt, *flags, "--out", str(tmp_path / "out")]) == 0
    written = [p for p in (tmp_path / "out").iterdir() if p.suffix in (".yaml", ".json")]
    assert "Qwen/Qwen2.5-0.5B" in written[0].read_text()
    capsys.readouterr()
    assert main(["estimate", "--fast", "--json", *flags]) == 0
    by_flags = json.loads(capsys.readouterr().out)
    assert main(["estimate", "--fast", "--json", *(a for p in written for a in ("--config", str(p)))]) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["model"] == "qwen2.5-0.5b" and back["setup"] == by_flags["setup"]
    assert back["device_used_bytes"] == by_flags["device_used_bytes"]


@pytest.mark.parametrize(("setup", "keys"), [
    # LLaMA-Factory 0.9.5's init_adapter upcasts trainable parameters to fp32 unless pure_bf16 or ZeRO-3
    (TrainingSetup(method="full", weights="fp32", compute="bf16", amp=True), {"bf16": True}),
    (TrainingSetup(method="full", weights="bf16", compute="bf16", amp=True), {"bf16": True, "pure_bf16": True}),
    (TrainingSetup(method="freeze", trainable_layers=2, weights="bf16", compute="bf16", amp=True),
     {"bf16": True, "pure_bf16": True}),
    (TrainingSetup(method="full", weights="bf16", compute="bf16", amp=True, gpus=2, sharding="zero3"),
     {"bf16": True}),
    (TrainingSetup(method="freeze", trainable_layers=2, weights="bf16", compute="bf16", trainable_fp32=True),
     {"bf16": True}),
    (TrainingSetup(method="freeze", trainable_layers=2, weights="fp16", compute="fp16", trainable_fp32=True),
     {"fp16": True}),
])
def test_llamafactory_export_writes_pure_bf16_where_the_upcast_must_not_happen(setup, keys):
    import yaml

    data = yaml.safe_load(export_setup(setup, "llamafactory", model="m/x").files["llamafactory.yaml"])
    assert {k: data[k] for k in ("bf16", "fp16", "pure_bf16") if k in data} == keys
    same(round_trip(setup, "llamafactory"), setup)


@pytest.mark.parametrize("setup", [
    TrainingSetup(method="full", weights="bf16", compute="bf16", amp=False, gpus=2, sharding="zero3"),
    TrainingSetup(method="freeze", trainable_layers=2, weights="fp32", compute="fp16", amp=True),
    TrainingSetup(method="full", weights="bf16", compute="bf16", trainable_fp32=True),
])
def test_llamafactory_export_refuses_what_its_upcast_or_parser_would_change(setup):
    with pytest.raises(SetupError, match="cannot express"):
        export_setup(setup, "llamafactory", model="m/x")


@pytest.mark.parametrize("keys, setup", [
    # a quantized base with DoRA: SFTTrainer casts the LoRA weights to bf16 and keeps the magnitude in fp32
    ({"max_length": 64, "use_dora": True}, TrainingSetup(method="qlora", use_dora=True, adapter_dtype="bf16")),
    ({"max_length": 64}, TrainingSetup(method="qlora", adapter_dtype="bf16")),
], ids=["dora", "sft"])
def test_the_trl_export_and_reader_take_the_adapter_dtype_from_one_rule(tmp_path, keys, setup):
    """The export's adapter dtype for TRL (an SFT config: the export writes no other objective) is the one its
    reader maps from the same config, DoRA's exception included (the export copied the rule without it)."""
    from vramlab.core.sources.export import _adapter_dtype

    cfg = tmp_path / "trl.yaml"
    cfg.write_text(json.dumps({"use_peft": True, "lora_r": 8, "load_in_4bit": True, "dtype": "bfloat16", "bf16": False,
                               **keys}))
    source = read_training_configs([cfg])
    try:
        source.check()
        read = source.changes.get("adapter_dtype", "fp32")
    except SetupError:
        read = None  # the reader refuses the mix
    exported = _adapter_dtype("trl", setup)
    assert (exported.value if exported is not None else None) == read
    if read is None:
        with pytest.raises(SetupError, match="DoRA on a quantized base"):
            export_setup(setup, "trl", model="m")
