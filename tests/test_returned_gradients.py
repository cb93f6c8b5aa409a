"""What a backward function hands back, held to torch's autograd on CPU.

A product, a sum or a biased linear layer whose input broadcast or was promoted returns its gradient at the output's
shape and dtype; autograd's ``validate_outputs`` sums it to the input's shape and casts it to the input's dtype once
the function has returned, edge by edge (core/estimator/engine.py ``Returned``). The engine's backward of each op
is held to torch's own (real tensors, each storage counted at its bytes): the live bytes at every moment of the
backward pass, from the incoming gradient to the last gradient in ``.grad``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vramlab.core.estimator.engine import Engine  # noqa: E402
from vramlab.core.estimator.ops import Ops  # noqa: E402
from vramlab.core.kinds import Kind  # noqa: E402
from vramlab.core.simulation.tracker import MemoryTracker  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
ROWS, COLS = 64, 96


def _numel(shape: tuple[int, ...]) -> int:
    return shape[0] * shape[1]


def _torch(op: str, a: tuple, b: tuple) -> list[int]:
    """torch's backward of ``op`` (times 2) on leaves of shapes and dtypes ``a`` and ``b``: the live bytes before
    the loss's gradient and after each allocation and free of the backward pass."""
    tracker = MemoryTracker(block=1)
    with tracker:
        x = torch.ones(a[0], dtype=DTYPES[a[1]], requires_grad=True)
        y = torch.ones(b[0], dtype=DTYPES[b[1]], requires_grad=True)
        if op == "linear":  # y: the weight, with a bias of its rows
            bias = torch.ones(b[0][0], dtype=DTYPES[b[1]], requires_grad=True)
            out = torch.nn.functional.linear(x, y, bias)
        else:
            out = x * y if op == "mul" else x + y
        out = out * 2.0  # a gradient of its own reaches the op (not the caller's, which a leaf's .grad would clone)
        start = len(tracker.timeline) - 1
        out.backward(torch.ones_like(out))
        grads = [t.grad for t in (x, y)]
        assert all(g is not None for g in grads)
    return [live for _e, live in tracker.timeline[start:]]


def _engine(op: str, a: tuple, b: tuple) -> list[int]:
    """The engine's backward of the same: the live bytes before the loss's gradient and after each row of its
    tape."""
    engine = Engine(match_simulation=True)
    ops = Ops(engine)
    x = ops.param(_numel(a[0]), a[1], Kind.WEIGHTS, True)
    y = ops.param(_numel(b[0]), b[1], Kind.WEIGHTS, True)
    if op == "linear":
        bias = ops.param(b[0][0], b[1], Kind.WEIGHTS, True)
        out = ops.linear(x, y, bias, a[0][0], b[0][0], a[0][1])
    else:
        out = ops.mul(x, y) if op == "mul" else ops.add(x, y)
    out = ops.unary(out)
    live = sum(int(n.generic()) * sign for n, sign, *_ in engine.tape)
    start = len(engine.tape)
    engine.backward(out)
    levels = [live]
    for n, sign, *_ in engine.tape[start:]:
        live += int(n.generic()) * sign
        levels.append(live)
    return levels


FULL, COLUMN = (ROWS, COLS), (ROWS, 1)
CASES = [
    # the other operand's gradient first, then this one's, both in fp32; the 16-bit one cast when the function has
    # returned (the other's was formed after the cast before: one fp32 gradient low)
    ("mul", (FULL, "f32"), (FULL, "bf16")),
    ("mul", (FULL, "bf16"), (FULL, "f32")),
    # a broadcast operand's gradient summed to its shape after the function returns
    ("mul", (FULL, "f32"), (COLUMN, "f32")),
    ("mul", (COLUMN, "f32"), (FULL, "bf16")),
    # the sum hands the incoming gradient back: summed to the broadcast input's shape in fp32, then cast to its
    # dtype (the fp32 sum was not counted before)
    ("add", (FULL, "f32"), (COLUMN, "bf16")),
    ("add", (FULL, "bf16"), (COLUMN, "f32")),
    # addmm: the bias's gradient is the incoming one, summed to the bias's shape after both matrices' gradients
    ("linear", (FULL, "f32"), ((48, COLS), "f32")),
]


@pytest.mark.parametrize(("op", "a", "b"), CASES, ids=[f"{op}-{a[1]}{a[0]}-{b[1]}{b[0]}" for op, a, b in CASES])
def test_the_engine_hands_gradients_back_as_torch_does(op: str, a: tuple, b: tuple) -> None:
    ours, theirs = _engine(op, a, b), _torch(op, a, b)
    assert max(ours) - ours[0] == max(theirs) - theirs[0]
    assert ours[-1] - ours[0] == theirs[-1] - theirs[0]  # what stays: the gradients in .grad
