"""Rank specs: ``"0,2"``, ``"1-3"``, ``"all"`` and their compact written form."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distnb.ranks import format_ranks, parse_ranks


@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, [0, 1, 2, 3]),
        ("all", [0, 1, 2, 3]),
        ("*", [0, 1, 2, 3]),
        ("", [0, 1, 2, 3]),
        ("  all ", [0, 1, 2, 3]),
        ("0", [0]),
        ("3", [3]),
        ("0,2", [0, 2]),
        (" 2 , 0 ", [0, 2]),
        ("0 2", [0, 2]),  # %%on_ranks 0 2
        ("0, 1-2 3", [0, 1, 2, 3]),
        ("1-3", [1, 2, 3]),
        ("2-2", [2]),
        ("0,2-3", [0, 2, 3]),
        ("1,1,0", [0, 1]),
        ("0-2,1-3", [0, 1, 2, 3]),
        (2, [2]),
        ([3, 1], [1, 3]),
        ((0, 0, 2), [0, 2]),
        (range(1, 3), [1, 2]),
    ],
)
def test_parse_ranks(spec, expected):
    assert parse_ranks(spec, 4) == expected


@pytest.mark.parametrize(
    "spec, match",
    [
        ("9", r"rank 9 is out of range: this pool has ranks 0-3"),
        (9, r"rank 9 is out of range"),
        ("4,5", r"ranks 4, 5 are out of range"),
        ("-1", r"rank -1 is out of range"),
        (-1, r"rank -1 is out of range"),
        ("2-5", r"ranks 4, 5 are out of range"),
        ("3-1", r"runs backwards; write 1-3"),
        ("a", r"can't read 'a' in rank spec 'a'; use ranks like"),
        ("0,a", r"can't read 'a'"),
        ("1-", r"can't read '1-'"),
        ("1-b", r"can't read '1-b'"),
        ("0,,1", r"can't read ''"),
        ("1.5", r"can't read '1.5'"),
        ([], r"names no rank"),
        ([0, "1"], r"ranks must be integers"),
        ([0, 1.0], r"ranks must be integers"),
        ([True], r"ranks must be integers"),
        (True, r"is not a rank"),
    ],
)
def test_parse_ranks_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_ranks(spec, 4)


def test_out_of_range_message_names_the_valid_ranks():
    with pytest.raises(ValueError) as info:
        parse_ranks("9", 4)
    assert "0-3" in str(info.value)
    with pytest.raises(ValueError, match="0-0"):
        parse_ranks(1, 1)


@pytest.mark.parametrize(
    "ranks, text",
    [
        ([], "no ranks"),
        ([3], "rank 3"),
        ([0, 1], "ranks 0,1"),
        ([0, 2], "ranks 0,2"),
        ([0, 1, 2, 3], "ranks 0-3"),
        ([0, 1, 2, 5], "ranks 0-2,5"),
        ([5, 2, 1, 0, 1], "ranks 0-2,5"),
        ([1, 2, 3, 5, 6], "ranks 1-3,5,6"),
        ([0, 2, 4, 5, 6, 9], "ranks 0,2,4-6,9"),
        ({7, 6}, "ranks 6,7"),
    ],
)
def test_format_ranks(ranks, text):
    assert format_ranks(ranks) == text


@given(st.sets(st.integers(min_value=0, max_value=63), min_size=1))
def test_format_then_parse_round_trips(ranks):
    text = format_ranks(ranks)
    spec = text.removeprefix("ranks ").removeprefix("rank ")
    assert parse_ranks(spec, 64) == sorted(ranks)
