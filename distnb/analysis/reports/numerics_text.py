"""The words, table and plot of a numerics report (analysis/reports/numerics.py): text first, each
claim no stronger than the records make it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from distnb.analysis.reports.numerics_claims import INFERRED
from distnb.analysis.reports.numerics_gap import gap
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks
from distnb.wire.record_types import SAMPLE, OpRecord

if TYPE_CHECKING:
    from distnb.analysis.reports.numerics import EvalMode, NumericDivergence, NumericsReport, ProgramSplit
    from distnb.analysis.reports.numerics_gap import Gap

__all__ = ["divergence_text", "nonfinite_text", "op_words", "plot", "report_text", "table_rows"]

_PHASES = {"fwd": "forward", "bwd": "backward", "step": "optimizer step"}
_MAX_SPLITS = 4


def _where(cell: int, line: int, phase: str) -> str:
    at = f"{cell_name(cell)} line {line}" if cell else "outside the notebook's code"
    return f"{at}, {_PHASES[phase]}" if phase in _PHASES else at


def op_words(op: str, module: str, cell: int, line: int, phase: str) -> str:
    """``aten.mul.Tensor in model.layers.3 (cell 5 line 12, forward)``."""
    return f"{op}{' in ' + module if module and not module.startswith('optimizer') else ''} ({_where(cell, line, phase)})"


def _num(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.6g}"


def _basis(why: str) -> str:
    """Why the ranks must agree, in words."""
    return {"allreduce": "all_reduce output", "all_reduce": "all_reduce output", "broadcast": "broadcast output",
            "allgather": "all_gather output", "_allgather_base": "all_gather output", "all_gather_into_tensor": "all_gather output",
            "Replicate": "DTensor Replicate()", "DDP": "DDP replicas", "gradient": "DDP replicas' gradients",
            "optimizer state": "optimizer state of DDP replicas", "DDP buffer": "DDP replicas' buffers",
            "DDP buffer, not broadcast": "DDP replicas' buffers (should agree; DDP does not broadcast them here)",
            "inputs": "made only from tensors that must agree", "named": "ranks you named",
            INFERRED: "they read equal inputs into an op those fix"}.get(why, why or "made from tensors that must agree")


def divergence_text(d: NumericDivergence) -> str:
    """One finding: who, where, by how much, and what the records say of its cause."""
    majority = d.sides[0].ranks
    odd = d.odd
    tie = sorted(odd) == sorted(d.group)
    where = op_words(d.op, d.module, d.cell, d.line, d.phase)
    head = f"first divergence among {format_ranks(d.group)} (must agree: {_basis(d.why)}): "
    if tie:
        apart = "; ".join(f"{format_ranks(s.ranks)}" + (f" sum {_num(s.total)}" if d.what == "output" else "") for s in d.sides)
        who = f"no majority — {len(d.sides)} different values ({apart})"
    else:
        who = f"{format_ranks(odd)} against {format_ranks(majority).replace('ranks ', '').replace('rank ', '')}"
    if d.what == "input":
        name = d.label or "a tensor it read"
        text = head + f"{name} already differed when {where} read it: {who}."
        wrote = {r: s for r, s in d.writers.items()}
        if wrote:
            text += " " + "; ".join(f"rank {r} wrote it at op #{s} of the cell" for r, s in sorted(wrote.items())) + "."
        else:
            text += " No recorded op of this cell wrote it: it differed before the cell (or was written outside the record)."
        return text
    text = head + (f"{where} gives {who}" if tie else f"{format_ranks(odd)}'s {where} differs from {who.split(' against ')[1]}")
    if not tie:
        text += f" ({_size(d)})"
    text += "." if d.exact else f" (beyond the tolerance: sums and up to {SAMPLE} elements compared)."
    if d.random and d.inputs_agreed is not False and d.args_agreed and d.rng_apart:
        drew = (f"{format_ranks(d.rng_apart)} drew from another random generator state than the others"
                if sorted(d.rng_apart) != sorted(d.group) else "each rank drew from a random generator state of its own")
        text += (" It draws random numbers" + (", and its inputs agreed (by fingerprint)" if d.inputs_agreed else "")
                 + f": {drew} (likely seeded differently, or drew a different number of times before).")
    elif d.random and d.inputs_agreed is not False and d.args_agreed and d.rng_apart is None:
        text += (" It draws random numbers" + (", and its inputs agreed (by fingerprint)" if d.inputs_agreed else "")
                 + ": the ranks' random generator states likely differ (seeded per rank?).")
    elif d.inputs_agreed and d.args_agreed:
        text += (" Its inputs agreed (by fingerprint), so the op itself computed differently there (likely a non-deterministic "
                 "kernel, or other code or hardware).")
    elif d.inputs_agreed and not d.args_agreed:
        text += " Its tensor inputs agreed; its other arguments (scalars, sizes) differed between the ranks."
    elif d.inputs_agreed is False:
        text += " Its inputs already differed (not all of them were compared: tensors from before the cell that need not agree)."
    return text


def _size(d: NumericDivergence) -> str:
    return size_words(d.size, d.sides[1].total, d.sides[0].total)


def size_words(size: Gap, total: float, against: float) -> str:
    """A difference's size: its largest element difference, said as a bound where only some
    elements were compared; and the two sums."""
    sums = f"sum {_num(total)} against {_num(against)}"
    if size.exact:
        every = "its only element" if size.numel == 1 else f"all {size.numel} elements compared"
        return f"max abs diff {size.value:.3g}, {every}; {sums}"
    how = f"from {size.compared} of {size.numel:,} elements and the sums" if size.compared else "from the sums"
    return f"max abs diff at least {size.value:.3g}, {how}; {sums}"


def nonfinite_text(report: NumericsReport) -> list[str]:
    lines = []
    for nf in report.nonfinite:
        op = nf.op
        kind = "NaN" if any(math.isnan(o.total) for o in op.outputs) else "Inf" if op.outputs else "NaN/Inf"
        where = op_words(op.op, op.module, op.cell, op.line, op.phase)
        if nf.how == "born":
            lines.append(f"{kind} born on rank {nf.rank} in {where}: every input it read was finite." if nf.certain else
                         f"{kind} likely born on rank {nf.rank} in {where}: its first {len(op.inputs)} tensor inputs were finite "
                         "(an op's further inputs are not read).")
        elif nf.how == "before":
            lines.append(f"non-finite values on rank {nf.rank} came from before the cell: {nf.label or 'a tensor'} read by {where}.")
        elif nf.how == "sent":
            lines.append(f"rank {nf.rank} sent non-finite values into {where}.")
    for s in report.spreads:
        lines.append(f"the {s.op.split('.')[1].rstrip('_')} at {_where(s.cell, s.line, '')} spread non-finite values from "
                     f"{format_ranks(s.sources)} to {format_ranks(s.reached)}.")
    return lines


def _op(op: OpRecord | None) -> str:
    return op_words(op.op, op.module, op.cell, op.line, op.phase) if op is not None else "nothing (its ops ended)"


def split_words(s: ProgramSplit) -> str:
    """Where one rank's ops depart from the reference rank's."""
    if s.how == "extra":
        return f"rank {s.rank} ran ops rank {s.reference} did not, first {_op(s.theirs)}"
    if s.how == "missing":
        return f"rank {s.rank} did not run {_op(s.ours)}, which rank {s.reference} ran"
    return f"rank {s.rank} ran {_op(s.theirs)} where rank {s.reference} ran {_op(s.ours)}"


def _mode_words(m: EvalMode) -> str:
    return (f" Likely {m.module} is in eval() mode on rank {m.rank} and in train() mode on the other: "
            + ("its batch norm ran without updating its statistics there." if m.layer == "batch norm" else "its dropout did not run there."))


def _split_text(report: NumericsReport, said: ProgramSplit | None) -> list[str]:
    out = [split_words(s) + "; ops are compared where they match." for s in report.programs[:_MAX_SPLITS] if s is not said]
    if len(report.programs) > _MAX_SPLITS:
        out.append(f"(and {len(report.programs) - _MAX_SPLITS} more ranks whose ops depart)")
    return out


def report_text(report: NumericsReport) -> str:
    n = max((len(ops) for ops in report.records.values()), default=0)
    what = "collectives" if report.mode == "collectives" else "ops"
    lines = [f"numerics of {cell_name(report.cell)}: {n} {what} recorded per rank on {format_ranks(sorted(report.records))}"
             + ("" if report.tolerance == (0.0, 0.0) else
                f", sums and sampled elements compared within rtol={report.tolerance[0]:g}, atol={report.tolerance[1]:g}")]
    # Ranks that run other ops than the rest part there, before any value compared can.
    lead = report.departure
    departs = lead is not None and (report.first is None or lead.position <= report.first.position)
    also = report.divergences
    if departs and lead is not None:
        lines.append(f"first divergence: the ranks' ops part: {split_words(lead)}."
                     + (_mode_words(lead.mode) if lead.mode else " It writes a tensor these ranks must hold the same."))
    elif report.first is None:
        if report.mode == "collectives":
            lines.append("collectives only: their inputs and outputs were checked for NaN/Inf, not compared op by op.")
        elif not report.checked:
            lines.append("not checked: nothing in the records says these ranks must agree (no collective whose result they "
                         "all hold, no DDP or replicated DTensor, no op they fed equal inputs); if they ran the same data, "
                         "name them: --agree RANKS.")
        else:
            rest = len(report.aligned) - report.checked
            lines.append(f"no divergence: at the {report.checked} ops where the records say ranks must agree, they did"
                         + (" (bit for bit, by fingerprint)" if report.tolerance == (0.0, 0.0) else " (within the tolerance)")
                         + (f"; the other {rest} were not checked (nothing in the records says the ranks must agree there)."
                            if rest > 0 else "."))
    else:
        lines.append(divergence_text(report.first))
        also = report.divergences[1:]
    for d in also[:4 if departs else 3]:
        lines.append("  also " + divergence_text(d))
    if len(also) > (4 if departs else 3):
        lines.append(f"  (and {len(also) - (4 if departs else 3)} more groups of ranks)")
    lines += nonfinite_text(report)
    lines += _split_text(report, lead if departs else None)
    lines += report.notes
    return "\n".join(lines)


def table_rows(report: NumericsReport, around: int = 4) -> list[dict[str, Any]]:
    """The ops around the first divergence (or the first ops), one row each: op, module, line and
    each rank's sum of its first output; ``odd`` names the ranks apart from their group there."""
    centre = report.first.position if report.first else 0
    rows = []
    for pos in range(max(0, centre - around), min(len(report.aligned), centre + around + 1)):
        where = report.aligned[pos]
        ops = {r: report.records[r][i] for r, i in where.items()}
        ref = ops.get(report.reference) or next(iter(ops.values()))
        sums = {r: (op.outputs[0].total if op.outputs else None) for r, op in sorted(ops.items())}
        odd: list[int] = []
        for d in report.divergences:
            if d.position == pos:
                odd += d.odd
        rows.append({"position": pos, "op": ref.op, "module": ref.module, "cell": ref.cell, "line": ref.line, "phase": ref.phase,
                     "must_agree": format_ranks(ref.agree) if ref.agree else "", "sums": sums, "odd": sorted(set(odd)),
                     "divergence": report.first is not None and pos == centre})
    return rows


def plot(report: NumericsReport) -> Any:
    """Per rank, how far each op's output is from its group's (the peer with the median sum): the
    largest element difference known (exact for small outputs, else a lower bound), along the
    cell's ops."""
    from matplotlib.figure import Figure

    series: dict[int, tuple[list[int], list[float]]] = {r: ([], []) for r in report.records}
    for pos, where in enumerate(report.aligned):
        ops = {r: report.records[r][i] for r, i in where.items()}
        for r, op in ops.items():
            if not op.agree or not op.outputs:
                continue
            peers = sorted((op2.outputs[0] for q, op2 in ops.items() if q in op.agree and op2.outputs), key=lambda o: o.total)
            diff = gap(op.outputs[0], peers[len(peers) // 2]).value
            series[r][0].append(pos)
            series[r][1].append(diff if math.isfinite(diff) else float("nan"))
    fig = Figure(figsize=(7, 3), layout="constrained")
    ax = fig.add_subplot()
    for r, (xs, ys) in sorted(series.items()):
        if xs:
            ax.plot(xs, [max(y, 1e-300) for y in ys], ".", markersize=3, label=f"rank {r}")
    ax.set_yscale("log")
    if report.first is not None:
        ax.axvline(report.first.position, color="red", linewidth=0.8)
    ax.set_xlabel("op (execution order)")
    ax.set_ylabel("max |element − group's| (≥)")
    ax.set_title(f"difference from the ranks that must agree, {cell_name(report.cell)}", fontsize=9)
    ax.legend(fontsize=7)
    return fig
