"""How far apart two values of the numerics record are (worker/torch_hooks/numerics.py keeps, per
tensor, a fingerprint, its float64 sum and ``SAMPLE`` of its elements): the largest element
difference — exact where every element was kept, else a lower bound — and whether two values agree
within a tolerance. Shared by the comparison across ranks (numerics.py), the diff of two runs
(numerics_diff.py) and the plot (numerics_text.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Gap", "Valued", "gap", "within"]


@dataclass(frozen=True)
class Gap:
    """How far one value is from another: the largest difference of an element. ``exact`` when
    every element was compared; else a lower bound — the largest among the sampled elements, or
    the sums' difference spread evenly over the elements, whichever is larger."""

    value: float
    exact: bool
    compared: int  # elements compared
    numel: int


def _element_gap(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    return 0.0 if a == b else abs(a - b)  # equal infinities are no gap (inf - inf is NaN)


class Valued(Protocol):
    """A value as the record keeps it (numerics.py's ``Side``, an output's ``OutputStats``)."""

    @property
    def total(self) -> float: ...
    @property
    def sample(self) -> tuple[float, ...]: ...
    @property
    def numel(self) -> int: ...


def gap(a: Valued, b: Valued) -> Gap:
    """The largest element difference between two values, exact where every element was sampled."""
    same = bool(a.sample) and len(a.sample) == len(b.sample) and a.numel == b.numel
    found = max((_element_gap(x, y) for x, y in zip(a.sample, b.sample)), default=0.0) if same else 0.0
    numel = max(a.numel, b.numel)
    exact = same and len(a.sample) == a.numel
    if not exact and numel and math.isfinite(a.total) and math.isfinite(b.total):
        found = max(found, abs(a.total - b.total) / numel)  # |Σa − Σb| ≤ n·max|a−b|
    return Gap(found, exact, len(a.sample) if same else 0, numel)


def within(a: float, b: float, rtol: float, atol: float) -> bool:
    """Equal, or within the tolerance (NaN only with NaN)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= atol + rtol * max(abs(a), abs(b))
