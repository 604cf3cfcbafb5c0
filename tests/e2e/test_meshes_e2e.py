"""Meshes end to end on 4 ranks with a (dp=2, tp=2) device mesh: a collective on the wrong mesh
dimension, FSDP2 with a parameter of another shape on one rank, an async call paired across cells,
DTensor placements in %dist_check, %dist_mesh, and --comms over FSDP2 with tensor parallel.

gloo on CPU by default. ``DISTNB_MESH_BACKEND=nccl`` runs the same tests on NCCL with every rank
on one GPU (``share_gpus``); the ones that need gloo's own behaviour (its abort on a size
mismatch) say so and skip there."""

from __future__ import annotations

import os
import re
import time

import pytest

import distnb

from conftest import usable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
NCCL = os.environ.get("DISTNB_MESH_BACKEND") == "nccl"
MESH = ("from torch.distributed.device_mesh import init_device_mesh\n"
        "{m} = init_device_mesh(device.type, (2, 2), mesh_dim_names=('dp', 'tp'))\n")
#: A small model, tensor parallel over tp and FSDP2 over dp of the mesh ``{p}_mesh``, as ``{p}_model``.
FSDP_TP = ("import torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
           "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
           "torch.manual_seed(0)\n{p}_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).to(device)\n"
           "parallelize_module({p}_model, {p}_mesh['tp'], {{'0': ColwiseParallel(), '2': RowwiseParallel()}})\n"
           "fully_shard({p}_model, mesh={p}_mesh['dp'])\n")


@pytest.fixture(scope="module")
def mesh_pool(request: pytest.FixtureRequest) -> distnb.Pool:
    if not NCCL:
        return usable(request.getfixturevalue("shared_pools").get(nproc=4))  # pool4 of conftest
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("DISTNB_MESH_BACKEND=nccl needs a CUDA GPU")
    pool = distnb.Pool(nproc=4, share_gpus=True, pg_timeout=60, hang_after=1.0).start()
    request.addfinalizer(pool.shutdown)
    return pool


def _hang(pool: distnb.Pool, res: distnb.CellResult, within: float = 30.0) -> distnb.Verdict:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        diag = pool.diagnose(res, hang_after=1.0)
        if diag.state == "hang":
            return diag
        time.sleep(0.3)
    raise AssertionError(f"no hang diagnosed within {within} s; last: {diag.text()}")


def test_a_collective_on_the_wrong_mesh_dimension_names_the_rank_that_used_it(mesh_pool: distnb.Pool) -> None:
    pool = usable(mesh_pool)
    assert pool.run(MESH.format(m="wd_mesh"), timeout=120).ok
    report = pool.meshes()
    # Meshes earlier tests built on the shared pool may still live: this one is among them.
    assert report.odd() == [] and ": (dp=2, tp=2) on " in report.text() and "dp: (0,2) (1,3) · tp: (0,1) (2,3)" in report.text()
    res = pool.submit("wd_x = torch.ones(4, device=device)\nwd_out = [torch.empty(4, device=device) for _ in range(2)]\n"
                      "dist.all_gather(wd_out, wd_x, group=wd_mesh.get_group('dp' if rank == 1 else 'tp'))\n"
                      + ("torch.cuda.synchronize()\n" if NCCL else ""))
    diag = _hang(pool, res)
    assert diag.summary.startswith("collective on another group: rank 1 called all_gather over dp (ranks 1,3) where ranks 0,2,3 used tp"), diag.text()
    assert "rank 0 waits on tp (ranks 0,1) for rank 1" in diag.summary and diag.culprits == [1]
    assert "finished the cell without entering" not in diag.text() and "never" not in diag.summary
    log = pool.collectives().text()
    assert log.startswith("first divergence: collective on another group: rank 1"), log
    assert "── dp (ranks 1,3), torch's group" in log
    stacks = pool.stacks().text()
    assert "on tp (ranks 0,1))" in stacks and "on dp (ranks 1,3))" in stacks, stacks
    pool.restart()


@pytest.mark.skipif(NCCL, reason="gloo's abort of the rank that receives too much is what this test reads")
def test_fsdp2_with_a_parameter_of_another_shape_on_one_rank_blames_that_rank_not_the_aborted_one(mesh_pool: distnb.Pool) -> None:
    pool = usable(mesh_pool)
    assert pool.run(MESH.format(m="fs_mesh"), timeout=120).ok
    res = pool.run("import torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
                   "fs_width = 12 if rank == 2 else 8  # a config value read per rank\n"
                   "fs_model = nn.Linear(fs_width, 8)\nfully_shard(fs_model, mesh=fs_mesh['dp'])\n"
                   "fs_model(torch.randn(2, fs_width)).sum().backward()\n", timeout=120)
    assert res.failed
    text = res.text()
    # Whether rank 0's entry reached distnb before it died decides which rule speaks; both name the
    # shape, rank 2, and the other dp group that outvotes a group of two.
    assert "Root cause: rank 2" in text and "shape mismatch" in text and re.search(r"rank 2 all_gather (#1 )?\[52\] f32", text), text
    assert re.search(r"by majority over 4 ranks|where ranks 1,3 had all_gather \[36\] f32", text), text
    # Root cause first: before the aborted rank's own death text.
    assert text.index("Root cause: rank 2") < text.index("died first"), text
    log = pool.collectives().text()
    assert "(the odd one out: rank 2;" in log, log
    pool.restart()


def test_an_async_call_left_pending_is_paired_with_the_next_cells_call(mesh_pool: distnb.Pool) -> None:
    pool = usable(mesh_pool)
    # On NCCL the group's first collective connects its communicator and blocks until every rank
    # comes: one collective of every rank first, so rank 0's lone call returns at enqueue there too.
    assert pool.run("dist.all_reduce(torch.ones(1, device=device))", timeout=120).ok
    left = pool.run("as_t = torch.ones(4, device=device)\nif rank == 0:\n    as_work = dist.all_reduce(as_t, async_op=True)\n", timeout=120)
    assert left.ok and left.desync, left.text()
    assert f"it was issued with async_op=True and its work is still pending (never waited on); the call at cell {left.cell} line 3 " \
           "is under `if rank == 0:` (line 2)" in left.text(), left.text()
    assert left.verdict is not None and left.verdict.culprits == [0], left.text()
    res = pool.submit("as_u = torch.ones(6, device=device) * (rank + 1)\ndist.all_reduce(as_u)\nas_v = as_u.sum().item()\n")
    diag = _hang(pool, res)
    # The sequence number depends on what earlier tests ran on the shared pool.
    assert re.match(r"collective #\d+ on group 0 paired calls of different cells: ", diag.summary), diag.text()
    assert (f"rank 0's all_reduce [4] f32 from cell {left.cell}, line 3 with ranks 1-3's all_reduce [6] f32 from cell {res.cell}, "
            "line 2") in diag.summary, diag.text()
    assert "Root cause: rank 0's call from an earlier cell" in diag.summary and diag.culprits == [0]
    pool.restart()


def test_dtensor_placements_partial_and_uneven_shards_in_check(mesh_pool: distnb.Pool) -> None:
    pool = usable(mesh_pool)
    res = pool.run(MESH.format(m="dt_mesh") +
                   "from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor\n"
                   "torch.manual_seed(0)\ndt_base = torch.randn(5, 4, device=device)\n"
                   "dt_odd = DTensor.from_local(dt_base if rank != 3 else dt_base[3:], dt_mesh['tp'], "
                   "[Shard(0) if rank == 3 else Replicate()], run_check=False)\n"
                   "dt_partial = DTensor.from_local(torch.ones(2, device=device) * (rank + 1), dt_mesh['tp'], [Partial()])\n"
                   "dt_uneven = distribute_tensor(dt_base, dt_mesh['tp'], [Shard(0)])\n"
                   "dt_local = dt_base.clone()\nif rank == 2:\n    dt_local[0, 0] += 1\n"
                   "dt_drift = DTensor.from_local(dt_local, dt_mesh['tp'], [Replicate()], run_check=False)\n", timeout=120)
    assert res.ok, res.text()
    odd, partial, uneven, drift = pool.check(["dt_odd", "dt_partial", "dt_uneven", "dt_drift"])
    assert odd.odd_ranks == [3] and "Shard(0)" in odd.text() and "Replicate()" in odd.text()
    assert partial.identical and "⚠ dt_partial is Partial(sum): each rank holds an unreduced part" in partial.text()
    assert uneven.identical and "sharded unevenly: local shards [3, 4] on ranks 0,2; [2, 4] on ranks 1,3" in uneven.text()
    assert "(expected, not a mismatch)" in uneven.text()
    assert drift.odd_ranks == [2], drift.text()


def test_dist_mesh_names_a_rank_whose_mesh_disagrees(mesh_pool: distnb.Pool) -> None:
    pool = usable(mesh_pool)
    res = pool.run("from torch.distributed.device_mesh import init_device_mesh\n"
                   "dm_mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=('dp', 'tq' if rank == 3 else 'tp'))\n", timeout=120)
    assert res.ok, res.text()
    report = pool.meshes()
    # Earlier tests' meshes may still live on the ranks: rank 3's odd one is named either way.
    assert report.odd() == [3] and "✗ rank 3 built (dp=2, tq=2) on " in report.text(), report.text()
    assert "(0,1)     ranks 1,3        ranks 0,1" in report.text(), report.text()
    assert report.plot() is not None
    pool.restart()  # the odd mesh's groups go with the ranks


def test_comms_per_module_and_dimension_over_fsdp2_with_tensor_parallel(mesh_pool: distnb.Pool) -> None:
    pool = usable(mesh_pool)
    setup = pool.run(MESH.format(m="cm_mesh") + FSDP_TP.format(p="cm") +
                     "cm_solo = dist.new_group([3])  # every rank creates it; only rank 3 uses it\n", timeout=120)
    assert setup.ok, setup.text()
    res = pool.wait(pool.submit("cm_model(torch.randn(4, 8, device=device)).sum().backward()\n"
                                "if rank == 3:\n    dist.all_reduce(torch.ones(2, device=device), group=cm_solo)\n", comms=True), timeout=120)
    assert res.ok, res.text()
    report = res.comms()
    text = report.text()
    rows = {(r.module, r.phase, r.over) for r in report.rows}
    assert ("Sequential", "fwd", "dp") in rows or any(m.endswith("Sequential") and p == "fwd" and o == "dp" for m, p, o in rows), text
    assert any(o == "tp" and p == "fwd" for _, p, o in rows), text
    assert "per dimension: " in text and "dp " in text and "tp " in text
    assert "redistributes (DTensor), source → target placements:" in text and "→" in text
    # Only rank 3 reduced over its own one-rank group: flagged, the rest "all".
    assert report.odd_ranks() == [3] and "✗ rank 3: after " in text and " fwd all_reduce over group " in text, text
    assert "1 call, 8 B where the others made 0 calls" in text, text
    assert report.plot() is not None
    with pytest.raises(ValueError, match="was not run with comms=True"):
        setup.comms()


def test_a_healthy_fsdp2_and_tensor_parallel_run_reports_no_divergence(mesh_pool: distnb.Pool) -> None:
    # No false alarm: DTensor's scatters (input on the root alone), FSDP2's all_gathers and
    # reduce_scatters, TP's all_reduces over several steps — every rank agrees, nothing is flagged.
    pool = usable(mesh_pool)
    res = pool.run(MESH.format(m="ok_mesh") + FSDP_TP.format(p="ok") +
                   "ok_opt = torch.optim.SGD(ok_model.parameters(), lr=0.1)\n"
                   "for _ in range(3):\n    ok_model(torch.randn(4, 8, device=device)).pow(2).mean().backward()\n"
                   "    ok_opt.step()\n    ok_opt.zero_grad()\n", timeout=120)
    assert res.ok and not res.desync and "desync" not in res.text(), res.text()
    assert pool.diagnose(res).state == "ok"
    log = pool.collectives()
    assert log.divergences() == [] and "agree" in log.text().splitlines()[0], log.text()
    assert "different shapes" not in log.text() and "✗" not in log.text().rsplit("\n", 1)[0]
    checks = pool.check("ok_model")
    assert checks[0].identical, checks[0].text()


def test_check_within_a_dimension_names_tensor_parallel_peers_fed_other_batches(mesh_pool: distnb.Pool) -> None:
    # The FSDP+TP example's own warning: inputs seeded by the global rank differ inside each tp
    # group, which must see one batch; seeded by the dp coordinate they agree there.
    pool = usable(mesh_pool)
    res = pool.run(MESH.format(m="cw_mesh") +
                   "cw_inp = torch.randn(4, generator=torch.Generator().manual_seed(rank))\n"
                   "cw_ok = torch.randn(4, generator=torch.Generator().manual_seed(cw_mesh.get_coordinate()[0]))\n", timeout=120)
    assert res.ok, res.text()
    [bad] = pool.check("cw_inp", within="tp")
    assert bad.differing == [[0, 1], [2, 3]] and bad.odd_ranks == [0, 1, 2, 3], bad.text()
    assert bad.header().startswith("check cw_inp within tp: differs inside tp groups (0,1) and (2,3): tensor-parallel peers")
    [good] = pool.check("cw_ok", within="tp")
    assert good.identical, good.text()
    [plain] = pool.check("cw_ok")
    assert not plain.identical and "cw_ok: identical inside each tp group, differs across them (along dp)" in plain.text(), plain.text()
    with pytest.raises(ValueError, match="no mesh has a dimension 'xx'"):
        pool.check("cw_ok", within="xx")


def test_dist_mesh_lists_the_meshes_the_cells_hold_not_ones_held_elsewhere(mesh_pool: distnb.Pool) -> None:
    # A mesh kept alive outside the cells' names (as torch keeps its own) is not the user's.
    pool = usable(mesh_pool)
    res = pool.run(MESH.format(m="own_mesh") +
                   "import sys\nsys.modules['torch']._distnb_test_mesh = init_device_mesh(device.type, (4,), mesh_dim_names=('scratch',))\n",
                   timeout=120)
    assert res.ok, res.text()
    text = pool.meshes().text()
    assert "(dp=2, tp=2) on " in text and "scratch" not in text, text
    assert pool.run("own_view = sys.modules['torch']._distnb_test_mesh['scratch']\n").ok
    assert "(scratch=4) on " in pool.meshes().text()  # a slice bound to a name holds its root
    pool.restart()
