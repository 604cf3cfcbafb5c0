"""Tensor checksums: fingerprints, summaries, cross-rank comparison, and %dist_check end to end."""

from __future__ import annotations

import pytest
import torch

import distnb
from distnb.checks import compare
from distnb.worker.checksum import checksum, fingerprint

pytestmark = pytest.mark.timeout(180)


def test_fingerprint_is_bitwise() -> None:
    a = torch.randn(300, 500)
    assert fingerprint(a) == fingerprint(a.clone())
    ulp = a.clone()
    ulp[3, 7] = torch.nextafter(ulp[3, 7], torch.tensor(10.0))
    assert fingerprint(ulp) != fingerprint(a)
    swapped = a.clone()
    swapped[[1, 299]] = swapped[[299, 1]]
    assert fingerprint(swapped) != fingerprint(a)
    col_swap = a.clone()
    col_swap[:, [0, 1]] = col_swap[:, [1, 0]]
    assert fingerprint(col_swap) != fingerprint(a)
    assert fingerprint(a.t().contiguous().t()) == fingerprint(a)  # non-contiguous, same values
    assert fingerprint(a.double()) != fingerprint(a)  # dtype is part of it
    assert fingerprint(a.reshape(500, 300)) != fingerprint(a)  # and so is the shape
    assert fingerprint(torch.ones(7, dtype=torch.uint8)) != fingerprint(torch.ones(7, dtype=torch.uint8) * 2)


@pytest.mark.parametrize("t", [torch.tensor(3), torch.zeros(0), torch.ones(5, dtype=torch.bfloat16), torch.ones(2, dtype=torch.complex64),
                               torch.tensor([True, False]), torch.arange(10), torch.ones(3, requires_grad=True)])
def test_summary_handles_dtypes(t: torch.Tensor) -> None:
    s = checksum(t)
    assert s["kind"] == "tensor" and s["shape"] == list(t.shape) and len(s["fingerprint"]) == 24


def test_nan_inf_counted_and_stats_finite() -> None:
    s = checksum(torch.tensor([1.0, float("nan"), float("inf"), -2.0]))
    assert (s["nan"], s["inf"], s["min"], s["max"]) == (1, 1, -2.0, 1.0)
    report = compare("x", {0: s, 1: s})
    assert report.identical and "1 NaN, 1 Inf in x" in report.text()


def test_majority_names_the_odd_rank() -> None:
    same = checksum(torch.ones(4))
    odd = checksum(torch.ones(4) * 2)
    report = compare("w", {0: same, 1: same, 2: odd, 3: same})
    assert not report.identical and report.odd_ranks == [2]
    assert "odd rank: 2" in report.text() and report.to_rows()[0]["ranks"] == [0, 1, 3]
    tie = compare("w", {0: same, 1: odd})
    assert tie.odd_ranks == [1]  # a tie goes to the group holding the lowest rank


def test_module_buffers_and_optimizer_state() -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    before = checksum(m)
    m(torch.randn(8, 4)).sum().backward()
    after = checksum(m)
    report = compare("model", {0: before, 1: before, 2: after})
    assert report.odd_ranks == [2]
    assert {"buffers.1.running_mean", "buffers.1.running_var", "buffers.1.num_batches_tracked"} <= set(report.differing)
    assert any(p.startswith("grads.") for p in report.differing)  # only rank 2 has gradients
    opt = torch.optim.Adam(m.parameters())
    opt.step()
    state = checksum(opt)
    assert state["kind"] == "mapping" and any(k.endswith("exp_avg") for k in state["items"])
    assert compare("opt", {0: state, 1: checksum(opt)}).identical


def test_sharded_entries_are_compared_as_shards() -> None:
    shard = {"kind": "tensor", "shape": [2], "dtype": "float32", "placement": "Shard(dim=0)", "global_shape": [4], "fingerprint": "a" * 24}
    other = dict(shard, fingerprint="b" * 24)
    report = compare("dt", {0: shard, 1: other})
    assert report.identical and report.sharded == ["dt"]
    replicated = dict(shard, placement="Replicate()")
    assert not compare("dt", {0: replicated, 1: dict(replicated, fingerprint="c" * 24)}).identical


@pytest.fixture(scope="module")
def pool2():
    with distnb.Pool(nproc=2, backend="gloo") as pool:
        yield pool
    assert pool.pids() == []


def test_seeded_differently_is_named(pool2: distnb.Pool) -> None:
    pool2.run("torch.manual_seed(0 if rank == 0 else 1)\nw = torch.randn(64)\nsame = torch.arange(8.0)")
    [w, same] = pool2.check(["w", "same"])
    assert not w.identical and w.differing == [""] and same.identical
    with pytest.raises(distnb.RemoteError, match="not defined"):
        pool2.check("nope")


def test_ddp_replicas_identical_after_a_step(pool2: distnb.Pool) -> None:
    res = pool2.run(
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(rank)\nnet = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))\n"
        "ddp = DDP(net)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
        "ddp(torch.randn(16, 8) + rank).sum().backward()\nopt.step()\n"
    )
    assert res.ok, res.text()
    [report] = pool2.check("net")
    assert report.identical, report.text()  # DDP broadcast the weights and averaged the gradients


def test_batchnorm_buffers_diverge_without_sync(pool2: distnb.Pool) -> None:
    res = pool2.run(
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\nbn_net = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), broadcast_buffers=False)\n"
        "bn_net(torch.randn(16, 4) * (rank + 1)).sum().backward()\n"
    )
    assert res.ok, res.text()
    [report] = pool2.check("bn_net")
    assert "module.1.running_mean" in " ".join(report.differing) and not report.identical
    # With broadcast_buffers (DDP's default) rank 0's buffers reach every rank before each forward;
    # a last forward on identical input then leaves identical buffers everywhere.
    pool2.run("bn_net2 = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))\n"
              "bn_net2(torch.randn(16, 4) * (rank + 1)).sum().backward()\n"
              "bn_net2(torch.ones(2, 4)).sum().backward()")
    [report] = pool2.check("bn_net2")
    assert not any(p.startswith("buffers.") for p in report.differing), report.text()


def test_check_magic_and_on_ranks_check(pool2: distnb.Pool, capsys) -> None:
    from IPython.testing.globalipapp import start_ipython
    from IPython import get_ipython

    ip = start_ipython() or get_ipython()
    if "on_ranks" not in ip.magics_manager.magics["cell"]:
        ip.run_line_magic("load_ext", "distnb")
    ip.run_cell_magic("on_ranks", "--check v", "v = torch.ones(3) * (1 if rank == 0 else 2)")
    err = capsys.readouterr().err
    assert "check v: 1 of 1 entry differ — odd rank: 1" in err
    ip.run_line_magic("dist_check", "same")
    assert "check same: identical on ranks 0,1" in capsys.readouterr().out
