"""Models by Hub id, against a real local HTTP server that plays the Hub (tests/support/hub_server.py).

No test reaches the internet: HF_ENDPOINT points at 127.0.0.1, and the caches live in a temporary folder.
"""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.support.hub_server import SLOW_S, TOKEN, serve_hub, tiny_tensors
from vramlab.core.catalog import resolve_model
from vramlab.core.checks import SetupError
from vramlab.core.cli import main
from vramlab.core.sources.hub import LookupCancelled, cached_model_ids, load_hub_model, parse_hub_id

TINY_PARAMS = sum(math.prod(s) for s in tiny_tensors().values())


@pytest.fixture
def hub(tmp_path, monkeypatch):
    yield from serve_hub(tmp_path, monkeypatch)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("text", "repo", "rev"), [
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B", None),
    ("Qwen/Qwen2.5-0.5B@v1.0", "Qwen/Qwen2.5-0.5B", "v1.0"),
    ("org/name@" + "a" * 40, "org/name", "a" * 40),
    ("org/name@refs/pr/1", "org/name", "refs/pr/1"),
])
def test_hub_ids_parse(text, repo, rev):
    ref = parse_hub_id(text)
    assert ref is not None and (ref.repo_id, ref.revision) == (repo, rev)


@pytest.mark.parametrize("text", ["llama-2-7b", "./model/", "/abs/path", "a/b/c", "org/../x", "org/name@", "o/-x",
                                  "org/name@a/../../x"])
def test_non_hub_ids_are_not_parsed(text):
    assert parse_hub_id(text) is None


def test_public_model_exact_count_from_served_headers_and_no_weight_bytes(hub):
    model = load_hub_model("acme/tiny-llama")
    spec = model.imported.spec
    assert spec.published_params == TINY_PARAMS == spec.param_count
    assert model.imported.tensor_params == TINY_PARAMS
    assert model.commit == hub.repos["acme/tiny-llama"].commit and model.requests > 0
    assert hub.weight_bytes_sent() == 0
    fetched = {r.filename for r in hub.log if r.method == "GET" and r.status in (200, 206)}
    assert "model.safetensors" in fetched  # its header, by range
    assert all(r.status == 206 for r in hub.log if r.filename.endswith(".safetensors") and r.method == "GET")


def test_a_cached_model_is_found_with_no_network(hub, monkeypatch):
    first = load_hub_model("acme/tiny-llama")
    seen = len(hub.log)
    again = load_hub_model("acme/tiny-llama")
    assert len(hub.log) == seen and again.requests == 0
    assert again.imported.spec == first.imported.spec
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = load_hub_model("acme/tiny-llama")
    assert offline.imported.spec == first.imported.spec and len(hub.log) == seen
    assert "acme/tiny-llama" in cached_model_ids()


def test_offline_with_nothing_cached_is_one_clear_error(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = cli(capsys, "estimate", "-m", "acme/tiny-llama")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "not in the local Hugging Face cache" in err and "HF_HUB_OFFLINE" in err
    assert hub.log == []


def test_offline_with_only_the_config_cached_counts_from_the_config(hub, monkeypatch, tmp_path):
    import os

    from huggingface_hub import hf_hub_download

    hf_hub_download("acme/tiny-llama", "config.json", cache_dir=tmp_path / "hf" / "hub",
                    endpoint=os.environ["HF_ENDPOINT"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_hub_model("acme/tiny-llama")
    assert model.imported.spec.published_params is None
    assert any("config.json only" in w for w in model.imported.warnings)




def test_gated_without_token_then_with_token(hub, monkeypatch, capsys):
    code, _, err = cli(capsys, "estimate", "-m", "acme/gated-llama")
    assert code == 2 and err.count("\n") == 1 and "gated repository" in err and "HF_TOKEN" in err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model = load_hub_model("acme/gated-llama")
    assert model.imported.spec.published_params == TINY_PARAMS
    assert all(r.authorized for r in hub.log if r.status in (200, 206))
    assert hub.weight_bytes_sent() == 0


def test_sharded_checkpoint_reads_every_shard_header(hub):
    model = load_hub_model("acme/sharded-llama")
    assert model.imported.spec.published_params == TINY_PARAMS
    shards = {r.filename for r in hub.log if r.filename.endswith(".safetensors") and r.status == 206}
    assert shards == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert hub.weight_bytes_sent() == 0
    assert not any("disagree" in w or "total_size" in w for w in model.imported.warnings)


def test_adapter_repo_loads_its_base_and_carries_the_lora_settings(hub):
    model = load_hub_model("acme/tiny-lora")
    assert model.adapter is not None and model.adapter["r"] == 16
    assert model.adapter_repo == "acme/tiny-lora" and model.ref.repo_id == "acme/tiny-llama"
    assert model.imported.spec.published_params == TINY_PARAMS
    assert not any(r.filename == "adapter_model.safetensors" for r in hub.log)


@pytest.mark.parametrize(("model", "needle"), [
    ("acme/does-not-exist", "no such model repository"),
    ("acme/no-config", "no config.json"),
    ("acme/tiny-llama@v9", "no revision 'v9'"),
])
def test_hub_errors_are_one_line_exit_2(hub, capsys, model, needle):
    code, out, err = cli(capsys, "estimate", "-m", model)
    assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, err


def test_a_silent_hub_is_a_timeout_not_a_hang(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    t0 = time.monotonic()
    with pytest.raises(SetupError, match="did not answer within 1 s"):
        load_hub_model("acme/slow")
    assert time.monotonic() - t0 < SLOW_S


def test_cancel_between_requests(hub):
    with pytest.raises(LookupCancelled):
        load_hub_model("acme/tiny-llama", cancelled=lambda: True)
    assert hub.log == []


def test_cli_json_names_the_hub_origin_and_exact_count(hub, capsys):
    code, out, _ = cli(capsys, "estimate", "-m", "acme/tiny-llama@main", "--json")
    d = json.loads(out)
    assert code == 0 and d["total_params"] == TINY_PARAMS
    assert hub.weight_bytes_sent() == 0


def test_network_false_refuses_an_uncached_id_without_a_request(hub):
    with pytest.raises(SetupError):
        resolve_model("acme/tiny-llama", network=False)
    assert hub.log == []


def test_an_adapter_repo_sets_the_lora_setup_and_flags_still_win(hub, capsys):
    code, out, _ = cli(capsys, "estimate", "-m", "acme/tiny-lora", "--json", "--fast")
    d = json.loads(out)
    assert code == 0 and d["total_params"] == TINY_PARAMS
    assert d["setup"]["method"] == "lora" and d["setup"]["lora_rank"] == 16 and d["setup"]["lora_alpha"] == 32
    assert d["setup"]["lora_targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert d["setup_source"]["files"][0]["path"] == "acme/tiny-lora/adapter_config.json"
    assert "acme/tiny-lora (adapter) on acme/tiny-llama" in d["model_origin"]
    code, out, _ = cli(capsys, "estimate", "-m", "acme/tiny-lora", "--json", "--fast", "--lora-rank", "4")
    assert json.loads(out)["setup"]["lora_rank"] == 4


def test_the_origin_says_how_many_headers_and_that_no_weights_came(hub):
    model = load_hub_model("acme/sharded-llama")
    assert model.headers_read == 2 and "2 safetensors header(s), no weights" in model.origin
    assert "local cache, no network" in load_hub_model("acme/sharded-llama").origin


def test_a_model_downloaded_by_transformers_is_read_from_its_files_offline(hub, monkeypatch, tmp_path):
    """The whole checkpoint in the cache (as from_pretrained leaves it): its local headers, no network."""
    import os

    from huggingface_hub import hf_hub_download

    for name in ("config.json", "model.safetensors"):
        hf_hub_download("acme/tiny-llama", name, cache_dir=tmp_path / "hf" / "hub", endpoint=os.environ["HF_ENDPOINT"])
    seen = len(hub.log)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_hub_model("acme/tiny-llama")
    assert model.requests == 0 and len(hub.log) == seen
    assert model.imported.spec.published_params == TINY_PARAMS == model.imported.tensor_params
    assert model.imported.spec.name == "acme/tiny-llama"


def test_a_mistyped_local_folder_is_named_as_well(hub, tmp_path, monkeypatch, capsys):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "estimate", "-m", "models/lama-7b")
    assert code == 2 and "no such model repository" in err and "nor is there a local folder models/lama-7b" in err


def test_offline_a_hub_id_a_preset_was_made_from_uses_the_preset_and_says_so(hub, monkeypatch, capsys):
    """Issue 27: `-m Qwen/Qwen2.5-7B` offline said the id is not cached, not that the preset qwen2.5-7b exists."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = cli(capsys, "estimate", "-m", "Qwen/Qwen2.5-7B", "--fast", "--json")
    assert code == 0 and hub.log == []
    d = json.loads(out)
    assert d["model"] == "qwen2.5-7b"
    assert any("not in the local Hugging Face cache" in w and "preset qwen2.5-7b" in w for w in d["warnings"])
    code, again, _ = cli(capsys, "estimate", "-m", "qwen2.5-7b", "--fast", "--json")
    assert json.loads(again)["device_used_bytes"] == d["device_used_bytes"]


@pytest.mark.parametrize(("model", "preset"), [("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
                                               ("someone/Llama-3.1-8B", "llama-3.1-8b")])
def test_offline_an_uncached_id_names_the_preset_of_its_name(hub, monkeypatch, capsys, model, preset):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = cli(capsys, "estimate", "-m", model, "--fast")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "not in the local Hugging Face cache" in err and f"-m {preset}" in err


def test_a_revision_of_a_preset_repo_is_not_replaced_by_the_preset(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = cli(capsys, "estimate", "-m", "Qwen/Qwen2.5-7B@v2", "--fast")
    assert code == 2 and "not in the local Hugging Face cache" in err
