"""What a sentence pieced together from parts shows when a part ends in its own punctuation, or a
label was cut to fit: "[256, 64].; ranks 0-2", "the call..", "In[1" for In[15]. Shared by the
tests that render every verdict kind and view (tests/analysis/test_rules.py, test_message_widths.py)."""

from __future__ import annotations

import re

__all__ = ["faults"]

_SEAMS = re.compile(r"(?<!\.)\.[;,:]|(?<![.…])\.\.(?!\.)|[;,:]\.|;;|,,|\s[;,.:](?!\d)|\(\s|\s\)|…\s*[.,;:]|[,;:]\s*…")
_PAIRS = {")": "(", "]": "["}


def _unbalanced(line: str) -> bool:
    open_: list[str] = []
    for ch in line:
        if ch in "([":
            open_.append(ch)
        elif ch in _PAIRS:
            if not open_ or open_.pop() != _PAIRS[ch]:
                return True
    return bool(open_) or line.count("`") % 2 == 1


def faults(text: str) -> list[str]:
    """The lines of ``text`` with a seam (doubled or orphaned punctuation) or a cut label
    (brackets, parentheses or backticks left open or closed out of turn)."""
    out = []
    for line in text.splitlines():
        if _SEAMS.search(line):
            out.append(f"seam: {line!r}")
        elif _unbalanced(line):
            out.append(f"cut or unbalanced label: {line!r}")
    return out
