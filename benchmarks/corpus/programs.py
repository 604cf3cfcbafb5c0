"""Healthy SPMD programs for 4 ranks on gloo, one per pattern of the field.

Each is a ``setup`` cell (models, meshes, groups: run before every mutant, so a mutant starts from
a fresh state) and a ``step`` cell, the one the operators mutate. A line of ``step`` ending with a
marker comment is a *site*: ``#@ sync`` a statement that issues collectives (explicitly or inside
torch: DDP's buckets, FSDP's all_gathers), ``#@ call`` an explicit ``dist.*`` call whose arguments
the operators may change, ``#@ loop`` a ``for … in range(N)`` whose bound they may make per rank.
Marker options: ``on=1,2`` the ranks that run the line (default: all), ``group=NAME alt=OTHER``
another group of the program for the group operator, ``input=K`` which positional argument is the
input tensor (default 0), ``split`` an all_to_all_single with split sizes, ``assign`` a statement
whose name later lines use (never skipped: that would be a NameError, not a distributed bug),
``create`` a ``new_group`` call whose members the operators may change on one rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["PROGRAMS", "Program"]


@dataclass(frozen=True)
class Program:
    name: str
    pattern: str  # the field's pattern, in words
    setup: str
    step: str
    world: int = 4
    # Plain-Python names the step's peers are computed from (no torch), run before ``setup`` on the
    # ranks and by the peer operator, which needs each rank's peer to pick another.
    values: str = ""

    def step_code(self) -> str:
        """The step cell as it runs, markers removed."""
        return "\n".join(re.sub(r"\s*#@.*$", "", line) for line in self.step.strip("\n").splitlines()) + "\n"


PROGRAMS: list[Program] = [
    Program(
        "ddp_loop", "DDP training loop (bucketed all_reduce from C++), a logged loss",
        setup="""
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
""",
        step="""
losses = []
for step in range(3):  #@ loop
    x = torch.randn(16, 32, generator=gen)
    loss = model(x).pow(2).mean()
    loss.backward()  #@ sync
    opt.step()
    opt.zero_grad()
    losses.append(loss.detach())
total = torch.stack(losses).sum().reshape(1)
dist.all_reduce(total)  #@ call
""",
    ),
    Program(
        "fsdp2", "FSDP2 (fully_shard): all_gather in forward, reduce_scatter in backward",
        setup="""
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
torch.manual_seed(0)
fmesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
fmodel = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
fully_shard(fmodel[0], mesh=fmesh)
fully_shard(fmodel[2], mesh=fmesh)
fully_shard(fmodel, mesh=fmesh)
fopt = torch.optim.SGD(fmodel.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
""",
        step="""
for step in range(2):  #@ loop
    x = torch.randn(8, 16, generator=gen)
    loss = fmodel(x).sum()  #@ sync assign
    loss.backward()  #@ sync
    fopt.step()
    fopt.zero_grad()
stat = loss.detach().reshape(1)
dist.all_reduce(stat)  #@ call
""",
    ),
    Program(
        "tensor_parallel", "tensor parallel (Colwise then Rowwise): DTensor redistributes in forward and backward",
        setup="""
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
torch.manual_seed(0)
tmesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
mlp = parallelize_module(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), tmesh,
                         {"0": ColwiseParallel(), "2": RowwiseParallel()})
gen = torch.Generator().manual_seed(0)  # tensor-parallel peers see the same batch
""",
        step="""
for step in range(2):  #@ loop
    x = torch.randn(4, 16, generator=gen, requires_grad=True)  # its gradient is reduced across the tp group
    out = mlp(x)  #@ sync assign
    out.sum().backward()  #@ sync
score = out.detach().sum().reshape(1)
dist.all_reduce(score)  #@ call
""",
    ),
    Program(
        "hsdp_mesh", "a (dp, tp) mesh: gradients reduced over dp, shards gathered over tp",
        setup="""
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
""",
        step="""
grad = torch.full((6,), float(rank))
shard = torch.ones(3) * rank
for step in range(2):  #@ loop
    dist.all_reduce(grad, group=dp)  #@ call group=dp alt=tp
    full = torch.empty(6)
    dist.all_gather_into_tensor(full, shard, group=tp)  #@ call group=tp alt=dp input=1
    grad = grad + full
""",
    ),
    Program(
        "pipeline", "pipeline stages: each rank receives from the one before and sends to the next",
        values="stages = world_size",
        setup="""
pass
""",
        step="""
acts = []
for mb in range(3):  #@ loop
    if rank == 0:
        h = torch.full((4,), float(mb))
    else:
        h = torch.empty(4)
        dist.recv(h, src=rank - 1)  #@ call on=1,2,3
    h = h * 2 + 1
    if rank < stages - 1:
        dist.send(h, dst=rank + 1)  #@ call on=0,1,2
    acts.append(h)
""",
    ),
    Program(
        "ring", "a ring of isend/irecv, waited on together",
        values="ring_next, ring_prev = (rank + 1) % world_size, (rank - 1) % world_size",
        setup="""
pass
""",
        step="""
buf = torch.full((5,), float(rank))
for hop in range(3):  #@ loop
    out = torch.empty(5)
    reqs = []
    reqs.append(dist.isend(buf, dst=ring_next))  #@ call
    reqs.append(dist.irecv(out, src=ring_prev))  #@ call
    for req in reqs:
        req.wait()
    buf = out + 1
""",
    ),
    Program(
        "experts", "expert parallel: all_to_all_single with split sizes",
        setup="""
splits = [2] * world_size
""",
        step="""
tokens = torch.arange(8, dtype=torch.float32) + 100 * rank
for layer in range(2):  #@ loop
    routed = torch.empty(8)
    dist.all_to_all_single(routed, tokens, splits, splits)  #@ call split input=1
    tokens = routed * 2
""",
    ),
    Program(
        "objects", "object collectives: all_gather_object and broadcast_object_list",
        setup="""
config = {"lr": 0.1}
""",
        step="""
for rnd in range(2):  #@ loop
    seen = [None] * world_size
    dist.all_gather_object(seen, {"rank": rank, "round": rnd})  #@ call
    box = [dict(config, round=rnd)] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)  #@ call
""",
    ),
    Program(
        "checkpoint", "distributed checkpoint: dcp.save then dcp.load",
        setup="""
import os, tempfile
import torch.nn as nn
import torch.distributed.checkpoint as dcp
torch.manual_seed(0)
ck_model = nn.Linear(8, 8)
ck_dir = os.path.join(tempfile.gettempdir(), f"distnb-corpus-ckpt-{os.environ.get('MASTER_PORT', '0')}")
""",
        step="""
for it in range(2):  #@ loop
    state = {"model": ck_model.state_dict()}
    dcp.save(state, checkpoint_id=f"{ck_dir}/{it}")  #@ sync
    dcp.load(state, checkpoint_id=f"{ck_dir}/{it}")  #@ sync
""",
    ),
    Program(
        "compiled", "a compiled forward (torch.compile) with gradients reduced by hand",
        setup="""
import torch.nn as nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
forward = torch.compile(net, backend="eager")
gen = torch.Generator().manual_seed(rank)
""",
        step="""
for step in range(2):  #@ loop
    x = torch.randn(8, 16, generator=gen)
    forward(x).sum().backward()
    for p in net.parameters():
        dist.all_reduce(p.grad)  #@ call
        p.grad = None
""",
    ),
    Program(
        "subgroups", "new_group on every rank, a collective per subgroup, a barrier on all",
        setup="""
pass
""",
        step="""
lo = dist.new_group([0, 1])  #@ sync assign create
hi = dist.new_group([2, 3])  #@ sync assign create
mine = lo if rank < 2 else hi
v = torch.ones(3) * rank
for it in range(2):  #@ loop
    dist.all_reduce(v, group=mine)  #@ call group=mine alt=None
dist.barrier()  #@ call
""",
    ),
]
