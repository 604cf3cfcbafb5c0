"""Agreement inferred from the records (analysis/reports/numerics_claims.py), on generated programs:
ranks that read equal inputs into an op those inputs fix must get equal outputs — so a replicated
forward with one rank's random state, or one rank's argument, changed is found where it changes,
with its cause; ranks that ran their own data are "not checked", never "no divergence"; kernels
that need not give equal bits, a rank's own arguments, and per-rank seeding on every rank, are not
called divergent; a
module left in eval() on one rank is named by what its ops show."""

from __future__ import annotations

import random

import pytest

from distnb.analysis.reports.numerics import EvalMode, compare_numerics
from distnb.wire.record_types import InputRead, NumericsRecord, OpRecord, OutputStats

RANKS = [0, 1, 2, 3]
OPS = ["aten.mm.default", "aten.add.Tensor", "aten.relu.default", "aten.mul.Tensor", "aten.native_dropout.default"]


def _fp(value: object) -> tuple[int, float]:
    h = hash(("fp", value)) & 0xFFFFFFFF
    return h, float(h % 1000) / 7.0


def _program(rng: random.Random, n: int) -> list[tuple[str, bool]]:
    """(op, determined) per op: a few ops whose kernel need not give equal bits (atomics on a GPU)."""
    return [(rng.choice(OPS), rng.random() > 0.15) for _ in range(n)]


def _records(program: list[tuple[str, bool]], *, own_data: bool = False, seed_per_rank: bool = False,
             rng_odd: tuple[int, int] | None = None, args_odd: tuple[int, int] | None = None,
             noise: bool = False) -> dict[int, NumericsRecord]:
    """Each rank runs ``program`` on a chain of values: the same start on every rank (a replicated
    forward) unless ``own_data``; a random op's output depends on the rank's generator state, the
    same on every rank unless ``seed_per_rank``; ``rng_odd``/``args_odd`` (position, rank) give that
    rank another state or argument there; ``noise`` makes every undetermined op's bits differ per
    rank (as atomics may)."""
    per_rank: dict[int, NumericsRecord] = {}
    for r in RANKS:
        value: object = ("data", r) if own_data else "data"
        state: object = ("seed", r) if seed_per_rank else "seed"
        ops = []
        for i, (name, determined) in enumerate(program):
            random_op = "dropout" in name
            args = "a1" if (args_odd and args_odd == (i, r)) else "a0"
            gen = ("other", r) if (rng_odd and rng_odd == (i, r)) else state
            h, total = _fp(value)
            inputs = [InputRead(0, h, total, None, "", None, i - 1, (), 4, total * 1.5)]
            value = (name, value, args, gen if random_op else None, r if (noise and not determined) else None)
            oh, ototal = _fp(value)
            if random_op:
                state = (gen, "drawn")  # drawing moves the state on
            ops.append(OpRecord(i, name, "model.layer", "fwd", 3, 10 + i, None, "", [OutputStats((4,), "float32", oh, ototal)],
                                inputs, args, random_op, False, determined, (hash(gen) & 0xFFFF) | 1 if random_op else 0))
        per_rank[r] = {"mode": "ops", "ops": ops, "total": len(ops), "limit": 20000}
    return per_rank


@pytest.mark.parametrize("seed", range(30))
def test_a_healthy_replicated_forward_is_checked_and_agrees(seed: int) -> None:
    rng = random.Random(seed)
    program = _program(rng, rng.randrange(3, 40))
    report = compare_numerics(1, _records(program, noise=True))
    assert report.first is None and report.departure is None, report.text()
    # Checked up to the first op whose bits need not agree (after it, inputs differ per rank).
    first_loose = next((i for i, (_, det) in enumerate(program) if not det), len(program))
    assert report.checked == first_loose, report.text()
    assert ("no divergence" in report.text()) == bool(first_loose)


@pytest.mark.parametrize("seed", range(15))
def test_ranks_that_ran_their_own_data_are_not_checked_and_never_told_no_divergence(seed: int) -> None:
    rng = random.Random(100 + seed)
    report = compare_numerics(1, _records(_program(rng, rng.randrange(3, 30)), own_data=True))
    assert report.first is None and report.checked == 0, report.text()
    assert "not checked" in report.text() and "no divergence" not in report.text()


@pytest.mark.parametrize("seed", range(30))
def test_one_ranks_random_state_is_found_at_the_random_op_it_changes(seed: int) -> None:
    rng = random.Random(200 + seed)
    program = [(name, True) for name, _ in _program(rng, rng.randrange(3, 30))]
    pos = rng.randrange(len(program))
    program[pos] = ("aten.native_dropout.default", True)
    culprit = rng.choice(RANKS)
    report = compare_numerics(1, _records(program, rng_odd=(pos, culprit)))
    d = report.first
    assert d is not None and d.position == pos and d.odd == [culprit] and d.rng_apart == [culprit], report.text()
    assert d.inputs_agreed and d.args_agreed and d.group == RANKS
    assert f"rank {culprit} drew from another random generator state" in report.text()


@pytest.mark.parametrize("seed", range(20))
def test_one_ranks_own_argument_is_its_code_not_a_divergence_and_the_others_stay_checked(seed: int) -> None:
    # x * (rank == 0): code passes a rank's own scalars on purpose; from there on, that rank's values
    # are its own, and the other ranks are still held to each other.
    rng = random.Random(300 + seed)
    program = [(name, True) for name, _ in _program(rng, rng.randrange(3, 30))]
    pos, culprit = rng.randrange(len(program)), rng.choice(RANKS)
    report = compare_numerics(1, _records(program, args_odd=(pos, culprit)))
    assert report.first is None and report.checked == len(program), report.text()
    others = tuple(r for r in RANKS if r != culprit)
    # The same program with one of the others changed after it is found among them.
    if pos + 1 < len(program) and "dropout" not in program[pos + 1][0]:
        per_rank = _records(program, args_odd=(pos, culprit))
        victim = others[0]
        op = per_rank[victim]["ops"][pos + 1]
        per_rank[victim]["ops"][pos + 1] = op._replace(outputs=[op.outputs[0]._replace(hash=op.outputs[0].hash ^ 1)])
        d = compare_numerics(1, per_rank).first
        assert d is not None and d.position == pos + 1 and tuple(d.group) == others and d.odd == [victim]


def test_a_kernel_that_need_not_give_equal_bits_is_not_called_divergent() -> None:
    program = [("aten.mm.default", True), ("aten.index_add.default", False), ("aten.relu.default", True)]
    report = compare_numerics(1, _records(program, noise=True))
    assert report.first is None and report.checked == 1, report.text()


def test_inputs_equal_but_for_their_order_are_not_equal_inputs() -> None:
    # (mesh == rank).nonzero(): each rank's mask holds one True, so the xor and the sum of the masks
    # are equal on every rank; only where the True lies differs, and so do nonzero's outputs.
    per_rank: dict[int, NumericsRecord] = {}
    for r in RANKS:
        mask = InputRead(0, 1, 1.0, None, "", None, -1, (), 64, 1.0 + r / 64)
        per_rank[r] = {"mode": "ops", "ops": [OpRecord(0, "aten.nonzero.default", "", "", 3, 1, None, "",
                                                       [OutputStats((1, 1), "int64", r, float(r))], [mask], "0", False, False, True)],
                       "total": 1, "limit": 20000}
    report = compare_numerics(1, per_rank)
    assert report.first is None and report.checked == 0, report.text()
    # A record without the order (an older one) infers nothing from its inputs.
    for rec in per_rank.values():
        op = rec["ops"][0]
        rec["ops"][0] = op._replace(inputs=[op.inputs[0]._replace(order=float("nan"), total=1.0)])
    assert compare_numerics(1, per_rank).checked == 0


def test_every_rank_seeded_its_own_way_is_not_a_divergence() -> None:
    program = [("aten.mm.default", True), ("aten.native_dropout.default", True), ("aten.relu.default", True)]
    report = compare_numerics(1, _records(program, seed_per_rank=True))
    assert report.first is None and report.checked == 1, report.text()
    # Two ranks seeded alike against two others: no majority to blame, so only each pair is held.
    per_rank = _records(program, seed_per_rank=True)
    for r in (1, 3):
        twin = per_rank[r - 1]["ops"][1]
        per_rank[r]["ops"][1] = twin._replace(seq=1)
        per_rank[r]["ops"][2] = per_rank[r - 1]["ops"][2]
    report = compare_numerics(1, per_rank)
    assert report.first is None, report.text()


def _module_ops(rank: int, names: list[str], *, buffer: bool = True) -> list[OpRecord]:
    ops = []
    for i, name in enumerate(names):
        label = "buffer model.norm.num_batches_tracked" if name == "aten.add_.Tensor" and buffer else None
        agree = (0, 1, 2, 3) if label else None
        ops.append(OpRecord(i, name, "model.norm", "fwd", 3, 8, agree, "DDP buffer" if agree else "",
                            [OutputStats((4,), "float32", i, float(i))], [InputRead(0, 7, 1.0, agree, "DDP buffer", label, -1, (), 4, 2.0)],
                            "0", False, False, True))
    return ops


@pytest.mark.parametrize("odd", RANKS)
@pytest.mark.parametrize("traced", [False, True])
def test_batch_norm_left_in_eval_on_one_rank_is_the_first_divergence_with_its_mode(odd: int, traced: bool) -> None:
    # Eager runs native_batch_norm either way (the mode is an argument), counting batches in training;
    # a traced graph runs another op without training.
    bn_train, bn_eval = (("aten._native_batch_norm_legit_functional.default", "aten._native_batch_norm_legit_no_training.default")
                         if traced else ("aten.native_batch_norm.default", "aten.native_batch_norm.default"))
    train = ["aten.mm.default", "aten.add_.Tensor", bn_train, "aten.relu.default"]
    evaluated = ["aten.mm.default", bn_eval, "aten.relu.default"]
    per_rank: dict[int, NumericsRecord] = {
        r: {"mode": "ops", "ops": _module_ops(r, evaluated if r == odd else train), "total": 4, "limit": 20000} for r in RANKS}
    report = compare_numerics(1, per_rank)
    lead = report.departure
    assert lead is not None and lead.rank == odd and lead.mode == EvalMode(odd, "model.norm", "batch norm"), report.text()
    first_line = report.text().splitlines()[1]
    assert first_line.startswith("first divergence: the ranks' ops part") and f"eval() mode on rank {odd}" in first_line


def test_dropout_not_run_on_one_rank_is_its_eval_mode() -> None:
    train = ["aten.mm.default", "aten.bernoulli_.float", "aten.div_.Scalar", "aten.mul.Tensor", "aten.relu.default"]
    per_rank: dict[int, NumericsRecord] = {
        r: {"mode": "ops", "ops": _module_ops(r, [n for n in train if r != 2 or not n.startswith(("aten.bernoulli", "aten.div_"))]), "total": 3, "limit": 20000}
        for r in RANKS}
    report = compare_numerics(1, per_rank)
    assert report.departure is not None and report.departure.mode == EvalMode(2, "model.norm", "dropout"), report.text()
    assert "its dropout did not run there" in report.text()


def test_ops_only_rank_0_runs_are_other_code_not_a_divergence_unless_they_write_what_ranks_share() -> None:
    common = ["aten.mm.default", "aten.relu.default"]
    per_rank: dict[int, NumericsRecord] = {
        r: {"mode": "ops", "ops": _module_ops(r, common + (["aten.linalg_vector_norm.default"] if r == 0 else []), buffer=False),
            "total": 3, "limit": 20000} for r in RANKS}
    report = compare_numerics(1, per_rank)
    assert report.departure is None and "first divergence" not in report.text(), report.text()
    assert "ops are compared where they match" in report.text()
    # The same rank-0-only code writing a shared buffer in place parts the ranks' values.
    per_rank = {r: {"mode": "ops", "ops": _module_ops(r, common + (["aten.add_.Tensor"] if r == 0 else [])), "total": 3,
                    "limit": 20000} for r in RANKS}
    report = compare_numerics(1, per_rank)
    assert report.departure is not None and report.departure.writes_shared, report.text()
    assert "It writes a tensor these ranks must hold the same" in report.text()
