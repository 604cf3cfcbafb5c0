"""The numerics comparison on generated records: programs of random ops over 4 ranks (data-parallel
ops that may differ, ops after an all_reduce that must agree, tensor-parallel pairs), healthy ones
never claimed divergent, and a divergence or NaN injected at a random op and rank found exactly
there — variety no one picked by hand."""

from __future__ import annotations

import collections
import math
import random

import pytest

from distnb.analysis.reports.numerics import compare_numerics, rank_groups
from distnb.analysis.reports.numerics_diff import diff_runs
from distnb.wire.record_types import InputRead, NumericsRecord, OpRecord, OutputStats

RANKS = [0, 1, 2, 3]
GROUPS = {"world": (0, 1, 2, 3), "tp": None}  # tp: the rank's pair


def _pair(r: int) -> tuple[int, ...]:
    return (0, 1) if r < 2 else (2, 3)


def _program(rng: random.Random, n: int) -> list[tuple[str, str | None]]:
    """(op name, agreement: None, "world" or "tp") per op."""
    ops = []
    for i in range(n):
        agree = rng.choice([None, None, "world", "tp"]) if i else None
        ops.append((rng.choice(["aten.mm.default", "aten.add.Tensor", "aten.relu.default", "aten.mul.Tensor"]), agree))
    return ops


def _records(program: list[tuple[str, str | None]], rng: random.Random, inject: tuple[int, int, str] | None = None,
             nan: tuple[int, int] | None = None) -> dict[int, NumericsRecord]:
    """Each rank's ops: agreeing ops hold the value of their group, others the rank's own; an
    ``inject`` (position, rank, "output"|"input") makes that rank differ from there on."""
    values = [rng.random() for _ in program]
    per_rank: dict[int, NumericsRecord] = {}
    for r in RANKS:
        ops = []
        off = 0.0
        nonfinite = False
        for i, (name, kind) in enumerate(program):
            agree = None if kind is None else (GROUPS["world"] if kind == "world" else _pair(r))
            if inject and inject[1] == r and i == inject[0]:
                off = 1e-3
            if nan and nan[1] == r and i == nan[0]:
                nonfinite = True
            key = values[i] if agree else values[i] + r
            total = math.nan if nonfinite else key + (off if agree else 0.0)
            read_total = math.nan if nonfinite and not (nan and i == nan[0]) else key
            input_off = off if inject and inject[2] == "input" and inject[1] == r and i >= inject[0] else 0.0
            inputs = [InputRead(0, hash(("in", read_total + input_off if agree else read_total)) & 0xFFFF, read_total + input_off,
                                agree, "x" if agree else "", "weight" if agree else None, -1)]
            out_total = total + (input_off if agree else 0.0)
            ops.append(OpRecord(i, name, "model", "fwd", 5, 10 + i, agree, "inputs" if agree else "", [
                OutputStats((4,), "float32", hash(("out", out_total)) & 0xFFFF, out_total)], inputs, "0", False, False))
        per_rank[r] = {"mode": "ops", "ops": ops, "total": len(ops), "limit": 20000}
    return per_rank


@pytest.mark.parametrize("seed", range(40))
def test_healthy_generated_programs_are_never_claimed_divergent(seed: int) -> None:
    rng = random.Random(seed)
    program = _program(rng, rng.randrange(5, 60))
    report = compare_numerics(1, _records(program, rng))
    assert report.first is None and not report.nonfinite and not report.programs, report.text()
    # "no divergence" only where something was compared: a program with no op the ranks must agree
    # on was not checked, and says so.
    checked = sum(1 for _, kind in program if kind)
    assert report.checked == checked, report.text()
    assert ("no divergence" in report.text()) == bool(checked), report.text()
    assert report.text().splitlines()[1].startswith("not checked") == (not checked), report.text()


@pytest.mark.parametrize("seed", range(60))
def test_a_divergence_injected_at_a_random_op_and_rank_is_named_there(seed: int) -> None:
    rng = random.Random(1000 + seed)
    program = _program(rng, rng.randrange(5, 60))
    agreeing = [i for i, (_, kind) in enumerate(program) if kind]
    if not agreeing:
        agreeing = [1]
        program[1] = (program[1][0], "world")
    pos, culprit, what = rng.choice(agreeing), rng.choice(RANKS), rng.choice(["output", "input"])
    report = compare_numerics(1, _records(program, rng, inject=(pos, culprit, what)))
    d = report.first
    assert d is not None, report.text()
    assert (d.position, d.what) == (pos, what) and culprit in d.odd and d.line == 10 + pos, (pos, culprit, what, report.text())
    group = list(GROUPS["world"]) if program[pos][1] == "world" else list(_pair(culprit))
    assert d.group == group
    if len(group) > 2:
        assert d.odd == [culprit] and f"rank {culprit}" in report.text()
    else:  # one against one: nothing says which side is wrong, and the words say so
        assert d.odd == group and "no majority" in report.text()


@pytest.mark.parametrize("seed", range(20))
def test_a_nan_injected_at_a_random_op_is_born_there_and_a_collective_spreads_it(seed: int) -> None:
    rng = random.Random(5000 + seed)
    program = _program(rng, rng.randrange(6, 40))
    pos, culprit = rng.randrange(len(program) - 1), rng.choice(RANKS)
    per_rank = _records(program, rng, nan=(pos, culprit))
    # an all_reduce after it: the culprit sends NaN, every rank receives it
    coll = len(program)
    for r, rec in per_rank.items():
        bad = r == culprit
        rec["ops"].append(OpRecord(coll, "c10d.allreduce_.default", "", "bwd", 5, 99, (0, 1, 2, 3), "allreduce",
                                   [OutputStats((4,), "float32", 7, math.nan)],
                                   [InputRead(0, 3, math.nan if bad else 1.0, None, "", None, coll - 1 if bad else -1)], "0", False, True))
    report = compare_numerics(1, per_rank)
    born = [nf for nf in report.nonfinite if nf.how == "born"]
    assert [(nf.rank, nf.op.seq) for nf in born] == [(culprit, pos)], report.text()
    assert {nf.rank for nf in report.nonfinite if nf.how == "received"} == set(RANKS) - {culprit}
    assert [(s.sources, s.reached) for s in report.spreads] == [([culprit], sorted(set(RANKS) - {culprit}))]
    # NaN on one rank where ranks must agree is also where they part: never before it, always the culprit.
    d = report.first
    assert d is None or (d.position >= pos and culprit in d.odd), report.text()


def test_a_tolerance_lets_small_differences_agree_and_says_it_compared_sums() -> None:
    rng = random.Random(7)
    program = [("aten.mm.default", "world")] * 4
    per_rank = _records(program, rng, inject=(2, 3, "output"))
    assert compare_numerics(1, per_rank).first is not None
    assert compare_numerics(1, per_rank, rtol=0.0, atol=1e-2).first is None
    loose = compare_numerics(1, per_rank, atol=1e-6)
    assert loose.first is not None and loose.first.odd == [3] and "beyond the tolerance: sums and up to 16 elements compared" in loose.text()


def _one_op(values: dict[int, list[float]], sampled: int | None = None) -> dict[int, NumericsRecord]:
    """One op after an all_reduce on every rank, each rank's output holding ``values[rank]`` (the
    record keeps ``sampled`` of them, spread as the worker spreads them; all by default)."""
    per_rank: dict[int, NumericsRecord] = {}
    for r, v in values.items():
        n = len(v)
        keep = v if sampled is None or n <= sampled else [v[round(i * (n - 1) / (sampled - 1))] for i in range(sampled)]
        out = OutputStats((n,), "float64", hash(tuple(v)) & 0xFFFFFF, math.fsum(v), tuple(keep))
        per_rank[r] = {"mode": "ops", "ops": [OpRecord(0, "aten.mul.Tensor", "model", "fwd", 5, 10, tuple(values), "all_reduce",
                                                       [out], [], "0", False, False)], "total": 1, "limit": 20000}
    return per_rank


@pytest.mark.parametrize("seed", range(40))
def test_the_size_of_a_divergence_is_exact_when_every_element_was_kept_and_never_overstated(seed: int) -> None:
    """Generated outputs where one rank's differ at random elements by random amounts: the size
    said is the true max abs diff when every element was kept, and never above it otherwise (a
    lower bound: the sampled elements, or the sums' difference spread over the elements)."""
    rng = random.Random(seed)
    n = rng.choice([1, 3, 16, 17, 100, 4096])
    base = [rng.uniform(-1, 1) for _ in range(n)]
    odd = list(base)
    for i in rng.sample(range(n), rng.randint(1, n)):
        odd[i] += rng.choice([-1, 1]) * 10 ** rng.uniform(-6, 1)
    truth = max(abs(a - b) for a, b in zip(base, odd))
    values = {0: base, 1: base, 2: odd, 3: base}
    sampled = None if n <= 16 else 16
    d = compare_numerics(1, _one_op(values, sampled)).first
    assert d is not None and d.odd == [2]
    size = d.size
    assert size.exact == (n <= 16) and size.numel == n
    if size.exact:
        assert size.value == truth
        assert f"max abs diff {truth:.3g}" in compare_numerics(1, _one_op(values, sampled)).text()
    else:
        assert 0 < size.value <= truth * (1 + 1e-9), (size, truth)
        assert f"max abs diff at least {size.value:.3g}" in compare_numerics(1, _one_op(values, sampled)).text()


def test_the_size_of_a_divergence_with_nan_or_equal_infinities() -> None:
    inf, nan = math.inf, math.nan
    d = compare_numerics(1, _one_op({0: [1.0, inf], 1: [1.0, inf], 2: [1.5, inf]})).first
    loose = compare_numerics(1, _one_op({0: [1.0, inf], 1: [1.0, inf], 2: [1.5, inf]}), atol=1e-3).first
    assert loose is not None and loose.odd == [2], loose  # within a tolerance too: a non-finite sum hides no element
    assert d is not None and d.size.value == 0.5 and d.size.exact  # equal infinities are no difference
    d = compare_numerics(1, _one_op({0: [1.0, 2.0], 1: [1.0, 2.0], 2: [1.0, nan]})).first
    assert d is not None and d.odd == [2] and d.size.value == inf


def test_named_ranks_make_every_op_compared_and_rank_groups_parse() -> None:
    rng = random.Random(3)
    program = [("aten.mm.default", None)] * 3
    per_rank = _records(program, rng)
    assert compare_numerics(1, per_rank).first is None  # each rank's own data: nothing must agree
    d = compare_numerics(1, per_rank, agree=[[0, 1, 2, 3]]).first
    assert d is not None and d.position == 0 and d.why == "named"
    assert rank_groups("0,1;2,3", 4) == [[0, 1], [2, 3]] and rank_groups([0, 2], 4) == [[0, 2]] and rank_groups((), 4) == []


def test_an_extra_op_on_one_rank_is_a_program_split_and_the_rest_still_aligns() -> None:
    rng = random.Random(11)
    program = [("aten.mm.default", "world"), ("aten.add.Tensor", "world"), ("aten.relu.default", "world")]
    per_rank = _records(program, rng)
    ops = per_rank[2]["ops"]
    extra = ops[0]._replace(op="aten.mul_.Tensor", agree=None)
    per_rank[2]["ops"] = [ops[0], extra] + ops[1:]
    report = compare_numerics(1, per_rank)
    assert [(s.rank, s.how, s.position) for s in report.programs] == [(2, "extra", 1)]
    assert report.first is None and "rank 2 ran ops rank 0 did not, first aten.mul_.Tensor" in report.text()


def test_two_runs_differ_where_one_ranks_values_do() -> None:
    rng = random.Random(5)
    program = [("aten.mm.default", "world")] * 5
    a = _records(program, random.Random(1))
    b = _records(program, random.Random(1), inject=(3, 1, "output"))
    diff = diff_runs(1, a, 2, b)
    assert diff.per_rank[1] is not None and diff.per_rank[1].position == 3 and diff.per_rank[1].how == "value"
    assert all(diff.per_rank[r] is None for r in (0, 2, 3)) and "ranks 0,2,3: the same on every op recorded" in diff.text()
    assert diff_runs(1, a, 2, _records(program, random.Random(1))).identical
    del rng


def test_a_diff_of_two_runs_says_the_size_of_the_difference() -> None:
    a = _one_op({0: [1.0, 2.0, 3.0], 1: [1.0, 2.0, 3.0]})
    b = _one_op({0: [1.0, 2.0, 3.0], 1: [1.0, 2.25, 3.0]})
    diff = diff_runs(1, a, 2, b)
    d = diff.per_rank[1]
    assert d is not None and d.size is not None and d.size.value == 0.25 and d.size.exact
    assert "rank 1: max abs diff 0.25, all 3 elements compared; sum 6 against 6.25" in diff.text(), diff.text()
    # Within a tolerance the sampled elements are compared too, not only the sums.
    b_same_sum = _one_op({0: [1.0, 2.0, 3.0], 1: [1.5, 1.5, 3.0]})
    assert diff_runs(1, a, 2, b_same_sum, atol=1e-3).per_rank[1] is not None
    assert diff_runs(1, a, 2, b_same_sum, atol=1.0).per_rank[1] is None


@pytest.mark.parametrize("seed", range(60))
def test_a_run_whose_ops_are_fused_is_compared_on_the_ops_both_made(seed: int) -> None:
    """Eager against compiled: run B made a random subset of run A's ops (the rest fused), calling
    some by another overload (``addmm.out`` for ``addmm.default``); from a random op on, one rank's
    values differ. The diff names that op (numbered in both runs) on that rank, or, when the op
    changed was one B fused away, the next op both made."""
    rng = random.Random(seed)
    names = [rng.choice(["aten.mm.default", "aten.gelu.default", "aten.add.Tensor", "aten.addmm.default"]) for _ in range(12)]
    program = [(n, "world") for n in names]
    changed, rank = rng.randrange(12), rng.randrange(4)
    a = _records(program, random.Random(seed))
    b = _records(program, random.Random(seed), inject=(changed, rank, "output"))
    kept = sorted(rng.sample(range(12), rng.randrange(4, 11)))

    def as_in_a_model(ops: list[OpRecord]) -> list[OpRecord]:
        # A matmul reads its layer's weight; an activation reads no named tensor; shapes as layers have them.
        return [o._replace(outputs=[o.outputs[0]._replace(shape=(4, 8 * (1 + i % 3)))],
                           inputs=[o.inputs[0]._replace(label=f"layers.{i}.weight" if "mm" in o.op else None)]) for i, o in enumerate(ops)]
    for recs in (a, b):
        for r in recs:
            recs[r]["ops"] = as_in_a_model(recs[r]["ops"])
    for r in b:
        b[r]["ops"] = [b[r]["ops"][i]._replace(op=b[r]["ops"][i].op.replace(".default", ".out")) for i in kept]
    diff = diff_runs(1, a, 2, b)
    prefix = kept == list(range(len(kept)))  # B made A's first ops, in order: compared one to one
    # Otherwise compared: the ops whose (op, shape, weight read) is unique in each run.
    key = {i: (names[i].split(".")[1], i % 3, i if "mm" in names[i] else None) for i in range(12)}
    in_a, in_b = collections.Counter(key.values()), collections.Counter(key[i] for i in kept)
    compared = [i for i in kept if prefix or (in_a[key[i]] == 1 and in_b[key[i]] == 1)]
    first = next((i for i in compared if i >= changed), None)
    for r in range(4):
        d = diff.per_rank[r]
        if r != rank or first is None:
            assert d is None or d.how in ("op", "ended"), (r, d)  # nothing differs among the ops compared: no claim
            continue
        assert d is not None and d.how == "value" and d.position == first, (kept, changed, d)
        if prefix:
            assert d.position_b is None and "Likely" not in diff.text()
        else:
            assert d.position_b == kept.index(first), (kept, changed, d)
            assert f"first difference at op #{first} of cell 1 (#{kept.index(first)} of cell 2)" in diff.text()
            assert "Likely, not certain: the two runs' ops had parted before it" in diff.text()


def test_the_html_table_highlights_the_odd_rank_and_the_plot_draws() -> None:
    from distnb.display.html import numerics_html

    program = [("aten.mm.default", "world")] * 6
    report = compare_numerics(4, _records(program, random.Random(2), inject=(3, 1, "output")))
    page = numerics_html(report)
    assert "first divergence among ranks 0-3" in page and "background:#ffebe9" in page and "rank 3" in page
    rows = report.table(around=1)
    assert [r["position"] for r in rows] == [2, 3, 4] and rows[1]["odd"] == [1] and rows[1]["divergence"]
    assert report.plot() is not None


def test_a_nan_from_an_op_with_more_inputs_than_are_read_is_only_likely_born_there() -> None:
    reads = [InputRead(k, 1, 1.0, None, "", None, -1) for k in range(8)]
    op = OpRecord(0, "aten._foreach_add.List", "", "step", 5, 3, None, "", [OutputStats((2,), "float32", 1, math.nan)], reads, "0", False, False)
    report = compare_numerics(5, {0: {"mode": "ops", "ops": [op], "total": 1, "limit": 20000}})
    assert [nf.certain for nf in report.nonfinite] == [False] and "NaN likely born on rank 0" in report.text()


def test_nan_on_every_rank_where_they_must_agree_is_not_a_divergence_of_different_values() -> None:
    """Every rank's all_reduce output holds NaN (its payload and so its fingerprint vary with the
    reduction's order; each rank's NaN is its own float, as read off the wire): they agree on
    non-finite, and where the NaN was born is the non-finite analysis's answer — not "no majority,
    4 different values (rank 0 sum nan; rank 1 sum nan; …)"."""
    per_rank: dict[int, NumericsRecord] = {}
    for r in RANKS:
        born = r == 1
        ops = [OpRecord(0, "aten.div.Tensor", "model.pool", "fwd", 5, 3, None, "", [OutputStats((4,), "float32", 11 + r, float("nan") if born else 1.0 + r)],
                        [InputRead(0, 5 + r, 2.0 + r, None, "", None, -1)], "0", False, False),
               OpRecord(1, "c10d.allreduce_.default", "", "fwd", 5, 4, (0, 1, 2, 3), "allreduce",
                        [OutputStats((4,), "float32", 100 + r, float("nan"), (float("nan"), 1.0))],
                        [InputRead(0, 50 + r, float("nan") if born else 1.0 + r, None, "", None, 0)], "0", False, True)]
        per_rank[r] = {"mode": "ops", "ops": ops, "total": len(ops), "limit": 20000}
    report = compare_numerics(1, per_rank)
    assert report.first is None and "different values" not in report.text(), report.text()
    assert [(nf.rank, nf.how) for nf in report.nonfinite if nf.how == "born"] == [(1, "born")], report.text()
