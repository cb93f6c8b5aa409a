"""GRPO on the symbolic engine: TRL 1.16.0's ``GRPOTrainer`` (generation with transformers' ``generate``, or
vLLM's token ids; old-policy and reference scoring; the clipped ratio loss), replayed after
:mod:`vramlab.core.objectives.grpo.reference`.

The one shortcut: ``transformers.generate`` makes a forward per completion token whose allocations grow
monotonically with the cache, so the replay runs the prefill, then sets every layer's cache, the ids and the
attention mask to their size before the last token, and runs the last decode step exactly: the peak of
generation is in that step (or in the prefill), and the simulation, which runs every token, checks it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vramlab.core.estimator.engine import Storage
from vramlab.core.estimator.program import Dims, Model
from vramlab.core.estimator.shard import replayed_layers
from vramlab.core.kinds import Kind, Phase
from vramlab.core.objectives.shared.program import ObjectiveProgram, hand_back, inputs_set
from vramlab.core.objectives.shared.trl import GRPO_OUTPUTS, REF_OUTPUTS, generates_before, needs_old_logps
from vramlab.core.spec.options import GenerationBackend, Reference, Sharding


class GrpoProgram(ObjectiveProgram):
    """Generation and scoring once per optimizer step (:meth:`prepare`), the policy's step per micro-batch."""

    divides_loss = False  # GRPOTrainer normalises its loss itself: Trainer does not divide it by the accumulation
    collates = False  # its data loader yields prompts (host data): its micro-batches are the generation buffer's

    def prepares_before(self, i: int) -> bool:
        return generates_before(self.setup, i)

    def prepare(self, step: int) -> None:
        setup, ops, engine = self.setup, self.ops, self.engine
        rows = setup.micro_batch * setup.generation_steps
        old_buffer, old_images = self.buffer, self.images
        if setup.generation_backend is GenerationBackend.TRANSFORMERS:
            engine.set_phase(Phase.GENERATE, step)
            gen = self.generate(rows)
        else:
            p, c = setup.prompt_tokens, setup.completion_tokens
            gen = {"prompt_ids": ops.new(rows * (p + self.image_tokens), "i64", Kind.INPUTS),
                   "prompt_mask": ops.new(rows * (p + self.image_tokens), "i64", Kind.INPUTS),
                   "completion_ids": ops.new(rows * c, "i64", Kind.INPUTS),
                   "completion_mask": ops.new(rows * c, "i64", Kind.INPUTS),
                   "advantages": ops.new(rows, "f32", Kind.INPUTS)}
        images, held = self.image_inputs(rows)
        mode = setup.reference_mode
        old = needs_old_logps(setup)
        if old or mode is not Reference.NONE:
            engine.set_phase(Phase.REFERENCE, step)
        with self.no_grad():
            if old:
                gen["old"] = self.score(self.m, gen, GRPO_OUTPUTS, images)
            if mode is Reference.ADAPTERS:
                with self.adapters_off(self.m):
                    gen["ref"] = self.score(self.m, gen, GRPO_OUTPUTS, images)
            elif mode is Reference.COPY:
                gen["ref"] = self.score(self.ref, gen, REF_OUTPUTS, images)
        ops.drop(*held)  # (reference.GrpoStep.prepare)
        per = None
        if images is not None:  # unsplit_pixel_values_by_grid: each micro-batch's pixel inputs a copy (a per-token
            # input a view: the split keeps the whole)
            per = [self.buffered(images, setup.generation_steps) for _ in range(setup.generation_steps)]
        self.buffer, self.images = gen, per
        if old_buffer is not None:
            ops.drop(*old_buffer.values())
        for inputs in old_images or ():
            self.drop_inputs(inputs)
        if images is not None:
            self.drop_inputs(images)

    # ---- a vision-language model's inputs beside the ids (its step model's make_inputs) ------------------------
    images: list[dict] | None = None  # per micro-batch

    def __init__(self, sm, ref_sm=None) -> None:  # noqa: ANN001 - StepModels
        super().__init__(sm, ref_sm)
        self.input_names: set[str] = set()  # what the step model's make_inputs sets

    @property
    def vision(self) -> bool:
        """A vision-language model's step (core/families/vlm_base/program.py): its batch holds pixel inputs."""
        return getattr(self.sm, "vm", None) is not None

    @property
    def image_tokens(self) -> int:
        """The image placeholders in each prompt."""
        return self.m.tokens.llm_tokens if self.vision else 0

    @property
    def sm_per_token(self) -> tuple[str, ...]:
        """The step model's inputs that hold a value per token (Gemma's token types), not per image."""
        return getattr(self.sm, "per_token_inputs", ())

    def capture(self, d: Dims) -> dict:
        """The step model's ``make_inputs(d)``: what it sets, taken as a batch of inputs to hand back later."""
        _, (got,) = inputs_set([self.sm], lambda: self.sm.make_inputs(d), self.input_names)
        self.input_names |= got.keys()
        return got

    def use(self, inputs: dict, sm=None) -> None:  # noqa: ANN001 - a StepModel
        hand_back([sm or self.sm], [inputs])

    def rows_of(self, inputs: dict, b: int, rows: int) -> dict:
        """Views of ``b`` of the ``rows`` samples' inputs (every sample holds the same images)."""
        return {k: self.engine.view(v, v.numel * b // rows) if isinstance(v, Storage) else
                (v * b // rows if isinstance(v, int) else v) for k, v in inputs.items()}

    def buffered(self, images: dict, steps: int) -> dict:
        """One micro-batch's share of the generation batch's inputs as ``_prepare_inputs`` buffers it:
        ``unsplit_pixel_values_by_grid``'s copy of its pixel inputs, a view of a per-token input."""
        out = {}
        for k, v in images.items():
            if not isinstance(v, Storage):
                out[k] = v // steps if isinstance(v, int) else v  # a count of images
            elif k in self.sm_per_token:
                out[k] = self.engine.view(v, v.numel // steps)
            else:
                out[k] = self.ops.new(v.numel // steps, v.dtype, Kind.INPUTS)
        return out

    def drop_inputs(self, inputs: dict) -> None:
        self.ops.drop(*(v for v in inputs.values() if isinstance(v, Storage)))

    def image_inputs(self, rows: int) -> tuple[dict | None, list[Storage]]:
        """``forward_kwargs`` (reference.image_inputs): the processor's ids and mask over the prompts (held,
        returned second) and its pixel inputs; a per-token input extended over the completion."""
        if not self.vision:
            return None, []
        ops, setup = self.ops, self.setup
        p = setup.prompt_tokens + self.image_tokens
        held = [ops.new(rows * p, "i64", Kind.INPUTS), ops.new(rows * p, "i64", Kind.INPUTS)]
        images = self.capture(Dims(rows, p, rows > 1))
        for k in self.sm_per_token:
            if images.get(k) is not None:
                t = images[k]
                zeros = ops.new(rows * setup.completion_tokens, t.dtype, Kind.INPUTS)
                images[k] = ops.new(rows * (p + setup.completion_tokens), t.dtype, Kind.INPUTS)
                ops.drop(zeros, t)
        return images, held

    def _kv_hook(self, caches: dict):  # noqa: ANN202
        ops, engine = self.ops, self.engine

        def update(L: dict, k: Storage, v: Storage) -> tuple[Storage, Storage]:
            old_k, old_v = caches.get(id(L), (None, None))
            engine.region, prev = Kind.KV_CACHE, engine.region
            nk = ops.new((old_k.numel if old_k is not None else 0) + k.numel, k.dtype)
            ops.drop(old_k)
            nv = ops.new((old_v.numel if old_v is not None else 0) + v.numel, v.dtype)
            ops.drop(old_v)
            engine.region = prev
            caches[id(L)] = (nk, nv)
            ops.drop(k, v)
            return ops.ref(nk), ops.ref(nv)

        return update

    def generate(self, rows: int) -> dict[str, Storage]:
        ops, engine, setup, m, sm = self.ops, self.engine, self.setup, self.m, self.sm
        p, c = setup.prompt_tokens + self.image_tokens, setup.completion_tokens
        V, hid = m.spec.vocab_size, m.spec.hidden_size
        ids = ops.new(rows * p, "i64", Kind.INPUTS)
        attn = ops.new(rows * p, "i64", Kind.INPUTS)
        images = self.capture(Dims(rows, p, rows > 1)) if self.vision else None  # the prefill's
        release = getattr(sm, "release_outputs", None)
        off = getattr(sm, "checkpointing_off", None)  # eval mode: no checkpointing
        caches: dict[int, tuple[Storage, Storage]] = {}
        sh = m.sh if m.sh is not None and m.sh.mode is Sharding.ZERO3 else None
        if sh is not None:  # ds3_gather_for_generation (reference.generate)
            sh.gather_all(replayed_layers(m.plan, m.spec.num_layers))
        m.kv = self._kv_hook(caches)
        m.training, amp = False, m.amp
        m.amp = False
        old_grad, engine.grad_enabled = engine.grad_enabled, False
        step_ids = ops.ref(ids)
        next_logits = probs = None
        length = p  # tokens in ids
        iterations = list(range(c))
        if c >= 3:
            iterations = [0, c - 1]
        for i in iterations:
            if i == c - 1 and c >= 3:  # the cache, ids and mask as they are before the last token
                length = p + c - 1
                for tag, L in enumerate(m.layers):
                    engine.tag = tag
                    ok, ov = caches[id(L)]
                    per_tok_k, per_tok_v = int(ok.numel) // p, int(ov.numel) // p
                    engine.region, prev = Kind.KV_CACHE, engine.region
                    nk = ops.new(per_tok_k * (p + c - 2), ok.dtype)
                    ops.drop(ok)
                    nv = ops.new(per_tok_v * (p + c - 2), ov.dtype)
                    ops.drop(ov)
                    engine.region = prev
                    caches[id(L)] = (nk, nv)
                engine.tag = -1
                new_ids = ops.new(rows * length, "i64", Kind.INPUTS)
                ops.drop(ids)
                ids = new_ids
                new_attn = ops.new(rows * length, "i64", Kind.INPUTS)
                ops.drop(attn)
                attn = new_attn
                ops.drop(step_ids)
                step_ids = engine.view(ids, rows)
            s = p if i == 0 else 1
            d = Dims(rows, s, rows > 1)
            with off() if off is not None else contextlib.nullcontext(), self.decoding(i > 0, d):
                h = sm.backbone(step_ids, d, checkpointing=False)
            last = engine.view(h, rows * hid)
            logits = m.linear(m.head, last, rows)
            ops.drop(last, h)
            ones = ops.new(rows, "i64", Kind.INPUTS)
            new_attn = ops.new(rows * (length + 1), "i64", Kind.INPUTS)
            ops.drop(ones, attn)
            attn = new_attn
            nl = ops.new(rows * V, "f32")
            ops.drop(next_logits)
            next_logits = nl
            pr = ops.new(rows * V, "f32")
            ops.drop(probs)
            probs = pr
            tokens = ops.new(rows, "i64")
            new_ids = ops.new(rows * (length + 1), "i64", Kind.INPUTS)
            ids_old, ids = ids, new_ids
            ops.drop(tokens, logits)
            if release is not None:  # `del outputs`: the tower's outputs with them
                release()
            length += 1
            ops.drop(step_ids)  # the view of the previous ids: they go now
            ops.drop(ids_old)
            step_ids = engine.view(ids, rows)
        ops.drop(next_logits, probs, step_ids)
        engine.grad_enabled = old_grad
        m.kv = None
        m.training, m.amp = True, amp
        for tag, L in enumerate(m.layers):
            engine.tag = tag
            ops.drop(*caches.pop(id(L)))
        engine.tag = -1
        if sh is not None:  # generate returns, then the gathered parameters are released
            sh.release_all()
        if images is not None:  # generate_inputs
            self.drop_inputs(images)
        out = {"completion_ids": ops.new(rows * c, "i64", Kind.INPUTS),
               "prompt_ids": ops.new(rows * p, "i64", Kind.INPUTS)}
        out["prompt_mask"] = ops.new(rows * p, "i64", Kind.INPUTS)
        out["completion_mask"] = ops.new(rows * c, "i64", Kind.INPUTS)
        out["advantages"] = ops.new(rows, "f32", Kind.INPUTS)
        ops.drop(ids, attn)
        return out

    @contextlib.contextmanager
    def decoding(self, on: bool, d: Dims) -> Iterator[None]:
        """A decoding step of a vision-language model: the prompts' images were the prefill's; this forward
        reads the cache and the new token only (no pixel inputs)."""
        if not (on and self.vision):
            yield
            return
        vm = self.sm.vm
        tokens, vm.tokens = vm.tokens, type(vm.tokens)()
        inputs = self.capture(d)
        try:
            yield
        finally:
            vm.tokens = tokens
            self.drop_inputs(inputs)  # (a per-token input the family makes for any batch: not the class's here)

    def score(self, model: Model, gen: dict[str, Storage], outputs: tuple[str, ...], images: dict | None) -> Storage:
        ops, setup = self.ops, self.setup
        rows_all = setup.micro_batch * setup.generation_steps
        s, c, b = setup.seq_len + self.image_tokens, setup.completion_tokens, setup.micro_batch
        sm = self.sm if model is self.m else self.ref_sm
        ids = ops.new(rows_all * s, "i64")
        attn = ops.new(rows_all * s, "i64")
        kept = []
        out = loss = None
        for _start in range(0, rows_all, b):
            idb = self.engine.view(ids, b * s)
            labels = self.labels(idb)
            chunk = None
            if images is not None:
                chunk = self.rows_of(images, b, rows_all)
                self.use(chunk, sm)
            new_out, new_loss = self.log_probs(model, idb, Dims(b, s, b > 1), b * c, outputs, grad=False)
            if out is not None:
                ops.drop(*out, loss)
            out, loss = new_out, new_loss
            kept.append(self.engine.view(out[0], b * c))
            ops.drop(labels, idb)
            if chunk is not None:
                self.drop_inputs(chunk)
        ops.drop(*out)
        result = ops.new(rows_all * c, "f32", Kind.INPUTS)
        ops.drop(*kept, ids, attn, loss)
        return result

    def loss(self, step: int, i: int, d: Dims) -> tuple[Storage, list[Storage]]:
        ops, engine, setup, m = self.ops, self.engine, self.setup, self.m
        b, s, c = setup.micro_batch, setup.seq_len + self.image_tokens, setup.completion_tokens
        buf = self.buffer
        views = {k: engine.view(v, b * (c if k != "advantages" else 1)) for k, v in buf.items()}
        if self.images is not None:  # views: the buffer keeps them to the next generation
            self.use(self.rows_of(self.images[i % setup.generation_steps], 1, 1))
        ids = ops.new(b * s, "i64")
        attn = ops.new(b * s, "i64")
        labels = self.labels(ids)
        d = Dims(b, s, b > 1)
        out, head_loss = self.log_probs(m, ids, d, b * c, GRPO_OUTPUTS, grad=True)
        cats = []
        for x in out[:2]:
            v = engine.view(x, b * c)
            engine.node(v, [(x, ops.gbytes(x))])  # [:, -c:]: slice_backward makes zeros of x's size
            y = ops.new(b * c, "f32")
            engine.node(y, [(v, 0)])  # torch.cat of one tensor: a copy, backward a view
            ops.drop(v)
            cats.append(y)
        per, ent = cats
        ops.drop(*out, head_loss, labels)
        old = views.get("old")
        if old is None:
            old = engine.view(per, rg=False)  # per_token_logps.detach()
        log_ratio = self.sub(per, old)
        coef_1 = ops.unary(log_ratio, save_output=True)
        ops.drop(log_ratio)
        beta = setup.beta_value
        kl = None
        if beta != 0.0:
            ref = views["ref"]
            d1 = self.sub(ref, per)
            e = ops.unary(d1, save_output=True)
            ops.drop(d1)
            d2 = self.sub(ref, per)
            t = self.sub(e, d2)
            ops.drop(e, d2)
            kl = self.scalar_op(t, through=True)
            ops.drop(t)
        nb = b * c * 4
        coef_2 = ops.new(b * c, "f32")
        engine.node(coef_2, [(coef_1, nb)], [coef_1])
        adv = views["advantages"]
        l1 = ops.mul(coef_1, adv)
        l2 = ops.mul(coef_2, adv)
        mn = ops.new(b * c, "f32")
        engine.node(mn, [(l1, nb), (l2, nb)], [l1, l2])
        ptl = self.scalar_op(mn)
        ops.drop(mn, l1, l2)
        if kl is not None:
            bk = self.scalar_op(kl)
            p2 = ops.add(ptl, bk)
            ops.drop(ptl, bk)
            ptl = p2
        msum = ops.new(1, "i64")
        norm = ops.new(1, "f32")
        ops.drop(msum)
        mask = views["completion_mask"]
        prod = ops.mul(ptl, mask)
        sm_ = self.reduce(prod, 1)
        loss = ops.new(1, "f32")
        engine.node(loss, [(sm_, 4)], [norm])
        ops.drop(sm_, prod, norm, ptl, coef_1, coef_2, kl, old, per, ent)
        ops.drop(ids, attn)
        return loss, list(views.values())

PROGRAM = GrpoProgram
