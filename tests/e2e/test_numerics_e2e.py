"""``--numerics`` end to end on the shared 4-rank gloo pool: a healthy DDP step and an FSDP2 + tensor
parallel step report no divergence; a buffer changed on one rank, an optimizer state reset on one
rank, a replicated DTensor weight changed on one rank, dropout seeded per rank after a tensor-parallel
all_reduce, one rank seeded apart in a replicated forward (agreement inferred from equal inputs),
batch norm left in eval() on one rank of a lockstep DDP step, and a NaN born in one rank's batch and
spread by DDP's all_reduce are each named where they start; a perturbation injected at a random
layer and rank is found there; two runs of a cell are compared with ``%dist_numerics diff``'s
function."""

from __future__ import annotations

import random

import pytest

import distnb
from distnb.analysis.reports.numerics import EvalMode
from distnb.analysis.reports.numerics_diff import diff_runs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: A DDP model ``{p}_model`` (with a buffer ``scale`` used in forward) and its Adam, the same on every rank.
DDP_SETUP = ("import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
             "class Scaled(nn.Module):\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.lin = nn.Linear(8, 8)\n"
             "        self.out = nn.Linear(8, 1)\n"
             "        self.register_buffer('scale', torch.ones(8))\n"
             "    def forward(self, x):\n"
             "        return self.out(torch.relu(self.lin(x)) * self.scale)\n"
             "torch.manual_seed(0)\n"
             "{p}_model = DDP(Scaled(), broadcast_buffers={bb})\n"
             "{p}_opt = torch.optim.Adam({p}_model.parameters(), lr=1e-2)\n")
#: One training step on a batch of this rank's own data.
DDP_STEP = ("torch.manual_seed(100 + rank)\n"
            "{p}_x = torch.randn(4, 8)\n"
            "{p}_loss = {p}_model({p}_x).sum()\n"
            "{p}_loss.backward()\n"
            "{p}_opt.step()\n"
            "{p}_opt.zero_grad()\n")


def _run(pool: distnb.Pool, code: str, numerics: bool | str = False) -> distnb.CellResult:
    res = pool.run(code, timeout=120, numerics=numerics)
    assert res.ok, res.text()
    return res


def test_a_healthy_ddp_step_reports_no_divergence_and_its_record_says_where_each_op_ran(pool: distnb.Pool) -> None:
    _run(pool, DDP_SETUP.format(p="nh", bb=True))
    _run(pool, DDP_STEP.format(p="nh"))  # the optimizer's state exists from here
    report = _run(pool, DDP_STEP.format(p="nh"), numerics=True).numerics()
    assert report.first is None and not report.nonfinite and not report.programs, report.text()
    assert "no divergence" in report.text()
    ops = report.records[0]
    assert any(op.op == "c10d.allreduce_.default" and op.phase == "bwd" and op.agree == (0, 1, 2, 3) for op in ops)
    assert any(op.module == "nh_model.module.lin" and op.phase == "fwd" and op.line == 3 for op in ops)
    assert any(op.module == "nh_model.module.lin" and op.phase == "bwd" and op.line == 4 for op in ops)
    step = [op for op in ops if op.phase == "step"]
    assert step and all(op.agree == (0, 1, 2, 3) for op in step) and step[0].module == "optimizer step (Adam)"
    rows = report.table()
    assert rows and {"op", "module", "sums", "odd"} <= set(rows[0])
    assert report.plot() is not None


def test_a_buffer_changed_on_one_rank_is_named_when_first_read(pool: distnb.Pool) -> None:
    _run(pool, DDP_SETUP.format(p="nb", bb=False))
    _run(pool, "if rank == 2:\n    nb_model.module.scale.add_(0.5)\n")
    report = _run(pool, DDP_STEP.format(p="nb"), numerics=True).numerics()
    d = report.first
    assert d is not None and d.what == "input" and d.odd == [2] and "scale" in (d.label or ""), report.text()
    assert d.line == 3 and d.group == [0, 1, 2, 3]
    assert "buffer nb_model.module.scale already differed" in report.text()


def test_an_optimizer_state_reset_on_one_rank_is_named_at_the_step(pool: distnb.Pool) -> None:
    _run(pool, DDP_SETUP.format(p="no", bb=True))
    _run(pool, DDP_STEP.format(p="no"))
    _run(pool, "if rank == 2:\n    for s in no_opt.state.values():\n        s['exp_avg'].zero_()\n")
    report = _run(pool, DDP_STEP.format(p="no"), numerics=True).numerics()
    d = report.first
    assert d is not None and d.what == "input" and d.odd == [2] and "exp_avg" in (d.label or ""), report.text()
    assert d.phase == "step" and d.line == 5


def test_a_nan_born_in_one_ranks_batch_is_traced_to_it_and_to_the_all_reduce_that_spread_it(pool: distnb.Pool) -> None:
    _run(pool, DDP_SETUP.format(p="nn", bb=True))
    code = ("nn_model.zero_grad()\nnn_batch = torch.rand(4, 8) + 0.5\n"
            "if rank == 2:\n"
            "    nn_batch[1, 3] = 0.0\n"
            "nn_loss = nn_model(torch.log(nn_batch)).sum()\n"
            "nn_loss.backward()\n")
    report = _run(pool, code, numerics=True).numerics()
    born = [nf for nf in report.nonfinite if nf.how == "born"]
    assert [nf.rank for nf in born] == [2] and "log" in born[0].op.op and born[0].op.line == 5, report.text()
    assert any(s.sources == [2] and s.reached == [0, 1, 3] and "allreduce" in s.op for s in report.spreads), report.text()
    assert "born on rank 2" in report.text() and "spread non-finite values from rank 2 to ranks 0,1,3" in report.text()
    # Collectives only: the cheap check still says who sent non-finite values into the all_reduce.
    cheap = _run(pool, code.replace("nn_", "nc_").replace("nc_model", "nn_model"), numerics="collectives").numerics()
    assert [nf.rank for nf in cheap.nonfinite if nf.how == "sent"] == [2], cheap.text()
    assert any(s.sources == [2] and s.reached == [0, 1, 3] for s in cheap.spreads)


def test_a_replicated_forward_with_one_rank_seeded_apart_is_found_at_its_dropout(pool: distnb.Pool) -> None:
    # No DDP, no collective: that the ranks must agree is inferred from their equal inputs.
    _run(pool, "import torch.nn as nn\ntorch.manual_seed(0)\n"
               "rf_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))\n")
    forward = ("torch.manual_seed(0)\n"
               "rf_x = torch.randn(4, 8)\n"
               "torch.manual_seed({seed})\n"
               "rf_y = rf_model(rf_x)\n")
    healthy = _run(pool, forward.format(seed=7), numerics=True).numerics()
    assert healthy.first is None and healthy.checked > 4, healthy.text()
    assert healthy.text().splitlines()[1].startswith(f"no divergence: at the {healthy.checked} ops")
    report = _run(pool, forward.format(seed="8 if rank == 1 else 7"), numerics=True).numerics()
    d = report.first
    assert d is not None and d.odd == [1] and d.rng_apart == [1] and d.line == 4 and "bernoulli" in d.op, report.text()
    assert d.module == "rf_model.2" and d.group == [0, 1, 2, 3]
    assert "rank 1 drew from another random generator state than the others" in report.text()
    # Each rank seeded its own way (as data-parallel code does): nothing says they must agree there.
    own = _run(pool, forward.format(seed="rank"), numerics=True).numerics()
    assert own.first is None, own.text()


def test_batch_norm_left_in_eval_on_one_rank_of_a_lockstep_ddp_step_is_named(pool: distnb.Pool) -> None:
    _run(pool, "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\ntorch.manual_seed(0)\n"
               "bn_model = DDP(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)))\n"
               "if rank == 1:\n    bn_model.module[1].eval()\n")
    step = "torch.manual_seed(0)\nbn_loss = bn_model(torch.randn(16, 8)).sum()\nbn_loss.backward()\n"
    report = _run(pool, step, numerics=True).numerics()
    lead = report.departure
    assert lead is not None and lead.rank == 1 and lead.mode == EvalMode(1, "bn_model.module.1", "batch norm"), report.text()
    headline = report.text().splitlines()[1]
    assert headline.startswith("first divergence: the ranks' ops part") and "eval() mode on rank 1" in headline, report.text()


TP_SETUP = ("import torch.nn as nn\nimport torch.nn.functional as F\n"
            "from torch.distributed.device_mesh import init_device_mesh\n"
            "from torch.distributed.tensor import Replicate, distribute_tensor, distribute_module\n"
            "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
            "tp_mesh = init_device_mesh('cpu', (4,), mesh_dim_names=('tp',))\n"
            "torch.manual_seed(0)\n"
            "tp_model = parallelize_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), tp_mesh,"
            " {'0': ColwiseParallel(), '2': RowwiseParallel()})\n"
            "tp_lin = distribute_module(nn.Linear(8, 8), tp_mesh)\n")


def test_tensor_parallel_dropout_seeded_per_rank_and_a_replicated_weight_changed_on_one_rank(pool: distnb.Pool) -> None:
    _run(pool, TP_SETUP)
    dropout = ("torch.manual_seed(0)\n"
               "tp_x = torch.randn(4, 8)\n"
               "tp_y = tp_model(tp_x)\n"
               "torch.manual_seed(rank)\n"
               "tp_z = F.dropout(tp_y, 0.5)\n")
    report = _run(pool, dropout, numerics=True).numerics()
    d = report.first
    assert d is not None and d.what == "output" and d.random and d.inputs_agreed is not False and d.line == 5, report.text()
    assert d.group == [0, 1, 2, 3] and "bernoulli" in d.op and d.why == "inputs"
    assert d.rng_apart == [0, 1, 2, 3] and "each rank drew from a random generator state of its own" in report.text()
    _run(pool, "if rank == 2:\n    with torch.no_grad():\n        tp_lin.weight._local_tensor.mul_(1.001)\n")
    replicated = ("torch.manual_seed(0)\n"
                  "tp_in = distribute_tensor(torch.randn(4, 8), tp_mesh, [Replicate()])\n"
                  "tp_out = tp_lin(tp_in)\n")
    report = _run(pool, replicated, numerics=True).numerics()
    d = report.first
    assert d is not None and d.what == "input" and d.odd == [2] and d.label == "tp_lin.weight" and d.why == "Replicate", report.text()
    assert d.line == 3


def test_a_healthy_fsdp2_with_tensor_parallel_step_reports_no_divergence(pool: distnb.Pool) -> None:
    setup = ("import torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
             "from torch.distributed.device_mesh import init_device_mesh\n"
             "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
             "ft_mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n"
             "torch.manual_seed(0)\n"
             "ft_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))\n"
             "parallelize_module(ft_model, ft_mesh['tp'], {'0': ColwiseParallel(), '2': RowwiseParallel()})\n"
             "fully_shard(ft_model, mesh=ft_mesh['dp'])\n"
             "ft_opt = torch.optim.SGD(ft_model.parameters(), lr=0.1)\n")
    _run(pool, setup)
    step = ("torch.manual_seed(ft_mesh['dp'].get_local_rank())\n"
            "ft_model(torch.randn(4, 8)).sum().backward()\n"
            "ft_opt.step()\n")
    report = _run(pool, step, numerics=True).numerics()
    assert report.first is None and not report.nonfinite, report.text()
    assert any(op.agree for op in report.records[0]), "the record knew no ranks that must agree"


def test_a_perturbation_injected_at_a_random_layer_and_rank_is_found_there(pool: distnb.Pool) -> None:
    _run(pool, "import torch.nn as nn\nfrom torch.distributed.device_mesh import init_device_mesh\n"
               "ri_mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('ri_a', 'ri_b'))\n"
               "torch.manual_seed(0)\nri_layers = [nn.Linear(8, 8) for _ in range(6)]\n")
    rng = random.Random(39)
    for _ in range(3):
        layer, culprit = rng.randrange(6), rng.randrange(4)
        code = ("torch.manual_seed(0)\n"
                "ri_h = torch.randn(2, 8)\n"
                "dist.all_reduce(ri_h)\n"
                "for i, ri_layer in enumerate(ri_layers):\n"
                "    ri_h = torch.tanh(ri_layer(ri_h))\n"
                f"    ri_h = ri_h + (1e-6 if i == {layer} and rank == {culprit} else 0.0)\n")
        # The layers' weights are the same everywhere only because every rank seeded them alike: name the ranks.
        report = _run(pool, code, numerics=True).numerics(agree="all")
        d = report.first
        assert d is not None and d.what == "output" and d.odd == [culprit], (layer, culprit, report.text())
        assert d.op == "aten.add.Tensor" and d.line == 6 and d.inputs_agreed and not d.args_agreed, report.text()
        # Its size: the 1e-6 added to each of the 16 elements (float32 rounding aside), all compared.
        assert d.size.exact and d.size.numel == 16 and abs(d.size.value - 1e-6) < 2e-7, d.size
        assert f"max abs diff {d.size.value:.3g}, all 16 elements compared" in report.text()
        adds = [op for op in report.records[culprit] if op.op == "aten.add.Tensor" and op.line == 6]
        assert d.seq[culprit] == adds[layer].seq, "not the injected layer's add"
        assert not report.programs
        # Named by a mesh dimension: each of its groups compared on its own (a pair: no majority).
        pair = [0, 1] if culprit < 2 else [2, 3]
        by_dim = _run(pool, code, numerics=True).numerics(agree="ri_b")
        assert by_dim.first is not None and by_dim.first.group == pair and by_dim.first.odd == pair, by_dim.text()
        assert by_dim.first.seq[culprit] == d.seq[culprit] and "no majority" in by_dim.text()
        # Without the named ranks only the all_reduce's output must agree: what follows from the
        # layers' weights (not known to agree) is not claimed.
        assert report.records and _run(pool, code, numerics=True).numerics().first is None


def test_two_runs_of_a_cell_compared_op_by_op(pool: distnb.Pool) -> None:
    _run(pool, "import torch.nn.functional as F\n")
    code = "torch.manual_seed({s})\ntr_a = torch.ones(16)\ntr_b = F.dropout(tr_a, 0.5)\ntr_c = tr_b * 2\n"
    one = _run(pool, code.format(s=0), numerics=True)
    same = _run(pool, code.format(s=0), numerics=True)
    other = _run(pool, code.format(s=1), numerics=True)
    rec = {r: x.numerics for r, x in one.results.items()}
    assert diff_runs(one.cell, rec, same.cell, {r: x.numerics for r, x in same.results.items()}).identical
    diff = diff_runs(one.cell, rec, other.cell, {r: x.numerics for r, x in other.results.items()})
    assert not diff.identical
    for _r, d in diff.per_rank.items():
        assert d is not None and d.how == "value" and "bernoulli" in d.a.op and d.a.line == 3, diff.text()
    assert "first difference at op #" in diff.text()


@pytest.mark.timeout(480)  # torch.compile's first compilation, on every rank of a busy machine
def test_eager_against_compiled(pool: distnb.Pool) -> None:
    """torch.compile runs compiled under the record (not eager, as it would under a plain dispatch
    mode), and the diff pairs the ops both runs made: the first one that differs is a real op of
    both, named as likely."""
    _run(pool, "import torch._dynamo\ntorch.manual_seed(0)\n"
               "ec_m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))\n"
               "ec_x = torch.randn(5, 8)\nec_c = torch.compile(ec_m)\n")
    eager = _run(pool, "ec_y = ec_m(ec_x)\ndist.all_reduce(ec_y)\n", numerics=True)
    compiled = _run(pool, "torch._dynamo.utils.counters.clear()\nec_y = ec_c(ec_x)\ndist.all_reduce(ec_y)\n"
                          "ec_graphs = torch._dynamo.utils.counters['stats']['unique_graphs']\n", numerics=True)
    assert all(v == 1 for v in pool.pull("ec_graphs").values())  # it compiled, under --numerics
    ops = [o.op for o in compiled.results[0].numerics["ops"]]  # type: ignore[index]
    assert "aten.gelu.default" not in ops and "c10d.allreduce_.default" in ops, ops  # the GELU fused away
    diff = diff_runs(eager.cell, {r: x.numerics for r, x in eager.results.items()},
                     compiled.cell, {r: x.numerics for r, x in compiled.results.items()})
    text = diff.text()
    for d in diff.per_rank.values():
        # Either every pair agrees bit for bit, or the first that does not is an op both made.
        assert d is None or d.how == "op" or (d.how == "value" and d.b is not None and d.a.op.rsplit(".", 1)[0] == d.b.op.rsplit(".", 1)[0]), text
        if d is not None and d.how == "value":
            assert "Likely, not certain: the two runs' ops had parted before it" in text
