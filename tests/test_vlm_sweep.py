"""Image-text-to-text families from a bare config.json (issue 28): transformers' own default config of the type
(``AutoConfig.for_model(type).to_dict()``), its layers cut to two (fake tensors make width free; depth is time),
and ``--images 1``. Each family ends in one of two ways: an answer held to transformers' class under fake tensors
(``simulate`` runs the class on its processor's batch, and the class refuses a batch whose image tokens and features
disagree), or a refusal whose reason is the library's own, in one line.

The families here are those a sweep of every type in transformers 5.25.0's image-text-to-text mapping found
failing for a reason of their own; each says what a checkpoint's config.json gives that transformers' default
config does not, where the default itself cannot run. Skipped without torch, transformers, peft and Pillow."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("PIL")

from vramlab.core.checks import SetupError  # noqa: E402
from vramlab.core.kinds import Kind  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402

_LAYERS = ("num_hidden_layers", "depth", "num_layers")


def _cut(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with every layer count over two cut to two, with the per-layer lists of that length (layer types)."""
    out = dict(cfg)
    for key in _LAYERS:
        n = out.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 2:
            out[key] = 2
            out.update({k: v[:2] for k, v in out.items() if isinstance(v, list) and len(v) == n})
    out.update({k: _cut(v) for k, v in out.items() if k.endswith("_config") and isinstance(v, dict)})
    return out


def bare(model_type: str, **given: Any) -> dict[str, Any]:
    """transformers' default config of ``model_type`` as a config.json, cut to two layers, with ``given`` keys."""
    from transformers import AutoConfig

    cfg = _cut(AutoConfig.for_model(model_type).to_dict())
    cfg.update(given)
    return cfg


def _spec(cfg: dict[str, Any]) -> tuple[Any, list[str]]:
    from vramlab.core.sources.hf_config import hf_config_to_spec

    return hf_config_to_spec(cfg, id=cfg["model_type"], name=cfg["model_type"])


def _setup(**kw: Any) -> TrainingSetup:
    base = dict(method="lora", vision_tuning="frozen", images=1, image_width=100, image_height=80, seq_len=16,
                lora_rank=4, lora_targets=("all-linear",))
    return TrainingSetup(**{**base, **kw})


def _answered(cfg: dict[str, Any]) -> None:
    """The images of ``cfg`` counted by its processor class and run through transformers' class."""
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.vision import token_counts

    spec, warnings = _spec(cfg)
    assert spec.vision is not None and spec.vision.processor.kind == "processor", warnings
    setup = _setup()
    assert token_counts(spec, setup)["vision_tokens"] > 0
    result = simulate(spec, setup, steps=1)  # the class takes the batch only where tokens and features agree
    forward = next(p for p in result.phases if p.key == "forward@1")
    assert forward.components.get(Kind.VISION_ACTIVATIONS, 0) > 0
    assert result.peak_allocated_bytes > simulate(spec, setup.replace(images=0), steps=1).peak_allocated_bytes


def _refused(cfg: dict[str, Any], reason: str) -> None:
    """The config read as its language model, its images refused with ``reason`` (the library's), in one line."""
    spec, warnings = _spec(cfg)
    assert spec.vision is None
    said = [w for w in warnings if "--images is refused" in w]
    assert len(said) == 1 and reason in said[0] and "\n" not in said[0], warnings
    with pytest.raises(SetupError):
        _setup().validate_for(spec)


# (model type, what a checkpoint's config.json gives that the default does not, where the default cannot run)
ANSWERED = [
    # MiniCPM's processors read their video processor's settings while built: it is built for them (only)
    pytest.param("minicpmv4_6", {"image_token_id": 500}, marks=pytest.mark.slow),
    pytest.param("minicpmv4_7", {"image_token_id": 500}, marks=pytest.mark.slow),
    pytest.param("minicpm_ocr", {"image_token_id": 500}, marks=pytest.mark.slow),
    # one image per sample given as it is (a list is a document's pages to GOT-OCR2's processor)
    ("got_ocr2", {}),
    # its processor's markers are constants of its class, special tokens of its tokenizer
    pytest.param("minimax_m3_vl", {}, marks=pytest.mark.slow),
    # transformers' default Ovis2Config has a 1536 hidden_size beside its 4096 language model (a checkpoint's agree);
    # its image token is the <IMG_ATOM> its processor expands <image> into
    pytest.param("ovis2", {"hidden_size": 4096}, marks=pytest.mark.slow),
    # its prompt holds its image_placeholder_token; its tower's tiles are the tower's [448, 448] (the class default
    # is 384); its tower reads the drop-path rates of a linspace while built (a constant under fake tensors)
    pytest.param("qianfan_ocr", {}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model_type,given", ANSWERED)
def test_a_bare_config_is_answered_by_transformers_class(model_type, given):
    _answered(bare(model_type, **given))


@pytest.mark.parametrize("model_type,reason", [
    # transformers' class runs no image where the config names no image_token_id (its default leaves it None)
    ("minicpmv4_6", "names no image_token_id"),
    # its processor writes no image placeholder: the checkpoint's chat template does
    pytest.param("pp_chart2table", "PPChart2TableProcessor names no image token", marks=pytest.mark.slow),
    # its processor takes no prompt without the checkpoint's chat template (the policies it classifies against)
    pytest.param("shieldgemma2", "ShieldGemma 2 requires the use of a specific chat template",
                 marks=pytest.mark.slow),
])
def test_a_bare_config_the_library_cannot_run_is_refused_with_its_reason(model_type, reason):
    _refused(bare(model_type), reason)


def test_several_pages_to_got_ocr2_are_refused_with_its_processors_reason():
    from vramlab.core.vision import token_counts

    spec, _ = _spec(bare("got_ocr2"))
    with pytest.raises(SetupError, match="Nested images are only supported with `multi_page`"):
        token_counts(spec, _setup(images=2))


@pytest.mark.slow
def test_ovis2s_default_config_is_refused_by_transformers_class():
    """transformers' default Ovis2Config: the class's own check refuses the processor's batch (its visual table is
    the config's 1536 wide, its language model 4096)."""
    from vramlab.core.simulation.simulate import simulate

    spec, _ = _spec(bare("ovis2"))
    with pytest.raises(SetupError, match="ValueError: Image features and image tokens do not match"):
        simulate(spec, _setup(), steps=1)


@pytest.mark.slow
def test_inkling2s_images_are_counted_by_its_processor_class():
    """Inkling2's image processor reads PIL images with torchvision's pil_to_tensor (a stand-in here without
    torchvision). Its class is not run here: its language model does not build under fake tensors yet (the float32
    cast of its short convolutions fails the parameter swap)."""
    from vramlab.core.vision import token_counts

    spec, warnings = _spec(bare("inkling2"))
    assert spec.vision is not None and spec.vision.processor.kind == "processor", warnings
    assert token_counts(spec, _setup())["vision_tokens"] > 0
