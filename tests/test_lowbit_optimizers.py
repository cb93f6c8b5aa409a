"""torchao's low-bit AdamW (``adamw_torch_8bit`` / ``adamw_torch_4bit``, transformers' names; ``adamw_torchao_fp8``)
and bitsandbytes' ``paged_adamw_32bit`` (issue 29, item 5).

torchao 0.18.0 keeps each state block-wise quantized from 4096 elements when the block divides the tensor (codes,
an fp32 scale per block and, 8- and 4-bit, a map of its own per state), else ``zeros_like(p)``: held here to
torchao's own ``_new_buffer`` on the CPU, for the estimator's layout and the reference's. The estimate equals the
builder's step under fake tensors and transformers' classes within the 8 KiB the reference tests allow.
"""

from __future__ import annotations

import pytest
import torch

from vramlab.core.estimate import estimate
from vramlab.core.estimator.engine import DTYPE_SIZE, Storage
from vramlab.core.estimator.optimizer import size_dependent_states
from vramlab.core.estimator.poly import Poly
from vramlab.core.kinds import Kind
from vramlab.core.simulation.optim import SizeDependentAdam
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Optimizer
from vramlab.core.spec.training import TrainingSetup

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=1000)
TORCHAO = [Optimizer.TORCHAO_ADAMW_8BIT, Optimizer.TORCHAO_ADAMW_4BIT, Optimizer.TORCHAO_ADAMW_FP8]
# (shape, dtype): quantized (bf16 and fp32), below the 4096 threshold, and 4096-plus not divisible by the block
SHAPES = [((512, 256), torch.bfloat16), ((64, 64), torch.float32), ((100,), torch.float32), ((4160,), torch.bfloat16),
          ((4097,), torch.float32)]
_DT = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _torchao_bytes(opt: Optimizer, p: torch.Tensor) -> int:
    ao = pytest.importorskip("torchao.optim")
    cls = {Optimizer.TORCHAO_ADAMW_8BIT: ao.AdamW8bit, Optimizer.TORCHAO_ADAMW_4BIT: ao.AdamW4bit,
           Optimizer.TORCHAO_ADAMW_FP8: ao.AdamWFp8}[opt]
    real = cls([torch.nn.Parameter(p)])
    total = 0
    for signed in (True, False):  # exp_avg, exp_avg_sq (AdamBase.step)
        buf = real._new_buffer(p, signed)
        names = getattr(buf, "tensor_attrs", None)
        total += sum(getattr(buf, n).nbytes for n in names) if names else buf.nbytes
    return total


@pytest.mark.parametrize("opt", TORCHAO, ids=lambda o: o.value)
@pytest.mark.parametrize("shape,dtype", SHAPES, ids=str)
def test_state_layout_is_torchaos_own(opt, shape, dtype):
    p = torch.zeros(shape, dtype=dtype)
    want = _torchao_bytes(opt, p)
    h = Storage(Poly.of(0), Kind.WEIGHTS, True)
    h.numel, h.dtype = p.numel(), _DT[dtype]
    ours = sum(int(Poly.of(n).generic()) * DTYPE_SIZE[dt] for n, dt, _ in size_dependent_states(opt, h, h.dtype))
    assert ours == want
    ref = SizeDependentAdam([torch.nn.Parameter(p)], opt)._states(p)
    assert sum(t.nbytes for t in ref) == want


@pytest.mark.parametrize("opt", [*TORCHAO, Optimizer.PAGED_ADAMW_32BIT], ids=lambda o: o.value)
@pytest.mark.parametrize("method", ["full", "lora"])
def test_estimate_equals_the_measured_step(opt, method):
    setup = TrainingSetup(method=method, optimizer=opt, lora_targets="all-linear")
    from vramlab.core.simulation.simulate import simulate

    est = estimate(LLAMA, setup, match_simulation=True)
    sim = simulate(LLAMA, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert est.components.get(Kind.OPTIMIZER_STATES) == sim.components.get(Kind.OPTIMIZER_STATES)
    assert est.setup.resolved()["optimizer_impl"] == opt.library
    if method == "full":
        pytest.importorskip("peft")
        hf = simulate(LLAMA, setup, hf=True)
        assert abs(hf.peak_allocated_bytes - est.peak_allocated_bytes) <= 8 * 1024


def test_low_bit_states_are_smaller_and_paged_states_leave_the_allocator():
    full = {o: estimate(LLAMA, TrainingSetup(optimizer=o)).components.get(Kind.OPTIMIZER_STATES, 0)
            for o in (Optimizer.ADAMW, *TORCHAO, Optimizer.PAGED_ADAMW_32BIT)}
    assert full[Optimizer.TORCHAO_ADAMW_4BIT] < full[Optimizer.TORCHAO_ADAMW_8BIT] < full[Optimizer.ADAMW]
    paged = estimate(LLAMA, TrainingSetup(optimizer=Optimizer.PAGED_ADAMW_32BIT))
    assert full[Optimizer.PAGED_ADAMW_32BIT] < full[Optimizer.ADAMW]  # the embedding's fp32 states are managed
    # tensors of 1e5 elements or more: the embedding, the untied head and the MLP's three matrices per layer
    h = LLAMA.hidden_size
    large = 2 * LLAMA.vocab_size * h + 3 * LLAMA.num_layers * h * LLAMA.intermediate_size
    assert [o.bytes for o in paged.overheads if o.name.startswith("Paged")] == [2 * 4 * large]


def test_configs_name_them(capsys, tmp_path):
    from vramlab.core.sources.training import read_training_configs

    for text, want in (("base_model: x\noptimizer: ao_adamw_fp8\n", "adamw_torchao_fp8"),
                       ("model_name_or_path: x\nstage: sft\nfinetuning_type: lora\noptim: adamw_torch_4bit\n",
                        "adamw_torch_4bit"),
                       ("model_name_or_path: x\nstage: sft\nfinetuning_type: full\noptim: paged_adamw_32bit\n",
                        "paged_adamw_32bit")):
        path = tmp_path / "run.yaml"
        path.write_text(text)
        assert read_training_configs([path]).changes["optimizer"] == want
