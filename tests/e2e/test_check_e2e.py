"""%dist_check end to end: checksums compared across real ranks (seeded differently, DDP, BatchNorm)."""

from __future__ import annotations

import pytest

import distnb
from distnb.jobs import pools

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_seeded_differently_is_named(pool4: distnb.Pool) -> None:
    pool4.run("torch.manual_seed(1 if rank == 2 else 0)\nw = torch.randn(64)\nsame = torch.arange(8.0)")
    [w, same] = pool4.check(["w", "same"])
    assert not w.identical and w.differing == [""] and same.identical
    assert w.odd_ranks == [2] and "odd rank: 2" in w.header(), w.text()
    with pytest.raises(distnb.RemoteError, match="not defined"):
        pool4.check("nope")


def test_ddp_replicas_identical_after_a_step(pool4: distnb.Pool) -> None:
    res = pool4.run(
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(rank)\nnet = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))\n"
        "ddp = DDP(net)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
        "ddp(torch.randn(16, 8) + rank).sum().backward()\nopt.step()\n"
    )
    assert res.ok, res.text()
    [report] = pool4.check("net")
    assert report.identical, report.text()  # DDP broadcast the weights and averaged the gradients


def test_batchnorm_buffers_diverge_without_sync(pool4: distnb.Pool) -> None:
    res = pool4.run(
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\nbn_net = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), broadcast_buffers=False)\n"
        "bn_net(torch.randn(16, 4) * (rank + 1)).sum().backward()\n"
    )
    assert res.ok, res.text()
    [report] = pool4.check("bn_net")
    assert "module.1.running_mean" in " ".join(report.differing) and not report.identical
    # With broadcast_buffers (DDP's default) rank 0's buffers reach every rank before each forward;
    # a last forward on identical input then leaves identical buffers everywhere.
    pool4.run("bn_net2 = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))\n"
              "bn_net2(torch.randn(16, 4) * (rank + 1)).sum().backward()\n"
              "bn_net2(torch.ones(2, 4)).sum().backward()")
    [report] = pool4.check("bn_net2")
    assert not any("running" in p or "num_batches" in p for p in report.differing), report.text()


def test_check_magic_and_on_ranks_check(pool4: distnb.Pool, capsys) -> None:
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython() or get_ipython()
    if "on_ranks" not in ip.magics_manager.magics["cell"]:
        ip.run_line_magic("load_ext", "distnb")
    # The magics act on the current pool: this test's own, with what it reads defined here (an earlier
    # test may have made another shared pool current, and may not have run at all).
    pools.set_current(pool4)
    assert pool4.run("same = torch.arange(8.0)").ok
    ip.run_cell_magic("on_ranks", "--check v", "v = torch.ones(3) * (2 if rank == 1 else 1)")
    out = capsys.readouterr().out
    assert "check v:" in out and "odd rank: 1" in out
    ip.run_line_magic("dist_check", "same")
    assert "check same: identical on ranks 0-3" in capsys.readouterr().out
    # In a kernel the same display is the coloured table: a terminal shell renders only text/plain,
    # a kernel also asks the text/html formatter that %load_ext distnb registered.
    [report] = pool4.check("v")
    html = ip.display_formatter.formatters["text/html"].lookup_by_type(type(report))(report)
    assert "check v:" in html and "<table" in html, html
    from distnb.display.html import BAD

    odd_row = next(row for row in html.split("<tr") if ">rank 1<" in row)
    assert BAD in odd_row, html  # the odd rank's row is the one coloured as differing


def test_dtensors_across_ranks(pool4: distnb.Pool) -> None:
    res = pool4.run(
        "from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh\n"
        "mesh = init_device_mesh('cpu', (4,))\n"
        "torch.manual_seed(0)\ndt_shard = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])\n"
        "dt_rep = distribute_tensor(torch.randn(4), mesh, [Replicate()])\n"
        "dt_bad = DTensor.from_local(torch.ones(4) * (2 if rank == 1 else 1), mesh, [Replicate()], run_check=False)\n"
    )
    assert res.ok, res.text()
    shard, rep, bad = pool4.check(["dt_shard", "dt_rep", "dt_bad"])
    assert shard.identical and shard.sharded == ["dt_shard"], shard.text()
    assert {tuple(r["ranks"]) for r in shard.to_rows()} == {(0,), (1,), (2,), (3,)}  # uneven shards: 2, 2, 1, 0 rows
    assert rep.identical and rep.sharded == [], rep.text()
    assert not bad.identical and bad.odd_ranks == [1], bad.text()


def test_mixed_placement_replicas_of_one_shard_are_compared(pool4: distnb.Pool) -> None:
    """On a 2×2 mesh with [Shard(0), Replicate()], ranks 0,1 hold one shard and ranks 2,3 the
    other: shards differ by design, but the two replicas of each shard must not."""
    res = pool4.run(
        "mesh2d = init_device_mesh('cpu', (2, 2))\n"
        "torch.manual_seed(0)\nhybrid = distribute_tensor(torch.randn(4, 3), mesh2d, [Shard(0), Replicate()])\n"
        "local = hybrid.to_local().clone()\n"
        "if rank == 3:\n    local[0, 0] += 1e-3   # one replica drifts\n"
        "hybrid_bad = DTensor.from_local(local, mesh2d, [Shard(0), Replicate()], run_check=False)\n"
    )
    assert res.ok, res.text()
    good, bad = pool4.check(["hybrid", "hybrid_bad"])
    assert good.identical and good.sharded == ["hybrid"], good.text()
    assert not bad.identical and bad.odd_ranks == [3], bad.text()
    assert "replicas of one shard differ, odd rank: 3" in bad.header(), bad.text()


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_syncbatchnorm_keeps_buffers_identical_on_gpus() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (SyncBatchNorm needs NCCL; it has no CPU implementation)")
    with distnb.Pool(nproc=2, backend="nccl") as pool:
        res = pool.run(
            "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
            "def net(sync):\n    torch.manual_seed(0)\n    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(device)\n"
            "    return nn.SyncBatchNorm.convert_sync_batchnorm(m) if sync else m\n"
            "plain = DDP(net(False), broadcast_buffers=False)\nsynced = DDP(net(True), broadcast_buffers=False)\n"
            "x = torch.randn(16, 4, device=device) * (rank + 1)\n"
            "plain(x).sum().backward()\nsynced(x).sum().backward()\n"
        )
        assert res.ok, res.text()
        plain, synced = pool.check(["plain", "synced"])
    assert "module.1.running_mean" in " ".join(plain.differing), plain.text()
    assert synced.identical, synced.text()
