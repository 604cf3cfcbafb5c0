"""%dist_check end to end: checksums compared across real ranks (seeded differently, DDP, BatchNorm)."""

from __future__ import annotations

import pytest

import distnb

pytestmark = pytest.mark.timeout(180)


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
    assert not any("running" in p or "num_batches" in p for p in report.differing), report.text()


def test_check_magic_and_on_ranks_check(pool2: distnb.Pool, capsys) -> None:
    from IPython.testing.globalipapp import start_ipython
    from IPython import get_ipython

    ip = start_ipython() or get_ipython()
    if "on_ranks" not in ip.magics_manager.magics["cell"]:
        ip.run_line_magic("load_ext", "distnb")
    ip.run_cell_magic("on_ranks", "--check v", "v = torch.ones(3) * (1 if rank == 0 else 2)")
    err = capsys.readouterr().err
    assert "check v:" in err and "odd rank: 1" in err
    ip.run_line_magic("dist_check", "same")
    assert "check same: identical on ranks 0,1" in capsys.readouterr().out


def test_dtensors_across_two_ranks(pool2: distnb.Pool) -> None:
    res = pool2.run(
        "from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh\n"
        "mesh = init_device_mesh('cpu', (2,))\n"
        "torch.manual_seed(0)\ndt_shard = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])\n"
        "dt_rep = distribute_tensor(torch.randn(4), mesh, [Replicate()])\n"
        "dt_bad = DTensor.from_local(torch.ones(4) * (rank + 1), mesh, [Replicate()], run_check=False)\n"
    )
    assert res.ok, res.text()
    shard, rep, bad = pool2.check(["dt_shard", "dt_rep", "dt_bad"])
    assert shard.identical and shard.sharded == ["dt_shard"], shard.text()
    assert {tuple(r["ranks"]) for r in shard.to_rows()} == {(0,), (1,)}  # uneven shards: 3 and 2 rows
    assert rep.identical and rep.sharded == [], rep.text()
    assert not bad.identical and bad.odd_ranks == [1], bad.text()
