"""%dist_check inside the groups of a mesh dimension: what must agree there, and who differs."""

from __future__ import annotations

from distnb.analysis.reports.check_within import agreement_by_dim, compare_within
from distnb.analysis.reports.meshes import MeshReport, mesh_dims


def _t(fp: str) -> dict:
    return {"kind": "tensor", "shape": [4], "dtype": "float32", "sum": 1.0, "norm": 1.0, "fingerprint": fp}


MESH = {"device": "cpu", "shape": [2, 2], "names": ["dp", "tp"], "named": True, "layout": [0, 1, 2, 3], "coord": [0, 0], "groups": {}}
DIMS = mesh_dims(MeshReport({r: [MESH] for r in range(4)}))


def test_mesh_dims_give_each_dimensions_groups() -> None:
    assert DIMS == {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}


def test_inputs_seeded_by_global_rank_differ_inside_tp_groups() -> None:
    # The FSDP+TP example's own warning: TP peers fed other batches. Across the world every rank
    # differs (normal across dp); inside each tp group they must not.
    per_rank = {r: _t(f"batch{r}") for r in range(4)}
    report = compare_within("inp", per_rank, "tp", DIMS["tp"])
    assert not report.identical and report.differing == [[0, 1], [2, 3]]
    assert report.header().startswith("check inp within tp: differs inside tp groups (0,1) and (2,3): tensor-parallel peers")
    assert report.odd_ranks == [0, 1, 2, 3]
    assert agreement_by_dim("inp", per_rank, DIMS) == ""


def test_inputs_seeded_by_dp_rank_agree_inside_tp_and_say_so() -> None:
    per_rank = {0: _t("a"), 1: _t("a"), 2: _t("b"), 3: _t("b")}
    report = compare_within("inp", per_rank, "tp", DIMS["tp"])
    assert report.identical and report.header() == "check inp within tp: identical inside every tp group (0,1) and (2,3)"
    assert agreement_by_dim("inp", per_rank, DIMS) == "inp: identical inside each tp group, differs across them (along dp)"


def test_one_rank_of_a_larger_group_stands_out() -> None:
    dims = {"tp": [[0, 1, 2, 3]]}
    per_rank = {0: _t("a"), 1: _t("a"), 2: _t("x"), 3: _t("a")}
    report = compare_within("out", per_rank, "tp", dims["tp"])
    assert report.odd_ranks == [2] and "odd rank: 2" in report.header(), report.text()
