"""Mutation operators: each takes a healthy program's site and a culprit rank and returns the
mutated step cell with its truth — the culprit, the lines of the mutation (the call site a verdict
should name) and the kinds of verdict that name its cause. Mutants are made by rule from the
programs' marked sites, so a new program or operator grows the corpus without new mutants by hand.
"""

from __future__ import annotations

import ast
import re
import zlib
from dataclasses import dataclass, field
from typing import Callable

from distnb.analysis.verdicts.verdict import Kind

from corpus.programs import PROGRAMS, Program

__all__ = ["OPERATORS", "PRELUDE", "Mutant", "Site", "generate", "sites"]

#: Run on every rank before a program's setup: the helpers the operators' code calls.
PRELUDE = '''
import os, signal, ctypes, contextlib
def _corpus_bigger(t, on):
    return torch.cat([t.reshape(-1), t.reshape(-1)[:1]]) if on else t
def _corpus_wider(t, on):
    return t.double() if on else t
def _corpus_splits(s, on):
    return [s[0] + 1, s[1] - 1, *s[2:]] if on else s
'''

_P2P = {"send", "recv", "isend", "irecv"}
_REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
_OBJECTS = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"}
_MARK = re.compile(r"\s*#@\s*(.*)$")


@dataclass(frozen=True)
class Site:
    """A marked line of a program's step cell."""

    index: int  # 0-based line of the step
    indent: str
    stmt: str  # the statement, marker removed
    tags: dict[str, str]
    loop_var: str | None  # the variable of the innermost marked loop around it
    in_loop: bool
    ranks: tuple[int, ...]  # the ranks that run it

    def call(self) -> ast.Call | None:
        """The ``dist.X(...)`` call of the statement, if any."""
        try:
            tree = ast.parse(self.stmt)
        except SyntaxError:
            return None
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == "dist":
                return node
        return None

    def fn(self) -> str:
        call = self.call()
        return call.func.attr if call is not None and isinstance(call.func, ast.Attribute) else ""

    @property
    def p2p(self) -> bool:
        return self.fn() in _P2P


@dataclass
class Mutant:
    program: Program
    operator: str
    variant: str
    site: Site
    culprit: int
    step: str  # the mutated step cell
    lines: set[int]  # 1-based lines of the mutated cell a verdict may name as the site
    kinds: set[Kind]  # verdict kinds that name the cause
    note: str = ""
    culprits: tuple[int, ...] = field(default=())  # when the cause is on several ranks (default: the culprit)

    @property
    def name(self) -> str:
        return f"{self.program.name}:{self.operator}{'/' + self.variant if self.variant else ''}@{self.site.index + 1}:r{self.culprit}"

    @property
    def blamed(self) -> set[int]:
        return set(self.culprits or (self.culprit,))


def _lines(program: Program) -> list[str]:
    return program.step.strip("\n").splitlines()


def sites(program: Program) -> list[Site]:
    lines = _lines(program)
    out = []
    loops: list[tuple[int, str]] = []  # (indent width, var)
    for i, line in enumerate(lines):
        indent = line[: len(line) - len(line.lstrip())]
        while loops and loops[-1][0] >= len(indent):
            loops.pop()
        m = _MARK.search(line)
        stmt = _MARK.sub("", line).strip()
        if m is None:
            if stmt.startswith("for "):
                loops.append((len(indent), stmt.split()[1]))
            continue
        tags: dict[str, str] = {}
        for word in m.group(1).split():
            key, _, value = word.partition("=")
            tags[key] = value
        ranks = tuple(int(r) for r in tags["on"].split(",")) if "on" in tags else tuple(range(program.world))
        out.append(Site(i, indent, stmt, tags, loops[-1][1] if loops else None, bool(loops), ranks))
        if stmt.startswith("for "):
            loops.append((len(indent), stmt.split()[1]))
    return out


def _clean(program: Program) -> list[str]:
    return [_MARK.sub("", line) for line in _lines(program)]


def _replace(program: Program, site: Site, new: list[str], before: list[str] = (), after: list[str] = ()) -> tuple[str, set[int]]:
    """The step with ``site``'s line replaced by ``new`` (``before``/``after`` around it, all at
    the site's indentation), and the 1-based lines of everything added or changed."""
    lines = _clean(program)
    added = [site.indent + s for s in [*before, *new, *after]]
    out = lines[: site.index] + added + lines[site.index + 1 :]
    return "\n".join(out) + "\n", set(range(site.index + 1, site.index + 1 + len(added)))


def _guard(site: Site, culprit: int, variant: str) -> str:
    """The condition that picks the culprit: always, or only on one iteration of the loop."""
    if variant == "once" and site.loop_var:
        return f"rank == {culprit} and {site.loop_var} == 1"
    return f"rank == {culprit}"


def _missing_kinds(site: Site, variant: str) -> set[Kind]:
    if site.p2p:
        return {Kind.P2P_UNMATCHED}
    kinds = {Kind.CALL_MISSING}
    if site.in_loop and variant == "once":
        kinds.add(Kind.LOOP_COUNT)  # one iteration's calls missing reads as one step fewer
    return kinds


def _arg_segment(site: Site, pick: Callable[[ast.Call], ast.AST | None]) -> tuple[int, int] | None:
    call = site.call()
    if call is None:
        return None
    node = pick(call)
    if node is None:
        return None
    return node.col_offset, node.end_col_offset or node.col_offset


def _with_arg(site: Site, span: tuple[int, int], text: str) -> str:
    a, b = span
    return site.stmt[:a] + text + site.stmt[b:]


def _kw(call: ast.Call, *names: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg in names), None)


# -- operators ----------------------------------------------------------------------------------
def op_skip(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "assign" in site.tags or "loop" in site.tags:
        return None
    step, lines = _replace(program, site, [f"if not ({_guard(site, c, variant)}):", "    " + site.stmt])
    return Mutant(program, "skip", variant, site, c, step, lines, _missing_kinds(site, variant))


def op_cond(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "assign" in site.tags or "loop" in site.tags or len(site.ranks) < program.world:
        return None
    step, lines = _replace(program, site, [f"if rank == {c}:", "    " + site.stmt])
    kinds = {Kind.P2P_UNMATCHED} if site.p2p else {Kind.CALL_EXTRA}
    return Mutant(program, "cond", variant, site, c, step, lines, kinds)


def op_extra(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "call" not in site.tags or "assign" in site.tags or "=" in site.stmt.split("(")[0]:
        return None
    step, lines = _replace(program, site, [site.stmt], after=[f"if {_guard(site, c, variant)}:", "    " + site.stmt])
    lines.discard(site.index + 1)  # the original call is not the mutation
    kinds = {Kind.P2P_UNMATCHED} if site.p2p else {Kind.CALL_EXTRA}
    return Mutant(program, "extra", variant, site, c, step, lines, kinds)


_RAISES = {
    "": ["if rank == {c}:", "    raise RuntimeError('corpus: a bad batch on rank {c}')"],
    "assert": ["assert rank != {c}, 'corpus: an invariant broken on rank {c}'"],
    "key": ["if rank == {c}:", "    {{}}['corpus: a missing key']"],
}


def op_raise(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "loop" in site.tags:
        return None
    before = [s.format(c=c) for s in _RAISES[variant]]
    step, _ = _replace(program, site, [site.stmt], before=before)
    return Mutant(program, "raise", variant, site, c, step, {site.index + len(before)}, {Kind.RAISED})


def op_swallow(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "assign" in site.tags or "loop" in site.tags:
        return None
    guard = _guard(site, c, "once" if variant.endswith("once") else "")
    if variant.startswith("suppress"):
        new = ["with contextlib.suppress(ValueError):", f"    if {guard}:", "        raise ValueError('corpus: swallowed')",
               "    " + site.stmt]
    elif variant.startswith("continue") and site.in_loop:
        new = ["try:", f"    if {guard}:", "        raise ValueError('corpus: swallowed')", "    " + site.stmt,
               "except ValueError:", "    continue"]
    else:
        new = ["try:", f"    if {guard}:", "        raise ValueError('corpus: swallowed')", "    " + site.stmt,
               "except ValueError:", "    pass"]
    step, lines = _replace(program, site, new)
    kinds = _missing_kinds(site, "once" if variant.endswith("once") or variant.startswith("continue") else "")
    return Mutant(program, "swallow", variant, site, c, step, lines, kinds)


_DEATHS = {"": "os._exit(3)", "kill": "os.kill(os.getpid(), signal.SIGKILL)", "segv": "ctypes.string_at(0)"}


def op_die(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "loop" in site.tags:
        return None
    step, _ = _replace(program, site, [site.stmt], before=[f"if rank == {c}:", "    " + _DEATHS[variant]])
    return Mutant(program, "die", variant, site, c, step, {site.index + 1, site.index + 2}, {Kind.DIED})


def op_loop(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "loop" not in site.tags:
        return None
    m = re.search(r"range\((\d+)\)", site.stmt)
    if m is None:
        return None
    sign = "-" if variant == "fewer" else "+"
    stmt = site.stmt[: m.start()] + f"range({m.group(1)} {sign} (rank == {c}))" + site.stmt[m.end() :]
    step, lines = _replace(program, site, [stmt])
    return Mutant(program, "loop", variant, site, c, step, lines, {Kind.LOOP_COUNT})


def op_group(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "alt" not in site.tags:
        return None
    call = site.call()
    kw = _kw(call, "group") if call is not None else None
    if kw is None:
        return None
    span = (kw.value.col_offset, kw.value.end_col_offset or 0)
    stmt = _with_arg(site, span, f"({site.tags['alt']} if rank == {c} else {site.stmt[span[0]:span[1]]})")
    step, lines = _replace(program, site, [stmt])
    return Mutant(program, "group", variant, site, c, step, lines, {Kind.WRONG_GROUP})


def op_peer(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    call = site.call()
    if call is None or not site.p2p or c not in site.ranks:
        return None
    kw = _kw(call, "dst", "src")
    if kw is None:
        return None
    expr = site.stmt[kw.value.col_offset : kw.value.end_col_offset]
    names: dict[str, object] = {"rank": c, "world_size": program.world}
    exec(program.values, {}, names)  # plain arithmetic on rank and world_size
    orig = int(eval(expr, {}, names))  # noqa: S307 - the program's own peer expression
    other = next(p for p in ((orig + k) % program.world for k in range(1, program.world)) if p != c)
    stmt = _with_arg(site, (kw.value.col_offset, kw.value.end_col_offset or 0), f"({other} if rank == {c} else {expr})")
    step, lines = _replace(program, site, [stmt])
    return Mutant(program, "peer", variant, site, c, step, lines, {Kind.P2P_UNMATCHED})


def _input(call: ast.Call, site: Site) -> ast.AST | None:
    k = int(site.tags.get("input") or 0)
    return call.args[k] if len(call.args) > k else None


def _tensor_op(name: str, helper: str) -> Callable[[Program, Site, int, str], Mutant | None]:
    def op(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
        if "call" not in site.tags or "split" in site.tags or site.fn() in _OBJECTS or c not in site.ranks:
            return None
        span = _arg_segment(site, lambda call: _input(call, site))
        if span is None:
            return None
        stmt = _with_arg(site, span, f"{helper}({site.stmt[span[0]:span[1]]}, rank == {c})")
        step, lines = _replace(program, site, [stmt])
        kinds = {Kind.MISMATCH}
        return Mutant(program, name, variant, site, c, step, lines, kinds)

    return op


def op_reduce_op(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    call = site.call()
    if call is None or site.fn() not in _REDUCING:
        return None
    kw = _kw(call, "op")
    if kw is not None:
        span = (kw.value.col_offset, kw.value.end_col_offset or 0)
        stmt = _with_arg(site, span, f"(dist.ReduceOp.MAX if rank == {c} else {site.stmt[span[0]:span[1]]})")
    else:
        end = (call.end_col_offset or 1) - 1
        stmt = site.stmt[:end] + f", op=(dist.ReduceOp.MAX if rank == {c} else dist.ReduceOp.SUM)" + site.stmt[end:]
    step, lines = _replace(program, site, [stmt])
    return Mutant(program, "reduce_op", variant, site, c, step, lines, {Kind.MISMATCH})


def op_split(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "split" not in site.tags:
        return None
    span = _arg_segment(site, lambda call: call.args[2] if len(call.args) > 2 else None)
    if span is None:
        return None
    stmt = _with_arg(site, span, f"_corpus_splits({site.stmt[span[0]:span[1]]}, rank == {c})")
    step, lines = _replace(program, site, [stmt])
    return Mutant(program, "split", variant, site, c, step, lines, {Kind.MISMATCH})


def op_pending(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "call" not in site.tags or site.p2p or site.fn() in _OBJECTS or "loop" in site.tags:
        return None
    step, lines = _replace(program, site, [site.stmt], before=[f"if {_guard(site, c, variant)}:",
                                                              "    pending = dist.all_reduce(torch.zeros(2), async_op=True)"])
    lines.discard(site.index + 3)
    return Mutant(program, "pending", variant, site, c, step, lines, {Kind.CALL_EXTRA})


def op_members(program: Program, site: Site, c: int, variant: str) -> Mutant | None:
    if "create" not in site.tags:
        return None
    call = site.call()
    if call is None or not call.args or not isinstance(call.args[0], ast.List):
        return None
    members = [int(ast.literal_eval(e)) for e in call.args[0].elts]
    outside = [r for r in range(program.world) if r not in members]
    if not outside:
        return None
    other = sorted([*members[:-1], outside[0]])
    span = (call.args[0].col_offset, call.args[0].end_col_offset or 0)
    stmt = _with_arg(site, span, f"({other} if rank == {c} else {site.stmt[span[0]:span[1]]})")
    step, lines = _replace(program, site, [stmt])
    return Mutant(program, "members", variant, site, c, step, lines, {Kind.GROUP_CREATION})


#: Operator → (function, its variants, taken in turn across the sites it applies to).
OPERATORS: dict[str, tuple[Callable[[Program, Site, int, str], Mutant | None], tuple[str, ...]]] = {
    "skip": (op_skip, ("", "once")),
    "cond": (op_cond, ("",)),
    "extra": (op_extra, ("", "once")),
    "raise": (op_raise, ("", "assert", "key")),
    "swallow": (op_swallow, ("", "suppress", "continue-once")),
    "die": (op_die, ("", "kill", "segv")),
    "loop": (op_loop, ("", "fewer")),
    "group": (op_group, ("",)),
    "peer": (op_peer, ("",)),
    "shape": (_tensor_op("shape", "_corpus_bigger"), ("",)),
    "dtype": (_tensor_op("dtype", "_corpus_wider"), ("",)),
    "reduce_op": (op_reduce_op, ("",)),
    "split": (op_split, ("",)),
    "pending": (op_pending, ("",)),
    "members": (op_members, ("",)),
}


def generate(programs: list[Program] | None = None, operators: list[str] | None = None) -> list[Mutant]:
    """Every operator on every site it applies to, of every program; the culprit and the variant
    taken in turn (culprits over the ranks that run the site, rank 0 included), so the corpus
    covers each operator's variants and every rank as culprit without a hand-picked list."""
    out = []
    for program in programs or PROGRAMS:
        for name in operators or list(OPERATORS):
            fn, variants = OPERATORS[name]
            # Where the culprits start is the (program, operator) pair's own, so a mutant is the
            # same whichever programs and operators a run takes.
            turn = zlib.crc32(f"{program.name}:{name}".encode())
            k = 0
            for site in sites(program):
                candidates = [r for r in site.ranks]
                variant = variants[k % len(variants)]
                culprit = candidates[(turn + k) % len(candidates)]
                mutant = fn(program, site, culprit, variant)
                if mutant is not None:
                    out.append(mutant)
                    k += 1
    return out
