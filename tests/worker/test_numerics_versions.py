"""The numerics record follows a tensor written in place (worker/torch_hooks/numerics.py).

torch bumps a tensor's version in its ADInplaceOrView kernel after the dispatch mode's kernel
returns: read inside the mode, an in-place op's output is one version behind. The record read it
there, so the next op that read the tensor took it for one written by an unrecorded op: it lost
which op wrote it (``producer``) and fingerprinted it again.
"""

from __future__ import annotations

import random

import torch

from distnb.worker.torch_hooks import numerics


def _record(program: object) -> dict:
    reply = numerics.run_with_numerics(lambda: {"status": "ok", "value": program()}, "ops", {})  # type: ignore[operator]
    assert "error" not in reply["numerics"], reply["numerics"]
    return reply["numerics"]


def test_a_tensor_written_in_place_keeps_the_op_that_wrote_it() -> None:
    def program() -> None:
        x = torch.ones(8)
        x.mul_(2)  # in place: the next reads see its output
        y = x + 1
        x.add_(y)
        (x * y).sum()

    ones, mul, add, add_, last = (_record(program)["ops"])[:5]
    assert (mul.op, add.op, add_.op, last.op) == ("aten.mul_.Tensor", "aten.add.Tensor", "aten.add_.Tensor", "aten.mul.Tensor")
    assert [i.producer for i in add.inputs] == [mul.seq]
    assert [i.producer for i in add_.inputs] == [mul.seq, add.seq]
    assert [i.producer for i in last.inputs] == [add_.seq, add.seq]


def _chain(steps: list[str]) -> None:
    x = torch.randn(16, generator=torch.Generator().manual_seed(1))
    for name in steps:
        getattr(x, name)(1.5) if name != "clamp_" else x.clamp_(-1, 1)
    torch.neg(x)


def test_random_in_place_chains_name_their_writers_and_fingerprint_each_value_once(monkeypatch) -> None:
    rng = random.Random(7)
    real = numerics._mode_class
    calls: list[int] = []

    def counting() -> type:
        cls = real()
        fp = cls._fp

        def _fp(self, t):  # type: ignore[no-untyped-def]
            calls.append(t._version)
            return fp(self, t)
        cls._fp = _fp
        return cls

    monkeypatch.setattr(numerics, "_mode_class", counting)
    for _ in range(30):
        steps = [rng.choice(["mul_", "add_", "sub_", "div_", "clamp_"]) for _ in range(rng.randint(1, 6))]
        calls.clear()
        ops = _record(lambda: _chain(steps))  # noqa: B023  (called at once, in this iteration)
        ops = ops["ops"]
        written = [op for op in ops if op.op.split(".")[1] in steps]
        assert len(written) == len(steps), (steps, [op.op for op in ops])
        neg = ops[-1]
        assert neg.op == "aten.neg.default" and neg.inputs[0].producer == written[-1].seq, steps
        for before, after in zip(written, written[1:]):
            assert after.inputs[0].producer == before.seq, steps
        # randn's output, each in-place op's output, neg's output: once each, never again on a read
        assert len(calls) == len(steps) + 2, (steps, calls)
