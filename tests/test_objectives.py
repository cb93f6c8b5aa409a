"""DPO / IPO and GRPO (issue 15): the estimate held to the fake-tensor simulation of TRL 1.16.0's step.

The simulation (each unit's reference.py under core/objectives/) runs every op of the step on fake tensors, every
generated token included; the estimate (its program.py) replays it on the byte engine, the generation shortened to
the prefill and the last token. The matrix: objectives x (full, LoRA, QLoRA) x reference handling x
checkpointing over three families at tiny widths (the full-size matrix is benchmarks/objectives.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from vramlab.core.catalog import find_model
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.training import TrainingSetup


def tiny(model_id: str, vocab: int = 1000) -> object:
    """A preset's architecture (norms, biases, tying, MLP kind, fused projections) at tiny widths."""
    spec = find_model(model_id)
    heads = 4
    kv = 2 if spec.num_kv_heads < spec.num_heads else 4
    return dataclasses.replace(spec, id=f"{spec.id}-tiny", num_layers=3, hidden_size=64, num_heads=heads,
                               num_kv_heads=kv, head_dim=16, intermediate_size=96, vocab_size=vocab,
                               published_params=None, sliding_window=0, rotary_dim=0)


FAMILIES = {"llama": tiny("llama-3.2-1b", vocab=40_000), "qwen2": tiny("qwen2.5-0.5b"), "gpt2": tiny("gpt2")}
PAIR_FAMILIES = {**FAMILIES, "gemma2": tiny("gemma-2-2b")}
METHODS = ({"method": "full"}, {"method": "lora", "lora_targets": ("q_proj", "v_proj", "up_proj"), "lora_dropout": 0.1},
           {"method": "qlora", "lora_targets": ("q_proj", "o_proj", "down_proj")})
CASES = []
for fam in FAMILIES:
    for mi, method in enumerate(METHODS):
        refs = ("copy", "precomputed") if method["method"] == "full" else ("adapters", "precomputed")
        if method["method"] == "lora":
            refs += ("copy",)
        for ref in refs:
            ckpt = (mi + len(ref)) % 2 == 0
            CASES.append((fam, {**method, "objective": "dpo", "reference": ref, "grad_ckpt": ckpt,
                                "micro_batch": 2, "seq_len": 24, "completion_len": 10}))
        CASES.append((fam, {**method, "objective": "ipo", "grad_ckpt": mi == 1, "seq_len": 20}))
        CASES.append((fam, {**method, "objective": "kto", "micro_batch": 3, "seq_len": 20, "grad_ckpt": mi == 2,
                            **({"reference": "precomputed"} if mi == 1 else {})}))
        grpo = {**method, "objective": "grpo", "micro_batch": 4, "num_generations": 4, "seq_len": 20,
                "completion_len": 6, "grad_ckpt": mi != 1}
        CASES.append((fam, grpo))
        CASES.append((fam, {**grpo, "beta": 0.04, "num_iterations": 2, "grad_accum": 2, "micro_batch": 2}))
    CASES.append((fam, {"method": "full", "objective": "grpo", "micro_batch": 2, "num_generations": 2,
                        "seq_len": 16, "completion_len": 4, "generation_backend": "vllm-colocate"}))
    # AMP (fp32 weights, bf16 autocast): the fused head casts its token chunks and LM-head slices
    CASES.append((fam, {"method": "full", "weights": "fp32", "objective": "dpo", "seq_len": 20, "grad_ckpt": True}))
    CASES.append((fam, {"method": "lora", "weights": "fp32", "objective": "grpo", "micro_batch": 2,
                        "num_generations": 2, "seq_len": 16, "completion_len": 5, "beta": 0.1,
                        "reference": "copy", "reference_dtype": "bf16"}))


def test_matrix_covers_the_dimensions():
    setups = [TrainingSetup(**kw) for _f, kw in CASES]
    assert {s.objective.value for s in setups} == {"dpo", "ipo", "kto", "grpo"}
    assert {s.method.value for s in setups} == {"full", "lora", "qlora"}
    assert {s.reference_mode.value for s in setups} == {"copy", "adapters", "precomputed", "none"}
    assert {s.grad_ckpt for s in setups} == {True, False}
    assert len(FAMILIES) >= 3


def _ids(cases: list) -> list[str]:
    return [f"{f}-" + "-".join(str(v) for v in kw.values()) for f, kw in cases]


# the default run: every fifth case (each family, method and objective) and the AMP cases of one family; the
# whole matrix, and the full-size models, run in benchmarks/objectives.py
QUICK = [c for i, c in enumerate(CASES) if i % 5 == 0 or (c[1].get("weights") == "fp32" and c[0] == "qwen2")]


@pytest.mark.parametrize(("family", "kw"), QUICK, ids=_ids(QUICK))
def test_estimate_equals_simulation(family, kw):
    _check(family, kw)


def _check(family: str, kw: dict, families: dict | None = None) -> None:
    spec, setup = (families or FAMILIES)[family], TrainingSetup(**kw)
    sim = simulate(spec, setup)
    est = estimate(spec, setup, match_simulation=True)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in sim.phases}
    assert dict(est.components) == dict(sim.components)


# ORPO / SimPO / CPO (trl.experimental ORPOTrainer / CPOTrainer): full logits, no reference. One row (the
# logits' .contiguous() copies nothing) and two rows; autocast (fp32 weights: the cross entropy in fp32)
PAIR_CASES = [
    ("qwen2", {"method": "full", "objective": "orpo", "micro_batch": 2, "seq_len": 20, "completion_len": 8}),
    ("llama", {"method": "lora", "lora_targets": ("q_proj", "v_proj"), "objective": "orpo", "grad_ckpt": True,
               "seq_len": 20}),
    ("gpt2", {"method": "qlora", "objective": "simpo", "seq_len": 20}),
    ("qwen2", {"method": "lora", "objective": "simpo", "micro_batch": 2, "seq_len": 16, "grad_ckpt": True}),
    ("llama", {"method": "full", "objective": "cpo", "seq_len": 20}),
    ("qwen2", {"method": "full", "weights": "fp32", "objective": "cpo", "micro_batch": 2, "seq_len": 20}),
    ("gemma2", {"method": "lora", "objective": "orpo", "micro_batch": 2, "seq_len": 16}),  # softcapped logits
]


@pytest.mark.parametrize(("family", "kw"), PAIR_CASES, ids=_ids(PAIR_CASES))
def test_orpo_simpo_cpo_estimate_equals_simulation(family, kw):
    _check(family, kw, PAIR_FAMILIES)


def test_orpo_keeps_full_logits_and_no_reference():
    """What separates these objectives from DPO: no reference at all, and logits over the whole vocabulary
    for every position of chosen and rejected (TRL's fused LM head keeps only completion tokens' tiles)."""
    spec = FAMILIES["llama"]  # vocabulary 40000: the logits dominate
    kw = {"method": "lora", "lora_targets": ("q_proj", "v_proj"), "seq_len": 20}
    orpo = estimate(spec, TrainingSetup(objective="orpo", **kw))
    dpo = estimate(spec, TrainingSetup(objective="dpo", reference="precomputed", **kw))
    assert Kind.REFERENCE not in orpo.components
    assert "reference@2" not in [p.key for p in orpo.phases]
    rows_x_vocab = 2 * 20 * spec.vocab_size * 2  # one bf16 logits tensor of chosen + rejected
    assert orpo.peak_allocated_bytes - dpo.peak_allocated_bytes > rows_x_vocab


def test_phases_show_generation_and_reference():
    spec = FAMILIES["qwen2"]
    grpo = estimate(spec, TrainingSetup(objective="grpo", method="lora", micro_batch=4, num_generations=4,
                                        seq_len=20, completion_len=6, beta=0.04))
    keys = [p.key for p in grpo.phases]
    assert "generate@2" in keys and "reference@2" in keys
    gen = next(p for p in grpo.phases if p.key == "generate@2")
    assert gen.components.get(Kind.KV_CACHE, 0) > 0
    dpo = estimate(spec, TrainingSetup(objective="dpo", seq_len=20))
    assert dpo.components.get(Kind.REFERENCE, 0) > 0  # full fine-tuning: a second copy
    lora = estimate(spec, TrainingSetup(objective="dpo", method="lora", seq_len=20))
    assert Kind.REFERENCE not in lora.components  # the policy with its adapters disabled


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"objective": "orpo", "reference": "copy"}, "no reference model"),
    ({"objective": "simpo", "reference_dtype": "bf16"}, "no reference model"),
    ({"objective": "kto", "micro_batch": 1}, "at least 2"),
    ({"objective": "dpo", "reference": "adapters"}, "needs LoRA"),
    ({"objective": "grpo", "micro_batch": 3}, "divisible by --num-generations"),
    ({"objective": "grpo", "micro_batch": 8, "reference": "precomputed", "beta": 0.1}, "cannot be precomputed"),
    ({"objective": "dpo", "num_generations": 4}, "grpo only"),
    ({"objective": "dpo", "seq_len": 64, "completion_len": 64}, "shorter than the sequence"),
    ({"objective": "dpo", "optimizer_in_backward": True}, "without optimizer-in-backward"),
])
def test_wrong_combinations_say_what_to_change(kw, fragment):
    with pytest.raises(SetupError, match=fragment):
        TrainingSetup(**kw).validate()


@pytest.mark.parametrize("objective", ["dpo", "kto", "orpo"])
@pytest.mark.parametrize(("option", "said"), [(dict(loss_kernel="cce"), "Cut Cross Entropy's patch"),
                                              (dict(chunked_loss=True), "a chunked SFT loss")])
def test_an_sft_loss_kernel_under_a_trl_objective_is_the_step_without_it(objective, option, said):
    """axolotl's CCE patch or a chunked SFT loss with a preference objective: TRL 1.16's DPO / KTO trainers score
    through their own fused LM head, in tiles (the patched forward's loss never runs) and ORPO asks the model for
    logits without labels (the patch computes no loss then). Refused before; now the objective's step, said in a
    warning, and CCE's own limits (fp32 hidden states) no longer refuse a step that never runs it."""
    from vramlab.core.catalog import resolve_model
    from vramlab.core.estimate import estimate

    spec = resolve_model("qwen2.5-0.5b").spec
    setup = TrainingSetup(objective=objective, method="lora", seq_len=256, micro_batch=2)
    plain, other = estimate(spec, setup), estimate(spec, setup.replace(**option))
    assert other.peak_allocated_bytes == plain.peak_allocated_bytes
    assert any(said in w and "the objective's step without it" in w for w in other.warnings)
    assert not any(said in w for w in plain.warnings)
    setup.replace(**option, weights="fp32").validate(spec)  # CCE's backward would refuse fp32 hidden states


def test_liger_fused_loss_under_a_trl_objective_is_refused_with_trls_reason():
    with pytest.raises(SetupError, match="fused_linear_cross_entropy.*is not supported.*use --loss-kernel trl"):
        TrainingSetup(objective="dpo", method="lora", loss_kernel="liger").validate()


def test_liger_fused_loss_under_orpo_is_the_step_without_it():
    """trl.experimental's ORPO / CPO trainers keep HF Trainer's use_liger_kernel patch (they refuse nothing) and call
    the model without labels, where liger's lce_forward makes the logits (skip_logits only with labels)."""
    from vramlab.core.catalog import resolve_model
    from vramlab.core.estimate import estimate

    spec = resolve_model("qwen2.5-0.5b").spec
    setup = TrainingSetup(objective="orpo", method="lora", seq_len=256, micro_batch=2)
    liger = estimate(spec, setup.replace(loss_kernel="liger"))
    assert liger.peak_allocated_bytes == estimate(spec, setup).peak_allocated_bytes
    assert any("Liger's patched forward computes the logits" in w for w in liger.warnings)


def test_sft_is_untouched():
    s = TrainingSetup()
    assert s.resolved()["reference"] is None and s.reference_mode.value == "none"


# ---- CLI ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "needle"), [
    (["--objective", "grpo", "--batch", "3"], "divisible by --num-generations"),
    (["--objective", "dpo", "--num-generations", "4"], "grpo only"),
    (["--objective", "grpo", "--batch", "8", "--prompt-len", "64"], "needs --completion-len"),
    (["--objective", "grpo", "--batch", "8", "--prompt-len", "64", "--completion-len", "8", "--seq", "100"],
     "--prompt-len + --completion-len"),
    (["--objective", "grpo", "--batch", "8", "--vllm-memory-fraction", "1.5"], "between 0 and 1"),
    (["--objective", "dpo", "--reference", "adapters"], "needs LoRA"),
    (["--objective", "simpo", "--reference", "precomputed"], "no reference model"),
])
def test_cli_refuses_wrong_combinations_in_one_line(capsys, args, needle):
    from vramlab.core.cli import main

    code = main(["estimate", "--model", "qwen2.5-0.5b", *args])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and needle in err


def test_cli_json_names_the_objective_and_its_phases(capsys):
    import json

    from vramlab.core.cli import main

    code = main(["estimate", "--model", "qwen2.5-0.5b", "--objective", "grpo", "--batch", "8", "--method", "lora",
                 "--prompt-len", "128", "--completion-len", "256", "--beta", "0.04", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["setup"]["objective"] == "grpo" and data["setup"]["reference"] == "adapters"
    assert data["setup"]["prompt_len"] == 128 and data["setup"]["seq_len"] == 384
    assert {"generate", "reference", "forward", "backward", "optimizer"} <= set(data["phases"])


def test_vllm_share_is_on_the_device_level_only():
    from vramlab.core.catalog import find_gpu

    spec = FAMILIES["qwen2"]
    gpu = find_gpu("h100-sxm")
    base = dict(objective="grpo", method="lora", micro_batch=4, num_generations=4, seq_len=20, completion_len=6)
    hf = estimate(spec, TrainingSetup(**base), gpu)
    colocated = estimate(spec, TrainingSetup(**base, generation_backend="vllm-colocate"), gpu)
    server = estimate(spec, TrainingSetup(**base, generation_backend="vllm-server"), gpu)
    assert "generate@1" not in {p.key for p in colocated.phases}
    assert colocated.peak_allocated_bytes == server.peak_allocated_bytes
    share = int(0.3 * gpu.memory_bytes)
    assert colocated.device_used_bytes - server.device_used_bytes == share
    assert hf.device_used_bytes < colocated.device_used_bytes


# ---- training configs -------------------------------------------------------------------------------------

def test_grpo_and_dpo_configs_are_read(tmp_path):
    from vramlab.core.sources.training import read_training_configs

    grpo = tmp_path / "grpo.yaml"
    grpo.write_text("per_device_train_batch_size: 8\nnum_generations: 4\nmax_completion_length: 300\n"
                    "max_prompt_length: 100\nuse_vllm: true\nvllm_mode: colocate\nvllm_gpu_memory_utilization: 0.4\n"
                    "vllm_enable_sleep_mode: true\nbeta: 0.04\nuse_peft: true\n")
    s = TrainingSetup(**read_training_configs([grpo]).changes)
    assert (s.objective.value, s.completion_tokens, s.prompt_tokens, s.num_generations) == ("grpo", 300, 100, 4)
    assert (s.generation_backend.value, s.vllm_memory_fraction, s.vllm_sleep) == ("vllm-colocate", 0.4, True)
    assert s.reference_mode.value == "adapters" and s.beta_value == 0.04
    dpo = tmp_path / "dpo.yaml"
    dpo.write_text("max_length: 2048\nloss_type: ipo\nprecompute_ref_log_probs: true\n")
    s = TrainingSetup(**read_training_configs([dpo]).changes)
    assert (s.objective.value, s.seq_len, s.reference_mode.value) == ("ipo", 2048, "precomputed")
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss_type: hinge\nprecompute_ref_log_probs: false\n")
    with pytest.raises(SetupError, match="loss_type"):
        read_training_configs([bad]).check()


def test_cpo_and_simpo_configs_are_read(tmp_path):
    from vramlab.core.sources.training import read_training_configs

    simpo = tmp_path / "simpo.yaml"
    simpo.write_text("max_length: 512\nloss_type: simpo\nsimpo_gamma: 0.5\nmax_completion_length: 256\nbeta: 2.0\n")
    s = TrainingSetup(**read_training_configs([simpo]).changes)
    assert (s.objective.value, s.seq_len, s.beta_value, s.reference_mode.value) == ("simpo", 512, 2.0, "none")
    cpo = tmp_path / "cpo.yaml"
    cpo.write_text("cpo_alpha: 1.0\n")
    assert TrainingSetup(**read_training_configs([cpo]).changes).objective.value == "cpo"
    bad = tmp_path / "bad.yaml"
    bad.write_text("cpo_alpha: 0.0\nloss_type: simpo\n")
    with pytest.raises(SetupError, match="cpo_alpha"):
        read_training_configs([bad]).check()


@pytest.mark.parametrize("body", [
    "max_length: 64\nmax_completion_length: 32\nbeta: 0.1\n",  # only ORPOConfig and CPOConfig have both lengths
    "max_length: 64\nbeta: 0.1\n",  # beta: DPOConfig, KTOConfig, ORPOConfig, CPOConfig (never SFTConfig)
])
def test_a_preference_config_that_does_not_say_its_trainer_is_refused_until_the_flag_says(tmp_path, body):
    """ORPOConfig has no key of its own: such a file was read as GRPO (max_completion_length) or SFT (beta)."""
    from vramlab.core.sources.training import read_training_configs, with_flags

    cfg = tmp_path / "orpo.yaml"
    cfg.write_text(body)
    src = read_training_configs([cfg])
    with pytest.raises(SetupError, match="--objective"):
        src.check()
    with_flags(src, {"objective": "--objective"}, {"objective": "orpo"}).check()
    s = TrainingSetup(**{**src.changes, "objective": "orpo"})
    assert (s.objective.value, s.seq_len) == ("orpo", 64)


def test_the_objective_flag_settles_what_a_config_refuses(tmp_path, capsys):
    """A refusal says "set it with --objective": the flag then stands for the file's key."""
    import json

    from vramlab.core.cli import main

    cfg = tmp_path / "orpo.yaml"
    cfg.write_text("max_length: 64\nbeta: 0.1\n")  # ORPOConfig's keys, none of them its own
    assert main(["estimate", "--model", "qwen2.5-0.5b", "--config", str(cfg), "--json"]) == 2
    assert "--objective" in capsys.readouterr().err
    assert main(["estimate", "--model", "qwen2.5-0.5b", "--config", str(cfg), "--objective", "orpo", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["objective"] == "orpo"


def test_export_refuses_an_objective():
    from vramlab.core.sources.export import export_setup

    with pytest.raises(SetupError, match="dpo objective"):
        export_setup(TrainingSetup(objective="dpo"), "trl", model="m")


# ---- the Advisor ---------------------------------------------------------------------------------------------

def test_advisor_knows_the_objective_levers():
    from vramlab.core.advisor import savings
    from vramlab.core.catalog import find_gpu

    spec = FAMILIES["qwen2"]
    dpo = TrainingSetup(objective="dpo", method="lora", reference="copy", seq_len=20)
    keys = {s.key: s for s in savings(spec, dpo, find_gpu("rtx-4090"))}
    assert {"ref_precomputed", "ref_adapters"} <= set(keys)
    assert keys["ref_adapters"].setup.reference_mode.value == "adapters"
    grpo = TrainingSetup(objective="grpo", method="lora", micro_batch=8, seq_len=400, completion_len=256,
                         generation_backend="vllm-colocate")
    keys = {s.key for s in savings(spec, grpo, find_gpu("rtx-4090"))}
    assert {"fewer_generations", "shorter_completions", "vllm_fraction", "vllm_sleep", "vllm_server"} <= keys


def test_advisor_on_orpo_offers_no_reference_lever_and_names_the_logits():
    from vramlab.core.advisor import checklist, savings
    from vramlab.core.catalog import find_gpu

    spec = FAMILIES["llama"]
    orpo = TrainingSetup(objective="orpo", method="lora", lora_targets=("q_proj", "v_proj"), micro_batch=2,
                         seq_len=20)
    found = savings(spec, orpo, find_gpu("rtx-4090"))
    assert found and not {s.key for s in found} & {"ref_precomputed", "ref_adapters"}
    titles = [t for t, _ in checklist(spec, orpo, estimate(spec, orpo))]
    assert "These trainers keep the full logits" in titles
    assert "Log-probabilities are already computed in chunks" not in titles


def test_a_tape_is_not_reused_across_lengths():
    """Prompt and completion are concrete in the step (the generation loop, the selected tokens): a setup that
    differs only in its sequence must record its own tape, not evaluate another's."""
    spec = FAMILIES["gpt2"]
    for kw in ({"objective": "dpo", "method": "lora"}, {"objective": "grpo", "micro_batch": 2, "num_generations": 2}):
        estimate(spec, TrainingSetup(**kw, seq_len=20, completion_len=6), match_simulation=True)
        setup = TrainingSetup(**kw, seq_len=28, completion_len=6)
        assert estimate(spec, setup, match_simulation=True).peak_allocated_bytes == \
            simulate(spec, setup).peak_allocated_bytes


# ---- TRL's own function ------------------------------------------------------------------------------------

def test_the_fused_head_allocates_what_trls_own_function_allocates(monkeypatch):
    """trl.kernels.ChunkedLogProbFunction itself, on fake tensors, with its CUDA kernels' (lack of) allocations:
    the Triton folds write in place and _addmm_fp32 is torch.addmm(out=acc). Its forward and backward hold the
    same bytes as the builder's mirror, phase by phase (a 32768-entry vocabulary: the tile is the whole buffer,
    so the CPU's mm(out=) needs no copy)."""
    pytest.importorskip("trl")
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from trl.kernels import chunked_logprob as trl_kernel

    from vramlab.core.kinds import Phase
    from vramlab.core.simulation.tracker import MemoryTracker
    from vramlab.core.simulation.trl_head import ChunkedLogProb

    monkeypatch.setattr(trl_kernel, "_forward_tile", lambda *a, **k: None)
    monkeypatch.setattr(trl_kernel, "_backward_tile", lambda *a, **k: None)
    monkeypatch.setattr(trl_kernel, "_addmm_fp32", lambda *a, **k: None)

    def peaks(fn) -> dict[str, int]:  # noqa: ANN001
        tracker = MemoryTracker()
        with FakeTensorMode(), tracker:
            hidden = torch.empty(3000, 64, dtype=torch.bfloat16, requires_grad=True)
            weight = torch.empty(32768, 64, dtype=torch.bfloat16, requires_grad=True)
            targets = torch.empty(3000, dtype=torch.long)
            tracker.set_phase(Phase.FORWARD, 1)
            logprobs, entropy, *_ = fn(hidden, weight, targets)
            loss = (logprobs * 2.0).sum()  # a contiguous gradient, as masked_select hands it over
            tracker.set_phase(Phase.BACKWARD, 1)
            loss.backward()
        return {k: rec.total_bytes for k, rec in tracker.phase_peaks.items()}

    outputs = ("log_probs", "entropy")
    def theirs_fn(h, w, t):  # noqa: ANN001, ANN202
        return trl_kernel.ChunkedLogProbFunction.apply(h, w, None, t, 1.0, 32768, None, 1.0, outputs)

    peaks(theirs_fn)  # its first backward imports trl.trainer.utils, whose module-level tensors are not the step's
    theirs = peaks(theirs_fn)
    ours = peaks(lambda h, w, t: ChunkedLogProb.apply(h, w, None, t, torch.bfloat16, outputs))
    assert theirs == ours and theirs["backward@1"] > 32768 * 64 * 4  # the fp32 LM-head gradient is in it


def test_the_full_logits_log_probs_allocate_what_trls_own_function_allocates(monkeypatch):
    """trl.kernels.logprob_entropy._LogProbEntropyFunction itself (what ORPO / CPO's selective_log_softmax runs on
    CUDA), on fake tensors: its Triton kernels write into the buffers it allocates, so with them stubbed (triton
    is not installed on a CPU build) its forward and backward hold the same bytes as the builder's mirror."""
    pytest.importorskip("trl")
    import importlib
    import sys
    from unittest import mock

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramlab.core.kinds import Phase
    from vramlab.core.objectives.orpo_cpo.reference import LogProbEntropy
    from vramlab.core.simulation.tracker import MemoryTracker

    if importlib.util.find_spec("triton") is None:  # the kernels are stubbed anyway: only the module must import
        monkeypatch.setitem(sys.modules, "triton", mock.MagicMock())
        monkeypatch.setitem(sys.modules, "triton.language", mock.MagicMock())
        monkeypatch.delitem(sys.modules, "trl.kernels.logprob_entropy", raising=False)
    trl_kernel = importlib.import_module("trl.kernels.logprob_entropy")
    monkeypatch.setitem(sys.modules, "trl.kernels.logprob_entropy", trl_kernel)  # gone again after the test

    class NoKernel:  # kernel[grid](...): writes in place, allocates nothing, keeps no reference to its arguments
        def __getitem__(self, grid: object) -> object:
            return lambda *a, **k: None

    monkeypatch.setattr(trl_kernel, "_forward_kernel", NoKernel())
    monkeypatch.setattr(trl_kernel, "_backward_kernel", NoKernel())

    def peaks(fn) -> dict[str, int]:  # noqa: ANN001
        tracker = MemoryTracker()
        with FakeTensorMode(), tracker:
            logits = torch.empty(4, 20, 1000, dtype=torch.bfloat16, requires_grad=True)
            labels = torch.empty(4, 19, dtype=torch.long)
            tracker.set_phase(Phase.FORWARD, 1)
            logprobs = fn(logits[:, :-1, :], labels)
            loss = (logprobs * 2.0).sum()
            tracker.set_phase(Phase.BACKWARD, 1)
            loss.backward()
        return {k: rec.total_bytes for k, rec in tracker.phase_peaks.items()}

    theirs = peaks(lambda x, t: trl_kernel.selective_log_softmax_and_entropy(x, t)[0])
    ours = peaks(lambda x, t: LogProbEntropy.apply(x, t)[0])
    assert theirs == ours and theirs["backward@1"] > 2 * 4 * 19 * 1000 * 2  # a logits-sized gradient and zeros


def test_the_kv_cache_at_the_last_token_is_transformers_dynamic_cache():
    """At the generation peak of a long completion: every layer's keys and values for prompt + completion - 1
    tokens (DynamicLayer.update's torch.cat), and the old keys of the layer being updated beside them."""
    import dataclasses

    spec = dataclasses.replace(FAMILIES["llama"], vocab_size=64)
    rows, seq, completion = 8, 400, 300
    setup = TrainingSetup(objective="grpo", method="lora", micro_batch=rows, num_generations=8, seq_len=seq,
                          completion_len=completion)
    gen = next(p for p in estimate(spec, setup).phases if p.key == "generate@1")
    per_token_layer = rows * spec.num_kv_heads * spec.head_dim * 2  # bf16 keys (or values) of one layer
    cache = 2 * spec.num_layers * per_token_layer * (seq - 1)
    assert gen.components[Kind.KV_CACHE] == cache + per_token_layer * (seq - 2)


def test_kto_config_is_read(tmp_path):
    from vramlab.core.sources.training import read_training_configs

    kto = tmp_path / "kto.yaml"
    kto.write_text("per_device_train_batch_size: 4\ndesirable_weight: 1.0\nmax_length: 512\nuse_peft: true\n")
    s = TrainingSetup(**read_training_configs([kto]).changes)
    assert (s.objective.value, s.seq_len, s.micro_batch, s.reference_mode.value) == ("kto", 512, 4, "adapters")


def test_an_objective_under_autocast_with_checkpointing_says_the_weight_cache_is_left_out() -> None:
    """SFT models autocast's weight cache held to the end of the forward; the objectives' forwards do not
    yet: never silently (fp32 weights, bf16 autocast, checkpointing)."""
    model = find_model("tinyllama-1.1b")
    dpo = TrainingSetup(objective="dpo", weights="fp32", grad_ckpt=True, seq_len=256)
    assert any("weight cache" in w for w in dpo.warnings(model))
    assert not any("weight cache" in w for w in dpo.replace(grad_ckpt=False).warnings(model))
    assert not any("weight cache" in w for w in dpo.replace(objective="sft").warnings(model))


# ---- the units ------------------------------------------------------------------------------------------------

def test_every_objective_has_one_unit_with_its_pieces():
    """core/objectives/registry.py is the one table: every Objective is answered by exactly one folder, whose
    program has a PROGRAM and whose reference (all but SFT's, the simulation's own step) a STEP."""
    from vramlab.core.objectives import piece, unit
    from vramlab.core.objectives.registry import UNITS
    from vramlab.core.objectives.shared.program import ObjectiveProgram
    from vramlab.core.objectives.shared.reference import ReferenceStep
    from vramlab.core.spec.options import Objective

    answered = [o for u in UNITS for o in u.objectives]
    assert sorted(answered) == sorted(Objective)
    for objective in Objective:
        assert issubclass(piece(objective, "program").PROGRAM, ObjectiveProgram)
        reference = piece(objective, "reference")
        if objective is Objective.SFT:
            assert reference is None and unit(objective).name == "sft"
        else:
            assert issubclass(reference.STEP, ReferenceStep)


def test_an_objective_program_imports_no_torch():
    """The estimator-only build runs every objective's program without torch: importing them in a fresh
    interpreter leaves torch unimported (the references are never reached)."""
    import subprocess
    import sys

    code = ("import sys; from vramlab.core.objectives import piece; from vramlab.core.spec.options import Objective;"
            "[piece(o, 'program') for o in Objective]; from vramlab.core.estimator import record_tape;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
