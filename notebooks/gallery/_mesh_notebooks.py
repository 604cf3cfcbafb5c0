"""The gallery's device-mesh notebooks (10–12), built by ``_make.py``: a collective on the wrong
dimension of an HSDP mesh, FSDP2 with a parameter of another shape on one rank, and a
tensor-parallel plan that differs on one rank. ``_make.py`` hands in its cell types, so this file
imports nothing of it (``_make.py`` runs as a script)."""

from __future__ import annotations

from typing import Any

MESH = "from torch.distributed.device_mesh import init_device_mesh\n"


def notebooks(Notebook: Any, Md: Any, Code: Any, launch: Any, hang: str, ok: str, shutdown: Any) -> list[Any]:
    return [
        Notebook(
            "10_hsdp_wrong_group",
            "HSDP: a collective on the wrong mesh dimension",
            "001 D13, D21",
            "\"rank 1 called all_reduce over shard (ranks 0,1) where ranks 0,2,3 used replicate\"; who completed, who waits for whom; "
            "`%dist_mesh`, `%dist_collectives`",
            [
                Md("**Symptom.** An HSDP job (replicate across nodes, shard within: 001 D13) hangs at a metric or gradient "
                   "reduction. Half the ranks carry on — their groups happened to match — and the rest wait forever.\n\n"
                   "**Cause.** One rank reduces over another mesh dimension than its peers: here a dimension name read "
                   "from a per-rank config. Each group alone looks merely short of a member; only the ranks' calls side "
                   "by side, named by mesh dimension, show who went where."),
                launch(4),
                Code(f"{ok}\n{MESH}mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('replicate', 'shard'))\nmesh.get_coordinate()",
                     ["Out[rank 0]: (0, 0)", "Out[rank 3]: (1, 1)"]),
                Code("%dist_mesh --no-plot", ["mesh 1: (replicate=2, shard=2) on cpu", "replicate: (0,2) (1,3) · shard: (0,1) (2,3)"]),
                Md("## The failing cell\n\nEvery rank all_reduces its loss over `replicate`, except rank 1."),
                Code(f"{hang}\nloss = torch.tensor([float(rank)])\n"
                     "dim = 'shard' if rank == 1 else 'replicate'   # BUG: rank 1 read the dimension from its own config\n"
                     "dist.all_reduce(loss, group=mesh.get_group(dim))",
                     ["collective on another group: rank 1 called all_reduce over shard (ranks 0,1) where ranks 0,2,3 used replicate",
                      "Ranks 0,2 completed theirs", "rank 3 waits on replicate (ranks 1,3) for rank 1", "Root cause: rank 1, on the wrong group"],
                     ["finished the cell without entering"], raises=True),
                Md("## How distnb reveals it\n\ndistnb pairs each rank's calls of the cell across all its groups, names every "
                   "group as the mesh built it (`replicate (ranks 1,3)`, not a process-group number), and takes the majority "
                   "by mesh dimension. `%dist_collectives` leads with the same words; the tables below it show each group."),
                Code("%dist_collectives", ["first divergence: collective on another group: rank 1 called all_reduce over shard",
                                           "── replicate (ranks 1,3), torch's group"]),
                Code("%dist_restart", ["pool ready: 4 ranks"]),
                Md("## The fix\n\nOne dimension for every rank — take it from the code, not from a per-rank config."),
                Code(f"{ok}\n{MESH}mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('replicate', 'shard'))\n"
                     "loss = torch.tensor([float(rank)])\ndist.all_reduce(loss, group=mesh.get_group('replicate'))\nloss.item()",
                     ["Out[ranks 0,2]: 2.0", "Out[ranks 1,3]: 4.0"], ["timed out", "another group"]),
                shutdown,
            ],
        ),
        Notebook(
            "11_fsdp2_param_shape",
            "FSDP2: a parameter of another shape on one rank aborts a neighbour",
            "001 D19, D12",
            "\"shape mismatch at all_gather #1 on dp (ranks 0,2) … rank 0 died in it … Root cause: rank 2 (by majority over 4 ranks …)\" "
            "— the shape compared by majority across the mesh's dp groups; `%dist_collectives` marks the odd entry",
            [
                Md("**Symptom.** An FSDP2 job dies at its first forward: one rank is killed by SIGABRT inside an all_gather "
                   "with gloo's `Received data size doesn't match expected size`; another raises `Connection reset by peer`. "
                   "The logs point at the rank that died.\n\n"
                   "**Cause.** One rank built its model with another hidden size (a config value read per rank). FSDP2 "
                   "all-gathers each rank's shard; the rank whose shard is *larger* is the cause, the rank that received "
                   "it and could not hold it is the victim. Inside one dp group it is one rank against one: distnb takes "
                   "the majority across the mesh's other dp groups."),
                launch(4),
                Code(f"{ok}\n{MESH}mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))",
                     ["on ranks 0-3: ok"]),
                Md("## The failing cell"),
                Code(f"{ok}\nimport torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
                     "width = 12 if rank == 2 else 8          # BUG: a config value read per rank\n"
                     "model = nn.Linear(width, 8)\nfully_shard(model, mesh=mesh['dp'])\n"
                     "model(torch.randn(2, width)).sum().backward()",
                     # Whether rank 0's entry reached distnb before it died decides which rule speaks; both
                     # name the shape, rank 2, and the other dp group that outvotes a group of two.
                     ["Root cause: rank 2", "shape mismatch"], raises=True,
                     expect_re=[r"rank 2 all_gather (#1 )?\[52\] f32", r"by majority over 4 ranks|where ranks 1,3 had all_gather \[36\] f32"]),
                Md("The root cause comes first, above the aborted rank's own post-mortem. `%dist_collectives` marks the odd "
                   "entry and says which ranks witnessed the usual size:"),
                # Whether rank 0's entry reached distnb before gloo aborted it is a race: the verdict is the same.
                Code("%dist_collectives", ["(the odd one out: rank 2;", "ranks 1,3 had all_gather [36] f32 at #1 on the other groups"]),
                Code("%dist_restart", ["pool ready: 4 ranks"]),
                Md("## The fix\n\nOne configuration for every rank: read it once and broadcast it."),
                Code(f"{ok}\n{MESH}import torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
                     "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n"
                     "config = [12 if rank == 2 else 8]\ndist.broadcast_object_list(config, src=0)   # rank 0's value everywhere\n"
                     "model = nn.Linear(config[0], 8)\nfully_shard(model, mesh=mesh['dp'])\n"
                     "model(torch.randn(2, config[0])).sum().backward()\nconfig[0]",
                     ["Out[ranks 0-3]: 8"], ["Root cause", "SIGABRT"]),
                Code("%dist_check model", ["check model: identical on ranks 0-3", "sharded"]),
                shutdown,
            ],
        ),
        Notebook(
            "12_tp_plan_differs",
            "Tensor parallel: one rank's plan shards a layer the other way",
            "001 D19",
            "the odd rank by the majority of the mesh's other tp group (\"rank 3 scatter … ranks 0,1 had broadcast\"); "
            "`%dist_check` naming the placement; `--comms` per module once fixed",
            [
                Md("**Symptom.** `parallelize_module` hangs on some ranks, or the model trains to a different loss on one "
                   "tensor-parallel group.\n\n"
                   "**Cause.** The parallelize plan differs on one rank (built from a per-rank setting): its layer is "
                   "sharded column-wise where its peers shard it row-wise, so their placements disagree and DTensor's "
                   "distribution calls pair a scatter with a broadcast."),
                launch(4),
                Code(f"{ok}\n{MESH}import torch.nn as nn\n"
                     "import torch._dynamo  # parallelize_module imports it on first use: here, not in the cell timed below\n"
                     "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
                     "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))",
                     ["on ranks 0-3: ok"]),
                Md("## The failing cell"),
                Code(f"{hang}\ntorch.manual_seed(0)\nmodel = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))\n"
                     "second = ColwiseParallel() if rank == 3 else RowwiseParallel()   # BUG: a per-rank plan\n"
                     "parallelize_module(model, mesh['tp'], {'0': ColwiseParallel(), '2': second})",
                     ["op mismatch at scatter #4 on tp (ranks 2,3): rank 3 scatter #4 group_src=0 at cell line 4; "
                      "rank 2 broadcast #4 [8] f32 group_src=0", "Root cause: rank 3 (by majority over 4 ranks"],
                     ["No majority"], raises=True),
                Md("## How distnb reveals it\n\nInside tp (ranks 2,3) it is one rank against one; the mesh's other tp group "
                   "made the usual call at the same position, so distnb names rank 3:"),
                Code("%dist_collectives", ["different ops: rank 2 broadcast", "rank 3 scatter",
                                           "(the odd one out: rank 3; ranks 0,1 had broadcast"]),
                Code("%dist_restart", ["pool ready: 4 ranks"]),
                Md("## The fix\n\nOne plan for every rank. `%dist_check` compares the placements (a rank with `Shard(0)` where "
                   "the others have `Shard(1)` would be named), and `--comms` shows what each module now communicates."),
                Code(f"{ok}\n{MESH}import torch.nn as nn\n"
                     "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
                     "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n"
                     "torch.manual_seed(0)\nmodel = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))\n"
                     "parallelize_module(model, mesh['tp'], {'0': ColwiseParallel(), '2': RowwiseParallel()})\nNone",
                     ["on ranks 0-3: ok"], ["timed out"]),
                Code("%dist_check model", ["check model: identical on ranks 0-3", "sharded"]),
                Code("%%on_ranks --comms\nmodel(torch.randn(4, 8)).sum().item()",
                     ["communication of In[8]", "all_reduce", "tp", "redistributes (DTensor)", "all"], ["✗"]),
                shutdown,
            ],
        ),
    ]
