"""The switches of a run: method, dtypes, optimizer, attention kernel, sharding, offload, loss kernel and
objective, as string enums (they serialise as themselves), with the facts each one implies."""

from __future__ import annotations

from enum import StrEnum


class Method(StrEnum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"
    FREEZE = "freeze"


class DType(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"
    NF4 = "nf4"

    @property
    def is_float(self) -> bool:
        return self in (DType.FP32, DType.BF16, DType.FP16)

    @property
    def is_quantized(self) -> bool:
        return self in (DType.INT8, DType.NF4)

    @property
    def itemsize(self) -> int:
        """Bytes per element for float dtypes (quantized storage is computed by the estimator)."""
        return _ITEMSIZE.get(self._value_, 0)


_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}  # DType.itemsize by value (a dict of members hashed each)
FLOAT_DTYPES = (DType.FP32, DType.BF16, DType.FP16)


class Optimizer(StrEnum):
    ADAMW = "adamw"
    ADAMW_8BIT = "adamw8bit"
    PAGED_ADAMW_8BIT = "paged_adamw8bit"
    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"
    ADAFACTOR = "adafactor"
    LION = "lion"
    # bitsandbytes 0.50.2 PagedAdamW32bit (transformers' paged_adamw_32bit): fp32 states, paged from 100k elements
    PAGED_ADAMW_32BIT = "paged_adamw_32bit"
    # torchao 0.18.0 torchao.optim AdamW8bit / AdamW4bit (transformers' adamw_torch_8bit / adamw_torch_4bit) and
    # AdamWFp8: block-wise quantized states for tensors of at least 4096 elements, a step compiled by torch.compile
    TORCHAO_ADAMW_8BIT = "adamw_torch_8bit"
    TORCHAO_ADAMW_4BIT = "adamw_torch_4bit"
    TORCHAO_ADAMW_FP8 = "adamw_torchao_fp8"

    @property
    def is_8bit(self) -> bool:
        return self in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)

    @property
    def is_torchao(self) -> bool:
        return self in (Optimizer.TORCHAO_ADAMW_8BIT, Optimizer.TORCHAO_ADAMW_4BIT, Optimizer.TORCHAO_ADAMW_FP8)

    @property
    def library(self) -> str:
        """Whose kernels step it: torch, bitsandbytes or torchao."""
        if self.is_torchao:
            return "torchao"
        return "bitsandbytes" if self.is_8bit or self is Optimizer.PAGED_ADAMW_32BIT else "torch"

    @property
    def has_impl_choice(self) -> bool:
        """torch's foreach / fused / single-tensor choice applies (bitsandbytes and torchao have their own)."""
        return self.library == "torch"

    @property
    def size_dependent_state(self) -> bool:
        """The state's layout depends on each tensor's size (quantized or paged from a threshold)."""
        return not self.has_impl_choice

    @property
    def is_bitsandbytes(self) -> bool:
        """One of bitsandbytes' optimizers (its own kernels, per-tensor state rules)."""
        return self.library == "bitsandbytes"

    @property
    def is_paged(self) -> bool:
        """Large states in CUDA managed memory (outside torch's allocator)."""
        return self in (Optimizer.PAGED_ADAMW_8BIT, Optimizer.PAGED_ADAMW_32BIT)


class OptimizerImpl(StrEnum):
    FOREACH = "foreach"
    FUSED = "fused"
    SINGLE = "single"


class Attention(StrEnum):
    SDPA = "sdpa"  # torch scaled_dot_product_attention: flash / memory-efficient kernels
    EAGER = "eager"  # HF eager attention: materialised b x heads x s x s scores

    @classmethod
    def parse(cls, text: str) -> Attention:
        if isinstance(text, Attention):
            return text
        aliases = {"flash": "sdpa", "flash_attention_2": "sdpa", "fa2": "sdpa", "math": "eager"}
        return cls(aliases.get(text.lower(), text.lower()))


class Sharding(StrEnum):
    NONE = "none"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    FSDP = "fsdp"

    @property
    def shards_params(self) -> bool:
        return self in (Sharding.ZERO3, Sharding.FSDP)


class LossKernel(StrEnum):
    """The kernel that turns the last hidden states into the loss (core/simulation/loss.py)."""

    HF = "hf"  # lm_head + transformers' ForCausalLMLoss (or its chunked form: chunked_loss)
    CCE = "cce"  # Cut Cross Entropy 25.1.1 (axolotl's cut_cross_entropy): no logits, an fp32 log-sum-exp per token
    TRL = "trl"  # TRL 1.16.0's fused LM head (SFTTrainer's loss): 4096 x 32768 tiles, fp32 statistics and gradients
    LIGER = "liger"  # Liger Kernel 0.8.5's fused linear cross-entropy: logits a chunk at a time, gradients in forward


def liger_chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """The tokens of one logits tile of Liger's fused linear cross-entropy (liger-kernel 0.8.5,
    ``fused_linear_cross_entropy_forward`` with its default ``chunk_mem_const`` 1): a tile of about tokens x hidden
    elements, ``next_power_of_2(cdiv(tokens, cdiv(vocab, hidden)))`` rows, never more than ``tokens``."""
    rows = -(-tokens // -(-vocab // hidden))
    return min(1 << (rows - 1).bit_length(), tokens)


class Offload(StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"
    PARAMS = "params"  # parameters and optimizer (ZeRO-3 / FSDP CPU offload)


class ActivationOffload(StrEnum):
    """Saved tensors moved to host memory in forward, back in backward (core/simulation/act_offload.py)."""

    NONE = "none"
    TRL = "trl"  # TRL 1.16.0's activation_offloading: its OffloadActivations with CUDA streams
    AXOLOTL = "axolotl"  # axolotl 0.19.0's activation_offloading on an adapter run: TRL's hooks, axolotl's patches


class Objective(StrEnum):
    """What the step optimises, as TRL 1.16.0 runs it (see docs/levels.md, "Objectives")."""

    SFT = "sft"  # next-token cross entropy (HF Trainer / TRL SFTTrainer)
    DPO = "dpo"  # DPOTrainer, loss_type sigmoid: policy + reference over chosen and rejected, concatenated
    IPO = "ipo"  # DPOTrainer with loss_type ipo: the same step, another loss on per-sequence log-probs
    KTO = "kto"  # KTOTrainer: unpaired completions plus mismatched KL completions
    ORPO = "orpo"  # trl.experimental.orpo: no reference, full logits
    SIMPO = "simpo"  # trl.experimental.cpo with loss_type simpo: no reference, full logits
    CPO = "cpo"  # trl.experimental.cpo: no reference, full logits
    GRPO = "grpo"  # GRPOTrainer: generation, then the policy step over prompt + completion

    @property
    def preference(self) -> bool:
        return self in (Objective.DPO, Objective.IPO, Objective.KTO)

    @property
    def no_reference(self) -> bool:
        """ORPO / SimPO / CPO: TRL's trl.experimental trainers with no reference model (NO_REFERENCE_OBJECTIVES)."""
        return self in NO_REFERENCE_OBJECTIVES


class Reference(StrEnum):
    """Where the reference log-probabilities come from."""

    COPY = "copy"  # a second, frozen model (TRL's default for full fine-tuning)
    ADAPTERS = "adapters"  # the policy with its LoRA adapters disabled (TRL's default with peft): no second copy
    PRECOMPUTED = "precomputed"  # precompute_ref_log_probs=True: nothing during training
    NONE = "none"  # GRPO with beta = 0: no reference at all


class GenerationBackend(StrEnum):
    TRANSFORMERS = "transformers"  # model.generate with a DynamicCache on the training GPU
    VLLM_COLOCATE = "vllm-colocate"  # vLLM in the training process: a share of the device
    VLLM_SERVER = "vllm-server"  # vLLM on other GPUs: nothing on the training GPU


# Objectives not modelled (refused with a reason): none left since ORPO / SimPO / CPO are.
UNMODELLED_OBJECTIVES: tuple[Objective, ...] = ()
# TRL 1.16.0's trl.experimental ORPOTrainer / CPOTrainer (SimPO is CPOTrainer with loss_type "simpo"): no reference
# model, ``concatenated_forward`` with the full (2 x micro batch x sequence x vocabulary) logits.
NO_REFERENCE_OBJECTIVES = (Objective.ORPO, Objective.SIMPO, Objective.CPO)
OBJECTIVE_BOUNDS: dict[str, tuple[int, int]] = {
    "completion_len": (1, 2**20),
    "num_generations": (1, 4096),
    "steps_per_generation": (1, 1_048_576),
    "num_iterations": (1, 1024),
}
