"""What each setup of the accuracy matrix (tests/support/matrix.py) is held to, in both modes of the estimate: the
one choice of reference that tests/test_accuracy.py asserts and benchmarks/accuracy_matrix.py measures.

* Simulation mode (``estimate(..., match_simulation=True)``) is held to the simulation of the step the estimate
  models: the built-in builder where the hand-written program answers, transformers' own classes (+ peft) under
  fake tensors where the estimate replays a trace of them (Mixtral's fused experts with LoRA on them, which
  transformers' bitsandbytes quantizer leaves in 16 bits, while the builder would quantize them).
* CUDA mode (the default estimate) is held to the same simulation, run with torch's SDPA math kernel forced where
  CUDA runs that kernel (fp32 grouped-query attention under torch 2.13, core/sdpa.py): the CPU's simulation runs a
  fused kernel there. What remains apart are the two CUDA mechanisms of engine.Engine, bounded by
  :func:`cuda_bounds`.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramlab.core.estimate import estimate
from vramlab.core.result import MemoryResult
from vramlab.core.sdpa import MATH, tape_kernel
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup


@dataclass(frozen=True)
class Held:
    """Both estimates of a setup, each beside the simulation it is held to."""

    estimate: MemoryResult  # simulation mode
    simulation: MemoryResult
    cuda_estimate: MemoryResult  # CUDA mode
    cuda_simulation: MemoryResult  # ``simulation`` itself unless CUDA runs another attention kernel
    reference: str  # which simulation, in words: "builder" or "transformers", "+ SDPA math (CUDA)"


def held(spec: ModelSpec, setup: TrainingSetup) -> Held:
    est = estimate(spec, setup, match_simulation=True)
    # the estimate's own source says which step it models: a traced tape is held to transformers' classes
    hf = est.source.startswith("traced")
    sim = simulate(spec, setup, hf=hf)
    cuda_sim, reference = sim, "transformers" if hf else "builder"
    if tape_kernel(spec, setup, simulation=False) == MATH:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            cuda_sim = simulate(spec, setup, hf=hf)
        reference += " + SDPA math (CUDA)"
    return Held(est, sim, estimate(spec, setup), cuda_sim, reference)


def cuda_bounds(spec: ModelSpec, setup: TrainingSetup, simulated_peak: int) -> tuple[int, int]:
    """How far the CUDA estimate's tensor peak may sit from the simulation it is held to, (below, above) in bytes.
    In place, a second gradient into an input buffer or .grad allocates nothing; out of place (the simulation,
    under a dispatch mode) it allocates one more tensor of that gradient for a moment, so the CUDA peak sits below
    the simulated one by at most the largest gradient that is accumulated: the tied embedding's or the residual
    stream's (fp32 at most). fp32 LayerNorm statistics on CUDA are the only thing it adds."""
    transient = 4 * spec.hidden_size * max(spec.vocab_size, setup.micro_batch * setup.seq_len)
    return -transient, int(0.001 * simulated_peak)


def managed(result: MemoryResult) -> int:
    """What lives outside torch's allocator: paged optimizer states in CUDA managed memory."""
    return sum(o.bytes for o in result.overheads if o.name.startswith("Paged optimizer states"))


def beyond_tolerance(spec: ModelSpec, setup: TrainingSetup, h: Held) -> list[str]:
    """Where ``h`` breaks what tests/test_accuracy.py holds, in bytes (empty when it holds): the simulation-mode
    estimate equal to its simulation in total, per category, per phase, in its peak's phase and in managed memory;
    the CUDA estimate within :func:`cuda_bounds` of its own."""
    est, sim = h.estimate, h.simulation
    out = [f"simulation mode {k}: {e:,} B, simulated {s:,} B"
           for k, e, s in [("tensor peak", est.peak_allocated_bytes, sim.peak_allocated_bytes),
                           ("managed", managed(est), managed(sim))] if e != s]
    out += [f"simulation mode {k}: {est.components.get(k, 0):,} B, simulated {sim.components.get(k, 0):,} B"
            for k in sorted(set(est.components) | set(sim.components), key=str)
            if est.components.get(k, 0) != sim.components.get(k, 0)]
    sp, ep = {p.key: p.bytes for p in sim.phases}, {p.key: p.bytes for p in est.phases}
    out += [f"simulation mode phase {k}: {ep.get(k, 0):,} B, simulated {sp.get(k, 0):,} B"
            for k in sorted(set(sp) | set(ep), key=str) if ep.get(k, 0) != sp.get(k, 0)]
    if est.peak_phase != sim.peak_phase:
        out.append(f"simulation mode peak phase: {est.peak_phase}, simulated {sim.peak_phase}")
    below, above = cuda_bounds(spec, setup, h.cuda_simulation.peak_allocated_bytes)
    diff = h.cuda_estimate.peak_allocated_bytes - h.cuda_simulation.peak_allocated_bytes
    if not below <= diff <= above:
        out.append(f"CUDA mode tensor peak {diff:+,} B from the simulation, allowed {below:+,} to {above:+,} B")
    return out


__all__ = ["Held", "beyond_tolerance", "cuda_bounds", "held", "managed"]
