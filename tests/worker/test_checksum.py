"""Tensor checksums: bitwise fingerprints, summaries, cross-rank comparison, and %dist_check end to end.

No pool: ``checksum`` runs in this process and ``{rank: summary}`` dicts are built by checksumming
different tensors. The end-to-end tests over real ranks are in test_check_e2e.py.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from distnb.analysis.reports import checks as checks
from distnb.analysis.reports.checks import compare
from distnb.worker.recorders import checksum as ck
from distnb.worker.recorders import fingerprint as fp
from distnb.worker.recorders.checksum import checksum
from distnb.worker.recorders.fingerprint import fingerprint

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore:Sparse:UserWarning")]

MASK = (1 << 64) - 1


# -- fingerprints -------------------------------------------------------------------------------
def test_fingerprint_is_bitwise() -> None:
    a = torch.randn(300, 500)  # 150,000 words: 146 full rows and a padded tail row
    assert fingerprint(a) == fingerprint(a.clone())
    for i, j in [(3, 7), (0, 0), (299, 499), (150, 3)]:
        ulp = a.clone()
        ulp[i, j] = torch.nextafter(ulp[i, j], torch.tensor(10.0))
        assert fingerprint(ulp) != fingerprint(a), (i, j)
    swapped = a.clone()
    swapped[[1, 299]] = swapped[[299, 1]]  # whole rows, across the tensor
    assert fingerprint(swapped) != fingerprint(a)
    col_swap = a.clone()
    col_swap[:, [0, 1]] = col_swap[:, [1, 0]]  # neighbours
    assert fingerprint(col_swap) != fingerprint(a)
    assert fingerprint(a.t().contiguous().t()) == fingerprint(a)  # non-contiguous, same values
    assert fingerprint(a[:, :250]) == fingerprint(a[:, :250].contiguous())
    assert fingerprint(a.double()) != fingerprint(a)  # dtype is part of it
    assert fingerprint(a.reshape(500, 300)) != fingerprint(a)  # and so is the shape
    assert fingerprint(torch.ones(7, dtype=torch.uint8)) != fingerprint(torch.ones(7, dtype=torch.uint8) * 2)
    assert fingerprint(torch.tensor(0.0)) != fingerprint(torch.tensor(-0.0))  # bits, not values


def test_every_single_bit_flip_and_every_swap_is_seen() -> None:
    torch.manual_seed(1)
    base = torch.randn(40)
    words = base.view(torch.int32)
    ref = fingerprint(base)
    seen = {ref}
    for i in range(40):
        for bit in range(32):
            flipped = words.clone()
            flipped[i] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
            seen.add(fingerprint(flipped.view(torch.float32)))
    assert len(seen) == 1 + 40 * 32  # every flip distinct from the original and from each other
    for i in range(40):
        for j in range(i + 1, 40):
            s = base.clone()
            s[[i, j]] = s[[j, i]]
            assert fingerprint(s) != ref, (i, j)


def test_swaps_of_repeated_values_far_apart_are_seen() -> None:
    # The case a plain int64 wrapping sum misses: values that differ only in high bits, rows apart.
    a = torch.ones(64, 2048)
    a[0, 5], a[33, 9] = 2.0, 4.0
    b = a.clone()
    b[0, 5], b[33, 9] = 4.0, 2.0
    assert fingerprint(a) != fingerprint(b)
    h = torch.ones(4096, dtype=torch.float16)
    h[1], h[4000] = 2.0, 0.5
    g = h.clone()
    g[1], g[4000] = 0.5, 2.0
    assert fingerprint(h) != fingerprint(g)
    d = torch.arange(3000, dtype=torch.float64)
    e = d.clone()
    e[[10, 2900]] = e[[2900, 10]]
    assert fingerprint(d) != fingerprint(e)


def _reference_sums(t: torch.Tensor) -> list[int]:
    """The fingerprint's four sums in plain Python integers (no float anywhere)."""
    data = t.contiguous().reshape(-1).view(torch.uint8).tolist()
    data += [0] * (-len(data) % (4 * fp.WIDTH))
    words = [int.from_bytes(bytes(data[k : k + 4]), "little", signed=True) for k in range(0, len(data), 4)]
    cols = fp._columns("cpu").to(torch.int64).tolist()
    nrows = len(words) // fp.WIDTH
    rows = fp._rows(0, nrows, "cpu").tolist()
    acc = [0, 0, 0, 0]
    for r in range(nrows):
        row = words[r * fp.WIDTH : (r + 1) * fp.WIDTH]
        for k in range(4):  # columns: 1, 1, w1, w2; row weights: 1, 2r+1, m1(r), m2(r)
            acc[k] += sum(x * c[k] for x, c in zip(row, cols)) * rows[r][k]
    return [v & MASK for v in acc]


@pytest.mark.parametrize("fill", ["random", "extreme"])
def test_float64_products_are_exact(fill: str) -> None:
    # int32 × weights summed in float64 must equal integer arithmetic, even at the int32 extremes.
    if fill == "random":
        t = torch.randint(-(2**31), 2**31, (3 * fp.WIDTH + 17,), dtype=torch.int32)
    else:
        t = torch.full((3 * fp.WIDTH,), -(2**31), dtype=torch.int32)
        t[::2] = 2**31 - 1
    assert fp.sums(t)[0] == _reference_sums(t)


def test_block_and_span_sizes_do_not_change_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(9 * fp.WIDTH * 16 + 5)  # > _PAD_WHOLE_BYTES: main rows plus a tail
    ref = fingerprint(t)
    monkeypatch.setattr(fp, "_CPU_BLOCK_ROWS", 3)
    monkeypatch.setattr(fp, "_SPAN_ROWS", 7)
    monkeypatch.setattr(fp, "_row_weights", {})
    assert fingerprint(t) == ref


def test_strided_expanded_and_fp8_tensors_are_read_in_bounded_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces far smaller than the tensor: the fingerprint is that of the contiguous copy, the
    copies made are bounded by the piece size (an expanded tensor is never materialised)."""
    monkeypatch.setattr(fp, "PIECE_BYTES", 3000)  # not a multiple of a row: partial rows carry over
    torch.manual_seed(0)
    m = torch.randn(300, 77)
    cases = {"transposed": m.t(), "sliced": m[::3, 5:60], "expanded": torch.randn(1, 501).expand(400, 501),
             "3-d permuted": torch.randn(6, 50, 40).permute(2, 0, 1)}
    for name, t in cases.items():
        assert not t.is_contiguous()
        assert fingerprint(t) == fingerprint(t.contiguous()), name
        assert checksum(t)["fingerprint"] == fingerprint(t.contiguous()), name
    sizes = [p.numel() * p.element_size() for p in fp.pieces(cases["expanded"])]
    assert max(sizes) <= 3000 and sum(sizes) == 400 * 501 * 4
    if hasattr(torch, "float8_e4m3fn"):
        f8 = (torch.randn(1000, 33) * 4).to(torch.float8_e4m3fn)
        s8 = checksum(f8)
        ref = f8.float()
        assert s8["fingerprint"] == fingerprint(f8) and s8["dtype"] == "float8_e4m3fn"
        assert abs(s8["sum"] - ref.double().sum().item()) < 1e-3 * s8["norm"] and s8["min"] == ref.min().item()
        assert abs(s8["norm"] - ref.double().norm().item()) < 1e-3 * s8["norm"]


def test_a_failing_statistic_keeps_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(t: object) -> None:
        raise RuntimeError("aminmax not implemented for this dtype")

    monkeypatch.setattr(ck, "_stat_tensors", broken)
    t = torch.arange(10.0)
    s = checksum(t)
    assert s["fingerprint"] == fingerprint(t) and s["sum"] is None
    assert "aminmax not implemented" in s["stats_error"]


def test_odd_offsets_and_views() -> None:
    h = torch.randn(1001).half()
    assert fingerprint(h[1:]) == fingerprint(h[1:].clone())  # storage offset not a multiple of 4 bytes
    big = torch.randn(40_000).half()
    assert fingerprint(big[3:]) == fingerprint(big[3:].clone())
    c = torch.randn(8, dtype=torch.complex64)
    assert fingerprint(c.conj()) == fingerprint(c.conj().resolve_conj())
    x = torch.randn(5, requires_grad=True)
    assert fingerprint(x) == fingerprint(x.detach().clone())


# -- summaries ----------------------------------------------------------------------------------
with warnings.catch_warnings():  # "sparse CSR is in beta", at collection time
    warnings.simplefilter("ignore")
    _CSR = torch.eye(3, dtype=torch.float64).to_sparse_csr()

DTYPE_CASES = [
    torch.tensor(3),
    torch.tensor(2.5),
    torch.zeros(0),
    torch.zeros(0, 3, dtype=torch.int8),
    torch.ones(5, dtype=torch.bfloat16),
    torch.ones(5, dtype=torch.float16) * 70000,  # overflows half: inf
    torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64),
    torch.tensor([1 + 2j], dtype=torch.complex128),
    torch.tensor([True, False, True]),
    torch.arange(10),
    torch.arange(10, dtype=torch.uint8),
    torch.ones(3, requires_grad=True),
    torch.ones(4, dtype=torch.float8_e4m3fn),
    torch.eye(3).to_sparse(),
    _CSR,
    torch.empty(3, 4, device="meta"),
]


@pytest.mark.parametrize("t", DTYPE_CASES, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}-{t.layout}-{t.device}".replace("torch.", ""))
def test_summary_handles_dtypes(t: torch.Tensor) -> None:
    s = checksum(t)
    assert s["kind"] == "tensor" and s["shape"] == list(t.shape) and "error" not in s, s
    assert s["dtype"] == str(t.dtype).replace("torch.", "") and s["device"] == str(t.device)
    json.loads(json.dumps(s, allow_nan=False))  # plain JSON, no NaN/Infinity literals
    if t.device.type != "meta":
        assert len(s["fingerprint"]) == 32 and s == checksum(t.clone())
    if t.numel() == 0:
        assert s["sum"] is None and s["min"] is None


def test_summary_values_by_dtype() -> None:
    b = checksum(torch.tensor([True, False, True]))
    assert (b["sum"], b["min"], b["max"]) == (2, 0, 1)
    i = checksum(torch.tensor([5, -3, 2**40]))
    assert (i["sum"], i["min"], i["max"]) == (2 + 2**40, -3, 2**40) and isinstance(i["sum"], int)
    c = checksum(torch.tensor([1 + 2j, 3 - 1j]))
    assert c["sum"] == [4.0, 1.0] and c["min"] is None
    f = checksum(torch.tensor([1.0, float("nan"), float("inf"), -2.0]))
    assert (f["nan"], f["inf"], f["sum"], f["min"], f["max"]) == (1, 1, -1.0, -2.0, 1.0)
    cn = checksum(torch.tensor([complex("nan+1j"), 2 + 0j]))
    assert cn["nan"] == 1 and cn["sum"] == [None, 1.0]
    big = checksum(torch.full((4,), 3e38))  # float32 sum overflows, yet no element is Inf
    assert big["inf"] == 0 and big["sum"] is None and big["max"] == pytest.approx(3e38)
    json.dumps([cn, big], allow_nan=False)
    h = checksum(torch.full((4,), 60000.0, dtype=torch.float16))
    assert h["sum"] == 240000.0 and h["inf"] == 0  # accumulated in float32, not half
    sparse = torch.sparse_coo_tensor([[0, 0, 2], [1, 1, 0]], [1.0, 2.0, 5.0], (3, 3))  # a duplicate index
    dense_equiv = torch.sparse_coo_tensor([[0, 2], [1, 0]], [3.0, 5.0], (3, 3))
    s1, s2 = checksum(sparse), checksum(dense_equiv)
    assert s1["fingerprint"] == s2["fingerprint"] and s1["nnz"] == 2 and "sparse" in s1["note"]


def test_module_summary_and_key_paths() -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    s = checksum(m)
    assert s["kind"] == "module" and s["type"] == "Sequential" and s["grads"] == {}
    assert set(s["params"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert set(s["buffers"]) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    m(torch.randn(8, 4)).sum().backward()
    assert set(checksum(m)["grads"]) == set(s["params"])
    assert set(checks.entries(checksum(m))) >= {"0.weight", "0.weight.grad", "1.running_mean"}


def test_containers_flatten_into_paths() -> None:
    m = torch.nn.Linear(2, 2)
    cyclic: list = [1]
    cyclic.append(cyclic)
    s = checksum({"model": m, "meta": {"step": 3, "tags": ["a", "b"]}, "obj": object(), "loop": cyclic, (1, 2): torch.ones(1)})
    items = s["items"]
    assert s["kind"] == "mapping"
    assert {"model.weight", "model.bias", "meta.step", "meta.tags", "obj", "(1, 2)"} <= set(items)
    assert items["meta.tags"] == {"kind": "value", "repr": "['a', 'b']"}
    assert items["obj"]["repr"] == "<object object>"  # no address: equal on every rank
    assert checksum((torch.ones(2), 3))["kind"] == "sequence"
    assert checksum("x" * 1000)["repr"].endswith("…") and len(checksum("x" * 1000)["repr"]) == 200
    json.dumps(s)


def test_optimizer_state_after_a_step() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = checksum(opt)
    assert state["kind"] == "mapping"
    assert {"state.0.exp_avg", "state.1.exp_avg_sq", "state.0.step", "param_groups.0.lr", "param_groups.0.params"} <= set(state["items"])
    assert compare("opt", {0: state, 1: checksum(opt)}).identical
    opt.param_groups[0]["lr"] = 2e-3
    other = checksum(opt)
    report = compare("opt", {0: state, 1: state, 2: other})
    assert report.differing == ["param_groups.0.lr"] and report.odd_ranks == [2]
    assert "value: 0.002" in report.text()


# -- comparison ---------------------------------------------------------------------------------
def test_identical_tensors() -> None:
    s = checksum(torch.arange(12.0))
    report = compare("w", {r: s for r in range(4)})
    assert report.identical and report.differing == [] and report.odd_ranks == []
    assert report.text() == "check w: identical on ranks 0-3 (1 tensor)" == repr(report)


def test_majority_names_the_odd_rank() -> None:
    same = checksum(torch.ones(4))
    odd = checksum(torch.ones(4) * 2)
    report = compare("w", {0: same, 1: same, 2: odd, 3: same})
    assert not report.identical and report.odd_ranks == [2] and report.differing == [""]
    text = report.text()
    assert text.startswith("check w: differs between ranks — odd rank: 2\n")
    assert "ranks 0,1,3" in text and same["fingerprint"][:8] in text and odd["fingerprint"][:8] in text
    rows = report.to_rows()
    assert [(r["ranks"], r["fingerprint"]) for r in rows] == [([0, 1, 3], same["fingerprint"]), ([2], odd["fingerprint"])]
    assert set(rows[0]) >= {"entry", "ranks", "shape", "dtype", "sum", "norm", "nan", "inf", "fingerprint"}
    tie = compare("w", {0: same, 1: odd})
    assert tie.odd_ranks == [1] and "a tie" in tie.text()  # the group holding the lowest rank is the reference
    minority_at_zero = compare("w", {0: odd, 1: same, 2: same, 3: same})
    assert minority_at_zero.odd_ranks == [0]
    spread = compare("w", {0: same, 1: odd, 2: checksum(torch.zeros(4))})
    assert spread.odd_ranks == [1, 2] and "every rank differs" in spread.text()


def test_batchnorm_buffer_differs_on_one_rank() -> None:
    def model(scale: float) -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        torch.manual_seed(1)
        m(torch.randn(16, 4) * scale)
        return m

    same = checksum(model(1.0))
    report = compare("model", {0: same, 1: same, 2: checksum(model(3.0)), 3: same})
    assert report.odd_ranks == [2]
    assert set(report.differing) == {"1.running_var"} or set(report.differing) == {"1.running_mean", "1.running_var"}
    assert report.text().startswith(f"check model: {len(report.differing)} of 7 tensors differ — odd rank: 2")
    assert compare("model", {0: same, 1: checksum(model(1.0))}).text() == "check model: identical on ranks 0,1 (7 tensors)"


def test_missing_grads_are_named() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    before = checksum(m)
    m(torch.randn(2, 3)).sum().backward()
    report = compare("m", {0: checksum(m), 1: before})
    assert set(report.differing) == {"weight.grad", "bias.grad"} and "missing on these ranks" in report.text()


def test_nan_and_inf_are_called_out_even_when_identical() -> None:
    w = torch.ones(10)
    w[:3] = float("nan")
    layer = {"layer.weight": w, "layer.bias": torch.tensor([float("inf")])}
    s = checksum(layer)
    report = compare("model", {0: s, 1: s})
    assert report.identical
    assert "ranks 0,1: 3 NaN in layer.weight" in report.text() and "ranks 0,1: 1 Inf in layer.bias" in report.text()
    clean = checksum({"layer.weight": torch.ones(10), "layer.bias": torch.tensor([1.0])})
    report = compare("model", {0: clean, 1: s, 2: clean})
    assert "rank 1: 3 NaN in layer.weight" in report.text() and report.odd_ranks == [1]


def _dtensor_summary(fp: str, placement: str, local: tuple[int, ...] = (2,)) -> dict:
    return {"kind": "tensor", "shape": [4], "local_shape": list(local), "dtype": "float32", "device": "cpu",
            "placement": placement, "placements": placement.split(", "), "sum": 1.0, "norm": 1.0, "min": 0.0, "max": 1.0, "nan": 0, "inf": 0, "fingerprint": fp}


def test_sharded_entries_are_compared_as_shards() -> None:
    a, b = _dtensor_summary("a" * 32, "Shard(0)"), _dtensor_summary("b" * 32, "Shard(0)")
    report = compare("dt", {0: a, 1: b})
    assert report.identical and report.sharded == ["dt"], report.text()
    assert "1 sharded with no replica to compare, layout (global shape, dtype, placement) compared only" in report.text()
    assert len(report.to_rows()) == 2  # one row per distinct shard
    uneven = compare("dt", {0: a, 1: _dtensor_summary("c" * 32, "Shard(0)", local=(1,))})
    assert uneven.identical  # uneven sharding: local shapes may differ, the global one may not
    wrong = compare("dt", {0: a, 1: _dtensor_summary("b" * 32, "Shard(1)")})
    assert not wrong.identical and wrong.odd_ranks == [1]
    replicated = _dtensor_summary("a" * 32, "Replicate()")
    assert not compare("dt", {0: replicated, 1: dict(replicated, fingerprint="c" * 32)}).identical
    assert compare("dt", {0: replicated, 1: dict(replicated)}).identical
    partial = compare("dt", {0: _dtensor_summary("a" * 32, "Partial(sum)"), 1: _dtensor_summary("d" * 32, "Partial(sum)")})
    assert partial.identical and "1 partial" in partial.text()


def test_real_dtensor_in_a_one_rank_group(tmp_path) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(12.0).reshape(4, 3)
        shard = checksum(distribute_tensor(full, mesh, [Shard(0)]))
        assert shard["placement"] == "Shard(0)" and shard["shape"] == [4, 3] and shard["local_shape"] == [4, 3]
        assert shard["fingerprint"] == fingerprint(full) and shard["mesh_shape"] == [1]
        rep = checksum(distribute_tensor(full, mesh, [Replicate()]))
        assert rep["placement"] == "Replicate()"
        assert compare("dt", {0: shard, 1: shard}).sharded == ["dt"]
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_cuda_fingerprints_match_cpu_and_stay_on_device() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    cases = [torch.randn(1000, 1000), torch.randn(17).half(), torch.arange(5000), torch.randn(3, dtype=torch.complex64), torch.randn(70_000 * fp.WIDTH // 1000)]
    for t in cases:  # exact integer arithmetic: the device does not change the fingerprint
        assert fingerprint(t.cuda()) == fingerprint(t), t.dtype
    big = torch.randn(64 << 20, device="cuda")  # 256 MiB: several GPU blocks and spans
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    s = checksum(big)
    assert s["device"].startswith("cuda") and s["fingerprint"] == fingerprint(big.cpu())
    assert torch.cuda.max_memory_allocated() - base < 64 << 20  # scratch is bounded, no full copy
    assert abs(s["sum"] - big.double().sum().item()) < 1e-3 * s["norm"]


def test_checks_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, distnb.analysis.reports.checks, distnb.worker.recorders.checksum; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_a_shard_with_replicas_is_compared_across_them_and_the_report_says_so() -> None:
    # (dp=2, tp=2) with [Replicate(), Shard(0)]: ranks 0,2 hold tp-shard 0, ranks 1,3 tp-shard 1.
    def leaf(fp: str, coord: list[int]) -> dict:
        return {**_dtensor_summary(fp, "Replicate(), Shard(0)"), "mesh_coord": coord}

    same = compare("w", {0: leaf("a" * 32, [0, 0]), 1: leaf("b" * 32, [0, 1]), 2: leaf("a" * 32, [1, 0]), 3: leaf("b" * 32, [1, 1])})
    assert same.identical and "1 sharded, each shard compared bitwise across its replicas" in same.text(), same.text()
    drift = compare("w", {0: leaf("a" * 32, [0, 0]), 1: leaf("b" * 32, [0, 1]), 2: leaf("c" * 32, [1, 0]), 3: leaf("b" * 32, [1, 1])})
    assert not drift.identical and "replicas of one shard differ" in drift.text(), drift.text()
