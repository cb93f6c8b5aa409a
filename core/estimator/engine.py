"""A symbolic autograd engine over byte counts: the estimator's model of what lives.

It replays a training step as the sequence of tensors it creates and frees, without torch and without
data: each forward op allocates its outputs, records the tensors autograd saves for backward (saving is
conditional on which inputs require grad, as in torch's generated code), and the backward pass runs the
recorded nodes in reverse creation order the way torch's engine does: a node allocates its input
gradients and backward temporaries, frees its output gradient, releases its saved tensors, then hands
each gradient to the next node's input buffer (in place when the buffer is not shared) or to a
parameter's ``.grad``.

The engine does no accounting itself: it writes a tape of allocations, frees and reclassifications whose
sizes are polynomials in (batch, sequence, rank) (:mod:`.poly`). :mod:`.tape` evaluates a tape for
concrete sizes, rounding every block to the CUDA allocator's 512 bytes, with the same peak bookkeeping as
the dispatch tracker, so the estimate and the simulation describe the same moment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

from vramlab.core.allocator import MIN_BLOCK
from vramlab.core.estimator.poly import ZERO, Poly
from vramlab.core.kinds import PHASE_KIND, Kind, Phase, phase_key

BLOCK = MIN_BLOCK  # every block the caching allocator hands out is a multiple of it
KINDS = tuple(Kind)
KIND_INDEX = {k: i for i, k in enumerate(KINDS)}

# parameters whose gradients (and optimizer states) are the vision side's training state
VISION_PARAM_KINDS = (Kind.VISION_WEIGHTS, Kind.PROJECTOR_WEIGHTS)

DTYPE_SIZE = {"f32": 4, "bf16": 2, "f16": 2, "i64": 8, "i32": 4, "u8": 1, "i8": 1, "bool": 1}


class Storage:
    """A storage: its size (a polynomial, unrounded), kind, whether it requires grad, and references to
    it. ``numel`` and ``dtype`` describe the tensor that owns it (views share the storage through
    ``base``)."""

    __slots__ = ("nbytes", "kind", "rg", "refs", "param", "gbuf", "grad", "gbytes", "freed", "name",
                 "numel", "dtype", "base", "tag", "hid")

    def __init__(self, nbytes: Poly, kind: Kind, rg: bool, param: bool = False, gbytes: Poly | None = None,
                 name: str = "") -> None:
        self.numel: Poly = ZERO
        self.dtype = ""
        self.base: Storage | None = None
        self.nbytes = nbytes
        self.kind = kind
        self.rg = rg
        self.refs = 1
        self.param = param
        self.gbuf: Buf | None = None  # gradient waiting in this tensor's producer's input buffer
        self.grad: Storage | None = None  # parameters: .grad
        self.gbytes = nbytes if gbytes is None else gbytes  # bytes of this tensor's gradient
        self.freed = False
        self.name = name
        self.tag = -1  # parameters: the layer they belong to
        self.hid = 0  # serial number of the allocation (0: never allocated)


class Buf:
    """A gradient tensor in flight (shared when a node passes the same gradient to several inputs)."""

    __slots__ = ("h", "refs")

    def __init__(self, h: Storage) -> None:
        self.h = h
        self.refs = 1


class Grad(NamedTuple):
    """A backward step: allocate the gradient of edge ``edge`` (its bytes are the edge's)."""

    edge: int


class Temp(NamedTuple):
    """A backward step: allocate a temporary of ``nbytes`` made for edge ``edge``."""

    edge: int
    nbytes: Poly | int


class FreeTemp(NamedTuple):
    """A backward step: free edge ``edge``'s oldest temporary."""

    edge: int


class Returned(NamedTuple):
    """A backward step: the function's result for edge ``edge`` is ``numel`` elements of ``dtype`` (the output's
    shape and dtype where the input broadcast or was promoted), allocated here (``passed``: the incoming gradient
    itself, nothing allocated). When the function has returned, the engine hands it to autograd's
    ``validate_outputs``, edge by edge: summed down to the input's shape (a new tensor, in ``dtype``), then cast to
    the input's dtype (another), each freeing the one before (:meth:`Engine.validate`)."""

    edge: int
    numel: Poly | int
    dtype: str
    passed: bool = False


Step = Grad | Temp | FreeTemp | Returned


class Node:
    """One autograd node: gradient edges to its inputs, saved tensors, backward temporaries."""

    __slots__ = ("out", "edges", "saved", "prog", "kind", "special", "tag", "recomputed")

    def __init__(self, out: Storage, edges: list[tuple[Storage, Poly]], saved: list[Storage],
                 prog: tuple[Step, ...] | None, kind: Kind, special: object = None, tag: int = -1) -> None:
        self.tag = tag
        self.out = out
        self.edges = edges  # (input, gradient bytes to allocate; 0 = pass the incoming gradient through)
        self.saved = saved
        # Order of allocations inside the backward kernel (Grad, Temp, FreeTemp steps). Steps of edges whose
        # input does not require grad are skipped. None: every edge's gradient, in order.
        self.prog = prog
        self.kind = kind
        self.special = special  # a callable run instead of the plain gradient rule (checkpointing)
        self.recomputed = False  # made by a non-reentrant recompute: its saved tensors go when the function returns


class Engine:
    """``match_simulation``: reproduce the fake-tensor simulation on the CPU rather than a CUDA run. Two
    differences are known, both small: while a TorchDispatchMode is active torch treats every tensor as a
    subclass and adds a second gradient into an input buffer out of place (one extra gradient-sized
    transient) instead of in place; and the CPU kernels keep LayerNorm statistics in the input dtype
    where CUDA keeps them in fp32."""

    def __init__(self, match_simulation: bool = False) -> None:
        self.match_simulation = match_simulation
        self.inplace_accumulate = not match_simulation
        # the tape: (bytes, +1 alloc / -1 free / 0 reclassify, kind index, new kind index, layer tag, phase)
        self.tape: list[tuple[Poly, int, int, int, int, int]] = []
        self.hids: list[int] = []  # the allocation each tape row belongs to
        self._next_hid = 0
        self.phases: list[str] = []
        self._ph = -1  # the index of the current phase in ``phases``
        self.phase = Phase.LOAD
        self.step = 0
        self.tag = -1  # the layer the current events belong to (-1: none)
        self.nodes: list[Node] = []
        self.bkind: Kind | None = None  # kind of allocations made by a labelled backward node
        self.region: Kind | None = None
        self.node_kind: Kind | None = None  # kind of what new nodes allocate in backward (the loss chain)
        self.grad_enabled = True
        # transformers' checkpoints: torch.utils.checkpoint's reentrant variant, or the non-reentrant one
        # (transformers 5's default), which stops its recompute at the last tensor the region saves
        self.ckpt_reentrant = True
        self.ckpt_offload = False  # the checkpointed layers' inputs in host memory (checkpoint_backward's offloaded)
        self.unsloth_gc = None  # Unsloth's checkpoint function's state (core/estimator/unsloth_gc.py)
        # while a non-reentrant recompute runs: (tape length, saves an input, out) per saving node, and every
        # storage allocated
        self._node_marks: list[tuple[int, bool, Storage, int]] | None = None
        self._allocated: list[Storage] | None = None
        self.grad_hook = None  # called with a parameter after its gradient is accumulated
        # per backward task: parameter -> [gradients still expected, gradient gathered so far]
        self._tasks: list[dict[int, list]] = []

    # ---- the tape -----------------------------------------------------------------------------------
    def set_phase(self, phase: Phase, step: int = 0) -> None:
        self.phase, self.step = phase, step
        self.phases.append(phase_key(phase, step))
        self._ph = len(self.phases) - 1
        self.tape.append((ZERO, 1, 0, 0, -1, self._ph))  # marks the level at the phase's start
        self.hids.append(0)

    # ---- tensors ------------------------------------------------------------------------------------
    def alloc(self, nbytes: Poly | int, kind: Kind | None = None, rg: bool = False, gbytes: Poly | None = None,
              name: str = "") -> Storage:
        kind = self.region or kind or self.bkind or PHASE_KIND[self.phase]
        n = nbytes if nbytes.__class__ is Poly else Poly.of(nbytes)
        h = Storage(n, kind, rg, False, gbytes, name)
        if n:  # the row written inline: an MoE step allocates some 17,000 times
            self._next_hid = hid = self._next_hid + 1
            h.hid = hid
            self.tape.append((n, 1, KIND_INDEX[kind], 0, self.tag, self._ph))
            self.hids.append(hid)
            if self._allocated is not None:
                self._allocated.append(h)
        return h

    def param(self, nbytes: Poly | int, kind: Kind, rg: bool) -> Storage:
        """A parameter or buffer (alive for the whole run)."""
        h = self.alloc(nbytes, kind, rg)
        h.param = True
        h.tag = self.tag
        return h

    def ref(self, h: Storage) -> Storage:
        h.refs += 1
        return h

    def drop(self, h: Storage | None) -> None:
        # a loop, not a recursion: a chain of views (an MoE layer's index_add_ per expert) can be thousands long
        while h is not None and not h.param:
            h.refs -= 1
            if h.refs or h.freed:
                return
            h.freed = True
            if h.nbytes:  # the row written inline, as in alloc
                self.tape.append((h.nbytes, -1, KIND_INDEX[h.kind], 0, self.tag, self._ph))
                self.hids.append(h.hid)
            h = h.base

    def view(self, h: Storage, numel: int | None = None, rg: bool | None = None) -> Storage:
        """A new tensor identity over ``h``'s storage (no bytes); it keeps ``h`` alive."""
        v = Storage(ZERO, h.kind, h.rg if rg is None else rg)
        v.numel, v.dtype = (h.numel if numel is None else numel), h.dtype
        v.base = self.ref(h)
        return v

    @contextlib.contextmanager
    def in_region(self, kind: Kind) -> Iterator[None]:
        """Everything allocated inside is of ``kind`` (the builder's ``context.region``)."""
        old, self.region = self.region, kind
        try:
            yield
        finally:
            self.region = old

    def reclassify(self, h: Storage, kind: Kind) -> None:
        if h.kind is kind:
            return
        if h.nbytes:
            self.tape.append((h.nbytes, 0, KIND_INDEX[h.kind], KIND_INDEX[kind], self.tag, self._ph))
            self.hids.append(0)
        h.kind = kind

    # ---- autograd -----------------------------------------------------------------------------------
    def node(self, out: Storage, edges: list[tuple[Storage, int]], saved: list[Storage] = (),
             prog: tuple[Step, ...] | None = None, special: object = None) -> bool:
        """Record the node producing ``out``. ``edges``: inputs with the bytes their gradient allocates
        (0: the incoming gradient is passed through); edges of inputs that do not require grad are
        dropped, and ``prog`` refers to the remaining ones by position in ``edges``. Saved tensors are
        referenced. Returns whether a node was recorded (some input requires grad)."""
        keep = [i for i, (h, _) in enumerate(edges) if h.rg] if self.grad_enabled else []
        if not keep:
            out.rg = False
            return False
        out.rg = True
        for h in saved:
            h.refs += 1
        if len(keep) == len(edges):  # every edge kept: positions and prog stay as given
            live = list(edges)
        else:
            live = [edges[i] for i in keep]
            if prog is not None:
                remap = {old: new for new, old in enumerate(keep)}
                prog = tuple(step._replace(edge=remap[step.edge]) for step in prog if step.edge in remap)
        self.nodes.append(Node(out, live, list(saved), prog, self.node_kind or Kind.TEMPORARIES, special,
                               self.tag))
        self.nodes[-1].recomputed = self._node_marks is not None
        if self._node_marks is not None and saved:  # a pack: of an input before the output exists, else after
            # the tape's length, whether it saves an input, its output, the nodes up to and with it
            self._node_marks.append((len(self.tape), any(h is not out for h in saved), out, len(self.nodes)))
        return True

    def backward(self, loss: Storage, stop_at: int = 0, grad_hook=None) -> None:  # noqa: ANN001
        """Run the recorded nodes from the last down to index ``stop_at``; the loss's gradient first."""
        self.grad_hook = grad_hook
        ones = self.alloc(loss.nbytes)  # torch.autograd.backward holds grad_tensors until it returns
        ones.refs += 1
        loss.gbuf = Buf(ones)
        self.push_task(stop_at)
        while len(self.nodes) > stop_at:
            node = self.nodes.pop()
            self.run_node(node)
        self.pop_task()
        self.drop(ones)

    def push_task(self, start: int) -> None:
        """Start a backward graph task over nodes[start:]: a parameter used by several of its nodes
        (tied weights) gathers all its gradients before AccumulateGrad runs."""
        uses: dict[int, list] = {}
        for node in self.nodes[start:]:
            for h, _g in node.edges:
                if h.param:
                    entry = uses.get(id(h))
                    if entry is None:
                        uses[id(h)] = [1, None]
                    else:
                        entry[0] += 1
        self._tasks.append({k: v for k, v in uses.items() if v[0] > 1})

    def pop_task(self) -> None:
        self._tasks.pop()

    def run_node(self, node: Node) -> None:
        old_tag, self.tag = self.tag, node.tag
        try:
            self._run_node(node)
        finally:
            self.tag = old_tag

    def _run_node(self, node: Node) -> None:
        out = node.out
        buf = out.gbuf
        out.gbuf = None
        if node.special is not None and buf is None and getattr(node.special, "gathers", False):
            node.special(self, node, None)
            return
        if buf is None:  # nothing flowed here
            for h in node.saved:
                self.drop(h)
            return
        if node.special is not None:
            node.special(self, node, buf)
            return
        prev = self.bkind
        if node.kind is not Kind.TEMPORARIES:
            self.bkind = node.kind
        grads: list[Storage | None] = [None] * len(node.edges)
        returned: list[Returned] = []
        if node.prog is None:
            for i, (_h, g) in enumerate(node.edges):
                if g:
                    grads[i] = self.alloc(g)
        else:
            temps: dict[int, list[Storage]] = {}
            for step in node.prog:
                if isinstance(step, Grad):
                    g = node.edges[step.edge][1]
                    if g:
                        grads[step.edge] = self.alloc(g)
                elif isinstance(step, Temp):
                    temps.setdefault(step.edge, []).append(self.alloc(step.nbytes))
                elif isinstance(step, Returned):
                    if not step.passed:
                        grads[step.edge] = self.alloc(step.numel * DTYPE_SIZE[step.dtype])
                    returned.append(step)
                else:
                    self.drop(temps[step.edge].pop(0))
        # the function returns: a saved tensor a non-reentrant checkpoint recomputed goes with it (its unpack hook
        # handed the function the only reference, the holder's entry going at unpack), before validate_outputs
        if node.recomputed:
            for h in node.saved:
                self.drop(h)
            node.saved = []
        for step in sorted(returned, key=lambda r: r.edge):
            grads[step.edge] = self.validate(node.edges[step.edge], step, grads[step.edge])
        self.bkind = prev
        for g in grads:
            if g is None:
                buf.refs += 1  # passed through to this input
        self.release_gradient(buf)
        for h in node.saved:
            self.drop(h)
        for i, (h, _g) in enumerate(node.edges):
            g = grads[i]
            self.deliver(h, buf if g is None else Buf(g))

    def validate(self, edge: tuple[Storage, Poly], result: Returned, g: Storage | None) -> Storage | None:
        """autograd's ``validate_outputs`` on a function's result ``g`` for ``edge`` (None: the incoming gradient,
        passed through): ``sum_to`` the input's shape where it broadcast, then ``to`` its dtype, each a new tensor
        freeing the one before (never the incoming gradient). Returns the input's gradient (None: the incoming one)."""
        x, gbytes = edge
        if result.numel != x.numel:
            r = self.alloc(x.numel * DTYPE_SIZE[result.dtype])
            self.drop(g)
            g = r
        if result.dtype != x.dtype:
            c = self.alloc(gbytes)
            self.drop(g)
            g = c
        return g

    def checkpoint_backward(self, x: Storage, recompute: Callable[[Storage], Storage], buf: Buf,
                            node: Node, reentrant: bool | None = None, offloaded: bool = False,
                            staged: Callable[[], Storage] | None = None) -> Buf | None:
        """torch.utils.checkpoint's backward for ``node``, saved around ``x``: ``recompute`` runs the wrapped
        function again on a detached leaf of ``x`` with grad enabled, that graph is back-propagated, the saved
        inputs go, and the gradient that reached the leaf comes back (None when none did).

        Reentrant (``CheckpointFunction.backward``): the whole function runs again, its output and the incoming
        gradient are held until the recomputed graph has run as a task of its own. Non-reentrant (``reentrant``
        False, or :attr:`ckpt_reentrant`; transformers 5's default): the recompute stops at the last tensor the
        region saves (``_StopRecomputationError``; a saved input is packed before the op's output exists), so
        what the function makes after it is never allocated, and the gradients flow through the graph as it
        runs.

        ``offloaded`` (:attr:`ckpt_offload`: LLaMA-Factory's ``use_unsloth_gc``, reentrant-style): the input was kept
        in host memory, and the leaf is a new copy of it on the GPU. ``staged``: the leaf Unsloth's function
        recomputes from (core/estimator/unsloth_gc.py)."""
        reentrant = self.ckpt_reentrant if reentrant is None else reentrant
        if staged is not None:
            xd = staged()
        elif offloaded:  # hidden_states.to("cuda").detach().requires_grad_(): a copy of the input's own elements (its
            # host copy is empty_like of it), never the rest of a larger storage it is a view of (a slice of a fused
            # projection's output; under ZeRO-3 / FSDP the layer's input is the unit boundary's view of the whole)
            src = x
            while not x.dtype and not src.nbytes and src.base is not None:  # a storage written without its dtype
                src = src.base
            xd = self.alloc(x.numel * DTYPE_SIZE[x.dtype] if x.dtype else src.nbytes, rg=True)
            xd.numel, xd.dtype = x.numel, x.dtype
        else:
            xd = self.view(x, rg=True)  # detach_variable: a new leaf on the same storage
        start = len(self.nodes)
        if reentrant:
            y = recompute(xd)
            buf.refs += 1  # CheckpointFunction.backward holds its grad arguments until it returns
            y.gbuf = buf
            self.push_task(start)
        else:
            t0 = len(self.tape)
            y, last = self._recompute_until_last_save(recompute, xd)
            y.gbuf = buf
            self.push_task(start)
            # the nodes after the region's last save need no saved tensor: autograd runs them before the first
            # unpack starts the recompute, so their gradients are made first (the tape is reordered to say so)
            made = len(self.tape)
            while len(self.nodes) > max(last, start):
                self.run_node(self.nodes.pop())
            end = len(self.tape)
            self.tape[t0:end] = self.tape[made:end] + self.tape[t0:made]
            self.hids[t0:end] = self.hids[made:end] + self.hids[t0:made]
        while len(self.nodes) > start:
            self.run_node(self.nodes.pop())
        self.pop_task()
        self.drop(y)
        if reentrant:
            self.release_gradient(buf)
        gx = xd.gbuf
        xd.gbuf = None
        self.drop(xd)
        for t in node.saved:
            self.drop(t)
        return gx

    def _recompute_until_last_save(self, recompute: Callable[[Storage], Storage],
                                   xd: Storage) -> tuple[Storage, int]:
        """``recompute`` with what follows the region's last save taken off the tape: the allocations from the
        last saving op's output on (its output too, unless it saves it) never happen; those storages become
        zero-sized, so their later frees record nothing. Returns the output and the number of nodes up to the
        last saving one (the later ones run before the recompute in autograd)."""
        t0 = len(self.tape)
        outer = self._node_marks, self._allocated
        self._node_marks, self._allocated = [], []
        try:
            y = recompute(xd)
            marks, made = self._node_marks, self._allocated
        finally:
            self._node_marks, self._allocated = outer
        if not marks:
            return y, len(self.nodes)
        at, saves_input, out, index = marks[-1]
        cut = at
        if saves_input and out.hid and out.nbytes:
            cut = next((i for i in range(t0, at) if self.hids[i] == out.hid and self.tape[i][1] == 1), at)
        tail = {self.hids[i] for i in range(cut, len(self.tape)) if self.tape[i][1] == 1}
        if not tail:
            return y, index
        keep = [i for i in range(cut, len(self.tape)) if self.hids[i] not in tail]
        self.tape[cut:] = [self.tape[i] for i in keep]
        self.hids[cut:] = [self.hids[i] for i in keep]
        for h in made:
            if h.hid in tail:
                h.nbytes = ZERO
        return y, index

    def release_gradient(self, buf: Buf) -> None:
        """One holder of the gradient ``buf`` lets it go (a node that consumed it, a buffer it was summed
        into); the gradient is freed when the last one does."""
        buf.refs -= 1
        if buf.refs == 0:
            self.drop(buf.h)

    def deliver(self, h: Storage, buf: Buf) -> None:
        """Put a gradient into ``h``'s input buffer, or into a parameter's .grad (AccumulateGrad)."""
        if h.param:
            entry = self._tasks[-1].get(id(h)) if self._tasks else None
            if entry is not None:
                entry[0] -= 1
                if entry[1] is None:
                    entry[1] = buf
                else:
                    entry[1] = self._accumulate(entry[1], buf)
                if entry[0] > 0:
                    return  # AccumulateGrad waits for the parameter's other uses
                buf = entry[1]
                entry[1] = None
            self._accumulate_grad(h, buf)
            return
        if h.gbuf is None:
            h.gbuf = buf
            return
        h.gbuf = self._accumulate(h.gbuf, buf)

    def _accumulate(self, old: Buf, new: Buf) -> Buf:
        """InputBuffer::accumulate: in place into an unshared buffer, else out of place."""
        if old.refs == 1 and self.inplace_accumulate:
            self.release_gradient(new)
            return old
        summed = Buf(self.alloc(old.h.nbytes))
        self.release_gradient(new)
        self.release_gradient(old)
        return summed

    def _accumulate_grad(self, h: Storage, buf: Buf) -> None:
        """AccumulateGrad: steal an unshared gradient as .grad, else clone it; add into an existing one."""
        if h.grad is None:
            kind = Kind.VISION_TRAINING if h.kind in VISION_PARAM_KINDS else Kind.GRADIENTS
            if buf.refs == 1:
                h.grad = buf.h
                self.reclassify(buf.h, kind)
            else:
                h.grad = self.alloc(h.gbytes, kind)
                self.release_gradient(buf)
        else:
            self.release_gradient(buf)
        if self.grad_hook is not None:
            self.grad_hook(h)
