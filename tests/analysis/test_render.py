"""A root cause is data until the renderer writes it (analysis/verdicts/render.py): its words, and
the rule that nothing else in the package writes them (or could read them back)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import distnb
from distnb.analysis.render import headline, root_cause_words
from distnb.analysis.root_cause import Named, RootCause
from distnb.analysis.verdicts.verdict import Kind, Verdict, VerdictState

PACKAGE = Path(distnb.__file__).parent
RENDERER = PACKAGE / "analysis" / "render.py"


@pytest.mark.parametrize("root, words", [
    (RootCause.of([2]), "Root cause: rank 2."),
    (RootCause.of([1, 3], likely=True), "Root cause: likely ranks 1,3."),
    (RootCause.of([2], Named.CALL, likely=True, how="%dist_collectives shows the others'"),
     "Root cause: likely rank 2's call (%dist_collectives shows the others')."),
    (RootCause.of([0], Named.ERROR), "Root cause: the error on rank 0."),
    (RootCause.of([3], Named.PENDING_CALL, how="likely an async_op=True work never waited on", then="the next call paired with it"),
     "Root cause: rank 3's call from an earlier cell, left pending there (likely an async_op=True work never waited on); "
     "the next call paired with it."),
    (RootCause.of([2], note="the odd one out", then="rank 0 is a victim"), "Root cause: rank 2, the odd one out; rank 0 is a victim."),
])
def test_a_root_cause_reads_as_its_data_says(root: RootCause, words: str) -> None:
    assert root_cause_words(root) == words


def test_a_verdicts_headline_is_its_sentence_then_its_root_cause() -> None:
    named = Verdict(VerdictState.HANG, Kind.CALL_MISSING, "rank 2 did not make all_reduce #3.", [2], root=RootCause.of([2]))
    assert named.summary == "rank 2 did not make all_reduce #3. Root cause: rank 2." == headline(named.said, named.root)
    assert named.text().splitlines()[0] == f"[distnb] {named.summary}"
    unnamed = Verdict(VerdictState.HANG, Kind.UNKNOWN, "ranks 0,1 wait in barrier.")
    assert unnamed.summary == unnamed.said


def _literals(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string the module's code holds (docstrings and comments are words about the code, not
    words it writes: a docstring is an expression statement, a comment is not in the tree)."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def test_only_the_renderer_writes_or_reads_a_root_cause() -> None:
    found = [f"{path.relative_to(PACKAGE)}:{line}: {text!r}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != RENDERER
             for line, text in _literals(ast.parse(path.read_text())) if "root cause:" in text.lower()]
    assert not found, "words of a root cause outside analysis/render.py (give the rule a RootCause instead):\n" + "\n".join(found)
    assert any("Root cause: " in text for _, text in _literals(ast.parse(RENDERER.read_text())))  # the check looks where the words are
