"""Builds the failure gallery (run: python notebooks/gallery/_make.py).

Each notebook reproduces one failure from the field's catalogue (the three guides in the project's
``shared/seeds/``: 000 = torchrun/NCCL troubleshooting, 001 = reference entries D1–D23, 002 = the
minimal-reproduction guide) on a small CPU (gloo) pool: the symptom, the failing cell, how distnb
reveals it, the fix, and the fixed cell passing. Notebooks are written without outputs.

A code cell's metadata says what tests/e2e/test_gallery.py checks after executing the notebook:
``distnb_expect`` (text its output must contain), ``distnb_reject`` (text it must not contain) and
``distnb_mime`` (output types it must produce, e.g. ``image/png``) and ``distnb_expect_re`` (regular
expressions that must match a line of its output). A cell that fails on purpose carries Jupyter's
``raises-exception`` tag: its error does not stop Run All (JupyterLab, nbclient), and the test checks
that it did fail, with distnb's one-line error.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

#: A cell that is expected to hang: it returns after --timeout, with the diagnosis printed live.
HANG = "%%on_ranks --timeout 6 --hang-after 1"
#: A cell that must finish well within its timeout: it bounds a failure only (a healthy cell ends
#: when it is done), so it allows a machine busy with other work.
OK = "%%on_ranks --timeout 120"
#: The same for a cell that builds a rank's first DDP model: DDP's constructor imports torch._dynamo
#: (~3 s of CPU a rank on a 2-core machine: four ranks took over 60 s on one busy with a second test
#: run), and a rank that finishes first waits for the others in DDP's first collective — slow, not
#: hung; --hang-after 10 keeps that from being reported.
DDP_OK = "%%on_ranks --timeout 180 --hang-after 10"


@dataclass
class Md:
    text: str


@dataclass
class Code:
    source: str
    expect: list[str] = field(default_factory=list)
    reject: list[str] = field(default_factory=list)
    mime: list[str] = field(default_factory=list)
    expect_re: list[str] = field(default_factory=list)  # regular expressions, searched line by line
    # The cell fails on purpose (a hang past its --timeout, a rank that raises or dies): %%on_ranks then
    # raises, which stops Run All; Jupyter's raises-exception tag lets the notebook (and CI) run through.
    raises: bool = False


def launch(n: int, extra: str = "") -> Code:
    return Code(f"%load_ext distnb\n%dist_launch -n {n} --backend gloo{extra}", [f"pool ready: {n} ranks"])


SHUTDOWN = Code("%dist_shutdown", ["pool stopped", "no process left"])


@dataclass
class Notebook:
    name: str
    title: str
    seed: str  # catalogue reference, e.g. "001 D21"
    shows: str  # one line for the index: what distnb shows
    cells: list[Md | Code]


GALLERY: list[Notebook] = [
    Notebook(
        "01_rank_conditional_barrier",
        "A collective inside `if rank == 0:` — the checkpoint-save deadlock",
        "001 D21",
        "live diagnosis naming the waiting rank, the barrier and its cell line; `%dist_status`, `%dist_stacks`",
        [
            Md("**Symptom.** The job hangs reproducibly at the same spot — validation, logging, or checkpoint "
               "save — with no error and no output (001 D21; the classic is \"save on rank 0 only\").\n\n"
               "**Cause.** A collective — here a `dist.barrier()`, often one hidden in a metric's all_reduce, "
               "an `all_gather` or a save helper — sits inside `if rank == 0:`. Rank 0 enters it; the other "
               "ranks never do, and rank 0 waits forever."),
            launch(3),
            Code("import os, tempfile\nckpt_path = os.path.join(tempfile.mkdtemp(), 'ckpt.pt')\n%dist_push ckpt_path"),
            Md("## The failing cell\n\nRank 0 saves a checkpoint and then waits for the others in a barrier that "
               "only it reaches. `--hang-after 1` asks distnb to diagnose after one second; `--timeout 6` gives "
               "the notebook back while rank 0 stays blocked."),
            Code(f"{HANG}\nstate = {{'step': 100, 'weights': torch.full((3,), 0.5)}}\n"
                 "if rank == 0:                      # save on rank 0 only ...\n"
                 "    torch.save(state, ckpt_path)\n"
                 "    dist.barrier()                 # BUG: ... but the barrier is inside the `if`",
                 ["rank-conditional collective: rank 0 entered barrier #1 at cell line 4",
                  "ranks 1,2 finished the cell without entering it",
                  "rank 0: waiting in barrier #1 on group 0",
                  "ranks 1,2: finished the cell"],
                 # Measured from the cell's start, at its --timeout or later (a busy machine): never earlier.
                 expect_re=[r"rank 0 has timed out after ([6-9]|\d\d+)\.\d s"], raises=True),
            Md("## How distnb reveals it\n\nThe diagnosis above appeared while the cell was running: the rank that "
               "waits, the collective and its cell line, and the ranks that never came. `%dist_status` and "
               "`%dist_stacks` confirm it: rank 0 is still inside the barrier, ranks 1 and 2 are idle."),
            Code("%dist_status", ["running In[3]", "idle"]),
            Code("%dist_stacks", ["rank 0: running In[3]", "in barrier", "dist.barrier()", "ranks 1,2: idle"]),
            Md("## The fix\n\nGate only the side effect, never the collective: every rank reaches the barrier. "
               "It now also does something useful — after it the file is complete, so every rank may read it "
               "(001 D23). A hung rank can't be recovered in place: `%dist_restart` gives fresh ranks."),
            Code("%dist_restart\n%dist_push ckpt_path", ["pool ready: 3 ranks"]),
            Code(f"{OK}\nstate = {{'step': 100, 'weights': torch.full((3,), 0.5)}}\n"
                 "if rank == 0:\n"
                 "    torch.save(state, ckpt_path)   # only the side effect is rank-conditional\n"
                 "dist.barrier()                     # every rank: the file is complete after this\n"
                 "torch.load(ckpt_path)['step']      # so every rank can read it",
                 ["In[7] on ranks 0-2: ok", "Out[ranks 0-2]: 100"], ["timed out", "rank-conditional"]),
            SHUTDOWN,
        ],
    ),
    Notebook(
        "02_uneven_batches",
        "Uneven batches per rank: the hang at the last step",
        "001 D9, D22",
        "\"uneven loop: rank 0 ran 3 steps of (all_reduce [4] f32) … ranks 1,2 ran 2\"; `%dist_collectives`; "
        "fixed with `DistributedSampler` padding and with `Join`",
        [
            Md("**Symptom.** Training runs most of an epoch, then freezes on the final batch (001 D9); or it hangs "
               "at the end of every epoch (001 D22).\n\n"
               "**Cause.** The ranks see different numbers of batches — a custom sampler or shard without padding, "
               "a per-rank filter, an `IterableDataset`. DDP all-reduces gradients every step, so the rank with "
               "more batches waits in the all_reduce of a step the others never take."),
            launch(3),
            Md("## The failing cell\n\n7 samples sharded by hand over 3 ranks: rank 0 gets 3, ranks 1 and 2 get 2. "
               "The `all_reduce` stands for DDP's gradient reduction in `backward()`."),
            Code(f"{HANG}\ndataset = torch.arange(7.)\n"
                 "shard = dataset[rank::world_size]          # BUG: 3 samples on rank 0, 2 on ranks 1,2\n"
                 "print(f'{len(shard)} batches')\n"
                 "for sample in shard:\n"
                 "    grad = sample * torch.ones(4)           # stand-in for loss.backward()\n"
                 "    dist.all_reduce(grad)                   # DDP does this every step",
                 ["[rank 0] 3 batches", "[ranks 1,2] 2 batches",
                  "uneven loop: rank 0 ran 3 steps of (all_reduce [4] f32) at cell line 6 on group 0, ranks 1,2 ran 2",
                  "is inside `for sample in shard:`", "a loop of another length per rank", "Root cause: rank 0.",
                  "rank 0: waiting in all_reduce #3 on group 0"], raises=True),
            Md("## How distnb reveals it\n\nThe live diagnosis counts each rank's collectives. `%dist_collectives` "
               "shows the sequences side by side (read from PyTorch's Flight Recorder) with the first divergence "
               "marked."),
            Code("%dist_collectives", ["first divergence: collective #3 on group 0",
                                       "rank 0 entered all_reduce, ranks 1,2 never did",
                                       "rank 0 3, rank 1 2, rank 2 2 collectives"]),
            Md("## Fix 1: equal lengths — `DistributedSampler`\n\n`DistributedSampler` equalises the shards: with "
               "`drop_last=False` (the default) it pads by repeating samples, with `drop_last=True` it drops the "
               "tail. Every rank gets 3 indices here. (Equivalent by hand: all_reduce the batch count with "
               "`ReduceOp.MIN` first and stop there.)"),
            Code("%dist_restart", ["pool ready: 3 ranks"]),
            Code(f"{OK}\nfrom torch.utils.data import DistributedSampler\ndataset = torch.arange(7.)\n"
                 "sampler = DistributedSampler(dataset, shuffle=False)   # pads: 3 indices on every rank\n"
                 "indices = list(sampler)\n"
                 "for i in indices:\n"
                 "    grad = dataset[i] * torch.ones(4)\n"
                 "    dist.all_reduce(grad)\n"
                 "indices",
                 ["Out[rank 0]: [0, 3, 6]", "Out[rank 1]: [1, 4, 0]", "Out[rank 2]: [2, 5, 1]"],
                 ["timed out", "uneven"]),
            Md("## Fix 2: truly uneven inputs — `Join`\n\nWhen the data can't be padded, wrap the loop in the "
               "`Join` context manager: a rank that runs out of batches shadows the others' collectives "
               "(all-reducing zeros) until every rank is done. It works with DDP (and `ZeroRedundancyOptimizer`)."),
            Code(f"{DDP_OK}\nfrom torch.distributed.algorithms.join import Join\n"
                 "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                 "model = DDP(torch.nn.Linear(4, 1))\n"
                 "shard = dataset[rank::world_size]          # still 3, 2, 2 samples\n"
                 "with Join([model]):\n"
                 "    for sample in shard:\n"
                 "        model(sample * torch.ones(1, 4)).sum().backward()\n"
                 "f'{len(shard)} steps, done'",
                 ["Out[rank 0]: '3 steps, done'", "Out[ranks 1,2]: '2 steps, done'"], ["timed out"]),
            SHUTDOWN,
        ],
    ),
    Notebook(
        "03_shape_mismatch",
        "Shape mismatch in all_reduce: an abort, a hang — or a wrong answer",
        "001 D19",
        "a rank killed by SIGABRT named in the post-mortem; a hang with both shapes named; `--debug detail`",
        [
            Md("**Symptom.** Ranks call the same collective with tensors of different shapes — a short last "
               "batch on one rank, an unpadded sequence, a buffer sized from rank-local data. What happens "
               "depends on the sizes: with gloo a large mismatch kills a rank (SIGABRT), a small one hangs — after "
               "handing some ranks a wrong result. (That is gloo on CPU; other backends fail in their own ways.)\n\n"
               "**The desync toolkit (001 D19):** `TORCH_DISTRIBUTED_DEBUG=DETAIL` checks every collective across "
               "ranks first and raises an error naming the mismatch. distnb sets it with `%dist_launch --debug "
               "detail`; without it distnb still names the rank and the shapes."),
            launch(2),
            Md("## Without a debug mode (1): a large mismatch aborts a rank\n\nRank 1's last batch is short: 48 "
               "rows instead of 64."),
            Code(f"{HANG}\nbatch = torch.ones(64 if rank == 0 else 48, 16)   # BUG: rank 1 got a short last batch\n"
                 "dist.all_reduce(batch)",
                 ["rank 1 died first: aborted (SIGABRT", "Received data size doesn't match expected size",
                  "Is there a distributed collective mismatch in your code?"], raises=True),
            Md("distnb's post-mortem names the rank that died first, how (the signal, in words) and its last stderr "
               "lines — gloo's `Received data size doesn't match expected size`. Rank 0's `Connection reset by "
               "peer` is the consequence, not the cause. `%dist_status` shows the dead rank:"),
            Code("%dist_status", ["pool broken", "dead: aborted (SIGABRT"]),
            Code("%dist_restart", ["pool ready: 2 ranks"]),
            Md("## Without a debug mode (2): a small mismatch hangs — after a wrong answer"),
            Code(f"{HANG}\nx = torch.ones(3 if rank == 0 else 4)          # BUG: 3 elements on rank 0, 4 on rank 1\n"
                 "dist.all_reduce(x)\nx",
                 ["shape mismatch at all_reduce #1 on group 0",
                  "rank 0 all_reduce #1 [3] f32 at cell line 2; rank 1 all_reduce #1 [4] f32",
                  "No majority to tell which side went wrong: rank 0 against rank 1", "rank 0: finished the cell",
                  "Out[rank 0]: tensor([2., 2., 2.])"], raises=True),
            Md("Rank 0 got a plausible-looking `tensor([2., 2., 2.])` and carried on; only rank 1 hangs. From the "
               "logs alone you'd look at rank 1. distnb compares both ranks' collective logs and names the "
               "mismatch: `[3]` against `[4]`."),
            Md("## With `--debug detail`: the error names the shapes"),
            Code("%dist_shutdown\n%dist_launch -n 2 --backend gloo --debug detail", ["pool ready: 2 ranks"]),
            Code(f"{OK}\nbatch = torch.ones(64 if rank == 0 else 48, 16)\ndist.all_reduce(batch)",
                 ["Detected mismatch between collectives on ranks", "TensorShape=[64, 16]", "TensorShape=[48, 16]",
                  "Tensor shapes", "RuntimeError on rank"], ["SIGABRT", "timed out"], raises=True),
            Md("Every rank raises instead of hanging or aborting, and the pool stays usable. (DETAIL runs extra "
               "collectives per call: use it to diagnose, not in production.)\n\n"
               "## The fix\n\nThe same shape on every rank: `drop_last=True`, or pad to the largest (below), or "
               "all_gather the sizes first."),
            Code(f"{OK}\nbatch = torch.ones(64 if rank == 0 else 48, 16)\n"
                 "rows = torch.tensor(batch.shape[0])\n"
                 "dist.all_reduce(rows, op=dist.ReduceOp.MAX)           # agree on the shape first\n"
                 "batch = torch.nn.functional.pad(batch, (0, 0, 0, int(rows) - batch.shape[0]))\n"
                 "dist.all_reduce(batch)\n"
                 "(tuple(batch.shape), batch.sum().item())",
                 ["Out[ranks 0,1]: ((64, 16), 1792.0)"], ["Error", "timed out"]),
            SHUTDOWN,
        ],
    ),
    Notebook(
        "04_rank_raises",
        "One rank raises, the others wait — until distnb ends the cell",
        "001 D20",
        "\"rank 1 raised KeyError and left In[2]; the others wait … ending the cell now instead of at its timeout\"; `%dist_status`",
        [
            Md("**Symptom.** Training ran for a while, then froze. One rank's log shows an exception (a bad "
               "sample, a NaN check, an OOM); the others sit in all_reduce until the collective timeout — 30 "
               "minutes later, far from the cause (001 D20).\n\n"
               "**Cause.** The crash is the cause, the hang is the symptom: a rank that leaves the step stops "
               "calling collectives, and the others block."),
            launch(3),
            Md("## The failing cell\n\nRank 1's batch holds a sample without a label."),
            # Its --timeout only bounds a failure of the test: distnb ends the cell (never "timed out",
            # rejected below) within seconds however long it is, and a busy machine may take more than 6.
            Code("%%on_ranks --timeout 60 --hang-after 1\nbatch = [{'label': 3}, {}, {'label': 1}][rank]   # BUG: rank 1's sample has no label\n"
                 "loss = torch.tensor(float(batch['label']))\n"
                 "dist.all_reduce(loss)                            # ranks 0,2 wait here for rank 1",
                 ["[distnb] rank 1 raised KeyError and left In[2]; the others wait (ranks 0,2 in all_reduce",
                  "ending the cell now instead of at its timeout",
                  "KeyError on rank 1 at cell line 2",
                  "KeyboardInterrupt on ranks 0,2 at cell line 3, a consequence"], ["timed out"], raises=True),
            Md("## How distnb reveals it\n\nThe report puts the error first: the root cause is on rank 1, and "
               "ranks 0 and 2 were only its victims. Their all_reduce could never complete without rank 1, and the "
               "log proved it, so distnb ended the cell within seconds — not at the collective timeout, 30 minutes "
               "later — interrupting them, rebuilding the group and keeping every namespace. `%dist_status` shows "
               "every rank idle again:"),
            Code("%dist_status", ["idle"], ["running cell"]),
            Md("## The fix\n\nFix the failing rank, not the hang (001 D20). When a rank must skip a step, every "
               "rank has to agree — one all_reduce of a flag — so that no rank is left waiting."),
            Code("%dist_restart", ["pool ready: 3 ranks"]),
            Code(f"{OK}\ndef train_step(batch):\n"
                 "    ok = torch.tensor(float('label' in batch))\n"
                 "    dist.all_reduce(ok, op=dist.ReduceOp.MIN)    # every rank learns whether any batch is bad\n"
                 "    if not ok:\n"
                 "        return 'skipped on every rank'           # all ranks skip together\n"
                 "    loss = torch.tensor(float(batch['label']))\n"
                 "    dist.all_reduce(loss)\n"
                 "    return loss.item()\n"
                 "\n"
                 "[train_step([{'label': 3}, {}, {'label': 1}][rank]), train_step({'label': rank})]",
                 ["Out[ranks 0-2]: ['skipped on every rank', 3.0]"], ["timed out", "Error"]),
            SHUTDOWN,
        ],
    ),
    Notebook(
        "05_ddp_unused_parameters",
        "DDP with unused parameters: \"Expected to have finished reduction in the prior iteration\"",
        "001 D8",
        "the DDP error on every rank at the second iteration, with the parameter indices; both fixes",
        [
            Md("**Symptom.** `RuntimeError: Expected to have finished reduction in the prior iteration before "
               "starting a new one` — on the second iteration, never the first (001 D8).\n\n"
               "**Cause.** DDP waits for a gradient from every parameter each step. A branch that takes no part "
               "in the loss (a conditional head, a frozen layer) never produces one, so the reduction of step 0 "
               "never completes and step 1 refuses to start."),
            launch(2),
            Code("%%on_ranks\nimport torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\n"
                 "class Net(nn.Module):\n"
                 "    def __init__(self):\n"
                 "        super().__init__()\n"
                 "        self.body = nn.Linear(4, 4)\n"
                 "        self.aux_head = nn.Linear(4, 1)   # parameters 2 and 3: only used when aux=True\n"
                 "        self.head = nn.Linear(4, 1)\n"
                 "\n"
                 "    def forward(self, x, aux=False):\n"
                 "        h = self.body(x)\n"
                 "        return self.head(h) + (self.aux_head(h) if aux else 0)",
                 ["In[2] on ranks 0,1: ok"]),
            Md("## The failing cell"),
            Code(f"{DDP_OK}\nmodel = DDP(Net())\n"
                 "for step in range(2):\n"
                 "    model(torch.randn(8, 4)).sum().backward()   # aux_head gets no gradient\n"
                 "    print(f'step {step} done')",
                 ["[ranks 0,1] step 0 done", "RuntimeError on ranks 0,1 at cell line 3",
                  "Expected to have finished reduction in the prior iteration", "the RuntimeError messages differ:",
                  "  rank 0: Parameter indices which did not receive grad for rank 0: 2 3",
                  "  rank 1: Parameter indices which did not receive grad for rank 1: 2 3"], ["step 1 done"], raises=True),
            Md("## How distnb reveals it\n\nStep 0 printed once for both ranks, then both raised at cell line 3 on step 1, "
               "each naming the parameters that got no gradient: indices 2 and 3, `aux_head`. (`%dist_launch "
               "--debug detail` would print their names.) Nothing hangs here, so the pool is still usable.\n\n"
               "## Fix 1 (best): every parameter takes part in the loss\n\nOften the real bug is a dropped "
               "head. Use it (or delete it):"),
            Code(f"{OK}\nmodel = DDP(Net())\n"
                 "for step in range(2):\n"
                 "    model(torch.randn(8, 4), aux=True).sum().backward()\n"
                 "'ok'",
                 ["Out[ranks 0,1]: 'ok'"], ["Error"]),
            Md("## Fix 2: a branch that is legitimately unused on some steps\n\n`find_unused_parameters=True` "
               "marks the unused parameters ready after each forward (at the cost of a graph traversal per step). "
               "Don't use it to silence a real bug."),
            Code(f"{OK}\nmodel = DDP(Net(), find_unused_parameters=True)\n"
                 "for step in range(2):\n"
                 "    model(torch.randn(8, 4)).sum().backward()   # aux_head still unused: now allowed\n"
                 "'ok'",
                 ["Out[ranks 0,1]: 'ok'"], ["Error", "Expected to have finished"]),
            SHUTDOWN,
        ],
    ),
    Notebook(
        "06_rank_vs_local_rank",
        "RANK vs LOCAL_RANK: the wrong GPU on the second node",
        "001 D3",
        "a real 2-node layout on one machine (`--local-nodes`): `%dist_env` with RANK, LOCAL_RANK and GROUP_RANK per rank; `set_device(RANK)` failing on node 1's ranks only",
        [
            Md("**Symptom.** Single-node runs are fine; on two nodes, node 1's processes pile onto GPU 0 or fail "
               "with `invalid device ordinal`, while its other GPUs sit idle (001 D3).\n\n"
               "**Cause.** `torch.cuda.set_device(RANK)`. `RANK` is the global rank (it selects the data shard); "
               "the GPU must come from `LOCAL_RANK`, the rank's index on its own node. On one node the two are "
               "equal, so the bug hides — until the job spans machines."),
            Md("## A two-node layout on one machine\n\n`--local-nodes` starts the second node's torchrun agent on "
               "this machine: two torchruns meet in one c10d rendezvous, exactly as on a cluster, so the ranks get "
               "the variables a real 2-node job gets."),
            Code("%load_ext distnb\n%dist_launch --nnodes 2 -n 2 --local-nodes",
                 ["pool ready: 4 ranks on 2 nodes", "the node agent on"]),
            Md("## What each rank was given\n\n`%dist_env` lists torchrun's variables per rank: `RANK` runs 0–3 "
               "across the job, `LOCAL_RANK` restarts at 0 on each node, `GROUP_RANK` is the node."),
            Code("%dist_env", ["environment of ranks 0-3"],
                 expect_re=[r"^  RANK +0, 1, 2, 3 \(per rank, as expected\)$",
                            r"^  LOCAL_RANK +ranks 0,2: 0; ranks 1,3: 1$",
                            r"^  GROUP_RANK +ranks 0,1: 0; ranks 2,3: 1$",
                            r"^  LOCAL_WORLD_SIZE +2 \(all ranks\)$"]),
            Md("## The failing cell\n\nEach node has one GPU per local rank (`LOCAL_WORLD_SIZE` = 2). On this CPU "
               "machine `set_device` below does what `torch.cuda.set_device` does with an index the node "
               "doesn't have:"),
            Code("%%on_ranks --timeout 120\nimport os\n"
                 "gpus_per_node = int(os.environ['LOCAL_WORLD_SIZE'])\n"
                 "def set_device(i):   # torch.cuda.set_device(i) on a node with gpus_per_node GPUs\n"
                 "    if not 0 <= i < gpus_per_node:\n"
                 "        raise RuntimeError(f'CUDA error: invalid device ordinal (cuda:{i} on a node with {gpus_per_node} GPUs)')\n"
                 "    return f'cuda:{i}'\n"
                 "set_device(rank)     # BUG: the global rank",
                 ["Out[rank 0]: 'cuda:0'", "Out[rank 1]: 'cuda:1'",
                  "RuntimeError on ranks 2,3 at cell line 5", "  rank 3: CUDA error: invalid device ordinal (cuda:3 on a node with 2 GPUs)",
                  "invalid device ordinal (cuda:2 on a node with 2 GPUs)"], raises=True),
            Md("Node 0 is fine; both ranks of node 1 fail. (`RANK % gpus_per_node` would hide it here, but "
               "breaks as soon as nodes run different numbers of ranks.)\n\n"
               "## The fix\n\n`torch.cuda.set_device(int(os.environ['LOCAL_RANK']))` — distnb's ranks already bind "
               "`device` this way. Check that the ranks of each node pick distinct devices:"),
            Code(f"{OK}\n"
                 "node = int(os.environ['GROUP_RANK'])\n"
                 "gpu = set_device(int(os.environ['LOCAL_RANK']))\n"
                 "picked = [None] * world_size\n"
                 "dist.all_gather_object(picked, (node, gpu))     # what every rank picked\n"
                 "f'rank {rank}: {gpu}; node {node} uses {sorted(g for n, g in picked if n == node)}'",
                 ["Out[rank 0]: \"rank 0: cuda:0; node 0 uses ['cuda:0', 'cuda:1']\"",
                  "Out[rank 2]: \"rank 2: cuda:0; node 1 uses ['cuda:0', 'cuda:1']\"",
                  "Out[rank 3]: \"rank 3: cuda:1; node 1 uses ['cuda:0', 'cuda:1']\""], ["Error"]),
            SHUTDOWN,
        ],
    ),
    Notebook(
        "07_memory_imbalance",
        "One rank runs out of memory while the others have room",
        "000 issue 6",
        "the per-cell memory line and `%dist_memory` flagging rank 1 (\"peaks at N× the median\"), `--plot`; balanced after the fix",
        [
            Md("**Symptom.** One GPU runs out of memory while the others have plenty free (000, issue 6). "
               "`nvidia-smi` shows it, but not why.\n\n"
               "**Cause.** Unbalanced memory across ranks: uneven batches, or — here — one rank holding on to "
               "tensors the others drop. Rank 1 logs the loss, and appends the loss *tensor* instead of the "
               "number, keeping every step's autograd graph alive. On this CPU pool the same shows in each rank's "
               "RSS (on GPUs distnb also reports CUDA allocated/reserved/peak)."),
            launch(2),
            Md("## The failing cell"),
            Code("%%on_ranks\nw = torch.ones(2_500_000, requires_grad=True)\nlosses = []\n"
                 "for step in range(50):\n"
                 "    x = torch.randn(2_500_000)                # this step's batch: 10 MB\n"
                 "    loss = (w * x).sum()                      # autograd keeps x for the backward pass\n"
                 "    if rank == 1:                             # the rank that logs ...\n"
                 "        losses.append(loss)                   # BUG: ... keeps every step's graph, and x with it",
                 ["In[2] on ranks 0,1: ok", "⚠ rank 1 peaks at"]),
            Md("## How distnb reveals it\n\nThe memory line under the cell already flags rank 1. `%dist_memory` "
               "gives the per-rank table and `--plot` a bar chart:"),
            Code("%dist_memory --plot", ["memory of ranks 0,1", "⚠ rank 1 peaks at", "the median RSS peak of the others"],
                 mime=["image/png"]),
            Md("## The fix\n\nLog numbers, not tensors: `loss.item()` (or `loss.detach()`). Re-check in fresh "
               "ranks: memory freed inside a process is often kept by the allocator for reuse, so a process's RSS "
               "(like CUDA's reserved memory) rarely shrinks back on its own."),
            Code("%dist_restart", ["pool ready: 2 ranks"]),
            Code("%%on_ranks\nw = torch.ones(2_500_000, requires_grad=True)\nlosses = []\n"
                 "for step in range(50):\n"
                 "    x = torch.randn(2_500_000)\n"
                 "    loss = (w * x).sum()\n"
                 "    if rank == 1:\n"
                 "        losses.append(loss.item())            # a float: the graph is freed every step\n"
                 "len(losses)",
                 ["Out[rank 0]: 0", "Out[rank 1]: 50"], ["⚠"]),
            Code("%dist_memory", ["memory of ranks 0,1"], ["⚠"]),
            SHUTDOWN,
        ],
    ),
    Notebook(
        "08_effective_batch_lr",
        "N ranks silently multiply the batch — and the learning rate is now wrong",
        "001 D11",
        "per-rank batch, global batch = per-rank × world size (checked by all_reduce and by DDP's gradient) at 4 ranks and again at 2, the linear-scaling rule",
        [
            Md("**Symptom.** Moving from 1 GPU to N makes training diverge or plateau: the loss curve changes "
               "shape \"with the same config\" (001 D11).\n\n"
               "**Cause.** DDP keeps the per-GPU batch size, so one optimizer step now sees per-rank batch × world "
               "size samples, and the learning rate tuned for the 1-GPU batch no longer fits."),
            launch(4),
            Code("per_rank_batch, base_lr, base_batch = 32, 0.1, 32   # the config tuned on 1 GPU\n"
                 "%dist_push per_rank_batch base_lr base_batch"),
            Md("## What each rank does with the \"same config\""),
            Code(f"{OK}\nfrom torch.utils.data import DataLoader, DistributedSampler, TensorDataset\n"
                 "data = TensorDataset(torch.randn(1024, 4), torch.randn(1024, 1))\n"
                 "loader = DataLoader(data, batch_size=per_rank_batch, sampler=DistributedSampler(data))\n"
                 "x, y = next(iter(loader))\n"
                 "seen = torch.tensor(len(x))\n"
                 "dist.all_reduce(seen)                             # samples in one optimizer step, all ranks\n"
                 "print(f'per-rank batch {len(x)}, {len(loader)} steps per epoch; '\n"
                 "      f'global batch {int(seen)} = {per_rank_batch} x {world_size}')",
                 ["[ranks 0-3] per-rank batch 32, 8 steps per epoch; global batch 128 = 32 x 4"]),
            Md("## Proof: one DDP step is a step on the global batch\n\nDDP averages the gradients over the ranks, "
               "so each rank's gradient equals that of a single process on all 128 samples:"),
            Code(f"{DDP_OK}\nimport copy\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                 "torch.manual_seed(0)                              # the same global batch on every rank\n"
                 "X, Y = torch.randn(per_rank_batch * world_size, 4), torch.randn(per_rank_batch * world_size, 1)\n"
                 "single = torch.nn.Linear(4, 1)\n"
                 "model = DDP(copy.deepcopy(single))\n"
                 "mine = slice(rank * per_rank_batch, (rank + 1) * per_rank_batch)\n"
                 "torch.nn.functional.mse_loss(model(X[mine]), Y[mine]).backward()   # DDP: this rank's 32\n"
                 "torch.nn.functional.mse_loss(single(X), Y).backward()               # one process: all 128\n"
                 "torch.allclose(model.module.weight.grad, single.weight.grad, atol=1e-6)",
                 ["Out[ranks 0-3]: True"]),
            Md("## The fix\n\nDecide, and record it (world size, per-rank batch, global batch): scale the learning "
               "rate with the global batch (the linear-scaling rule, with a warm-up), or keep the global batch "
               "and divide the per-rank batch. Every rank computes the same:"),
            Code(f"{OK}\nglobal_batch = per_rank_batch * world_size\n"
                 "lr = base_lr * global_batch / base_batch          # linear scaling rule (use a warm-up)\n"
                 "assert global_batch == int(seen)\n"
                 "print(f'world size {world_size}: per-rank batch {per_rank_batch}, global batch {global_batch}, '\n"
                 "      f'lr {base_lr} -> {lr:g}; or per-rank batch {base_batch // world_size} at lr {base_lr}')",
                 ["[ranks 0-3] world size 4: per-rank batch 32, global batch 128, lr 0.1 -> 0.4; "
                  "or per-rank batch 8 at lr 0.1"], ["Error"]),
            Md("## The same cell at another world size\n\nThe number that changed is the world size, not the "
               "config. Relaunch with 2 ranks, push the same config, and run the same measurement: the global "
               "batch, and so the right learning rate, follow the world size."),
            Code("%dist_shutdown\n%dist_launch -n 2 --backend gloo\n%dist_push per_rank_batch base_lr base_batch",
                 ["pool ready: 2 ranks"]),
            Code(f"{OK}\nfrom torch.utils.data import DataLoader, DistributedSampler, TensorDataset\n"
                 "data = TensorDataset(torch.randn(1024, 4), torch.randn(1024, 1))\n"
                 "loader = DataLoader(data, batch_size=per_rank_batch, sampler=DistributedSampler(data))\n"
                 "seen = torch.tensor(len(next(iter(loader))[0]))\n"
                 "dist.all_reduce(seen)\n"
                 "print(f'world size {world_size}: global batch {int(seen)}, {len(loader)} steps per epoch, '\n"
                 "      f'lr {base_lr * int(seen) / base_batch:g} by the linear-scaling rule')",
                 ["[ranks 0,1] world size 2: global batch 64, 16 steps per epoch, lr 0.2 by the linear-scaling rule"]),
            SHUTDOWN,
        ],
    ),
    Notebook(
        "09_batchnorm_buffers",
        "BatchNorm statistics diverge across ranks",
        "001 D10",
        "`%dist_check model` naming the BatchNorm buffers that differ and the odd rank; SyncBatchNorm's CPU error; buffer sync and averaging on CPU",
        [
            Md("**Symptom.** Evaluation is unstable or differs per rank; DDP converges worse than one GPU at the "
               "same effective batch (001 D10).\n\n"
               "**Cause.** BatchNorm's running mean and variance are *buffers*, not parameters: DDP averages "
               "gradients, not buffers. Each rank computes statistics on its own shard only. Where nothing syncs "
               "buffers — FSDP, a hand-rolled gradient all_reduce, or DDP with `forward_sync_buffers=False` — "
               "they drift apart."),
            launch(2),
            Code("%%on_ranks\nimport torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\n"
                 "def make_net():\n"
                 "    torch.manual_seed(0)\n"
                 "    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))\n\n"
                 "def train(model, steps=3):\n"
                 "    model.train()\n"
                 "    for step in range(steps):\n"
                 "        x = torch.randn(16, 4) * (rank + 1)    # each rank's shard has its own scale\n"
                 "        model(x).sum().backward()\n\n"
                 "x_eval = torch.ones(2, 4)\n"
                 "# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers: buffers not synced, either way\n"
                 "import inspect\n"
                 "NO_BUFFER_SYNC = ({'forward_sync_buffers': False} if 'forward_sync_buffers' in inspect.signature(DDP).parameters\n"
                 "                  else {'broadcast_buffers': False})", ["In[2] on ranks 0,1: ok"]),
            Md("## The failing cell"),
            Code(f"{DDP_OK}\nmodel = DDP(make_net(), **NO_BUFFER_SYNC)   # BUG: buffers stay rank-local\n"
                 "train(model)\nmodel.eval()\nround(model(x_eval).sum().item(), 4)   # the same input, evaluated per rank",
                 ["Out[rank 0]:", "Out[rank 1]:"], ["Out[ranks 0,1]"]),
            Md("## How distnb reveals it\n\nThe same input gives a different output per rank. `%dist_check` "
               "compares the model across ranks — parameters, gradients and buffers, by bitwise fingerprint — and "
               "names what differs: the parameters agree (DDP averaged the gradients), the BatchNorm buffers don't."),
            Code("%dist_check model", ["2 of 11 tensors differ", "module.1.running_mean", "module.1.running_var"],
                 ["module.0.weight"]),
            Md("## Fix on GPUs: SyncBatchNorm — not on CPU\n\n`nn.SyncBatchNorm.convert_sync_batchnorm(model)` "
               "before wrapping computes the batch statistics across ranks in every forward (001 D10). On CPU, "
               "DDP refuses it (and SyncBatchNorm's own training-mode forward wants a GPU or XPU input):"),
            Code(f"{OK}\nsync_model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(make_net()))",
                 ["ValueError on ranks 0,1", "SyncBatchNorm layers only work with GPU modules"], raises=True),
            Md("## Fix on CPU (1): let DDP sync the buffers\n\nWith DDP's default (`forward_sync_buffers=True`, "
               "formerly `broadcast_buffers=True`) rank 0's buffers are copied to every rank before each forward "
               "through the DDP module, so evaluation agrees. (Evaluate through `model`, not `model.module`: the "
               "copy happens in DDP's forward.) `--check model` runs `%dist_check` after the cell:"),
            Code(f"{DDP_OK} --check model\nmodel = DDP(make_net())\n"
                 "train(model)\nmodel.eval()\nround(model(x_eval).sum().item(), 4)",
                 ["Out[ranks 0,1]:", "check model: identical on ranks 0,1"], ["differ"]),
            Md("Evaluation agrees now — with rank 0's statistics (the value rank 0 printed in the failing cell), "
               "computed on rank 0's shard alone.\n\n"
               "## Fix on CPU (2): statistics from every rank's data\n\nTo use all ranks' data — what "
               "SyncBatchNorm does for each batch — average the buffers, e.g. before evaluating or saving a "
               "checkpoint. This also works where nothing syncs buffers (FSDP, a hand-rolled all_reduce):"),
            Code(f"{DDP_OK} --check model\nmodel = DDP(make_net(), **NO_BUFFER_SYNC)   # rank-local buffers again\n"
                 "train(model)\n"
                 "with torch.no_grad():\n"
                 "    for buf in model.module.buffers():\n"
                 "        if buf.is_floating_point():                  # running_mean, running_var\n"
                 "            dist.all_reduce(buf)\n"
                 "            buf /= world_size\n"
                 "model.eval()\nround(model(x_eval).sum().item(), 4)",
                 ["Out[ranks 0,1]:", "check model: identical on ranks 0,1"], ["differ"]),
            SHUTDOWN,
        ],
    ),
]


# The device-mesh notebooks live in their own file (this one would pass 600 lines with them).
sys.path.insert(0, str(Path(__file__).parent))
from _mesh_notebooks import notebooks as _mesh_notebooks  # noqa: E402

GALLERY += _mesh_notebooks(Notebook, Md, Code, launch, HANG, OK, SHUTDOWN)

def build(nb_def: Notebook) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.cells.append(new_markdown_cell(f"# {nb_def.title} ({nb_def.seed})\n\nPart of the [failure gallery](README.md): "
                                      "the symptom, the failing cell, how distnb reveals it, the fix, and the fix passing. "
                                      "Runs on a CPU (gloo)."))
    for cell in nb_def.cells:
        if isinstance(cell, Md):
            nb.cells.append(new_markdown_cell(cell.text))
            continue
        code = new_code_cell(cell.source)
        if cell.expect:
            code.metadata["distnb_expect"] = list(cell.expect)
        if cell.reject:
            code.metadata["distnb_reject"] = list(cell.reject)
        if cell.mime:
            code.metadata["distnb_mime"] = list(cell.mime)
        if cell.expect_re:
            code.metadata["distnb_expect_re"] = list(cell.expect_re)
        if cell.raises:
            code.metadata["tags"] = ["raises-exception"]
        nb.cells.append(code)
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"  # stable ids: regenerating changes only what changed
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


README_HEAD = """\
# The failure gallery

Each notebook reproduces one failure from the field's catalogue of distributed-training failures on a
small CPU pool (gloo, 2–4 ranks): the symptom, the failing cell, how distnb reveals it, the fix, and
the fixed cell passing. They run top to bottom in a couple of seconds to half a minute each, and
`tests/e2e/test_gallery.py` executes every one in a real kernel and checks the key outputs.

Seed references: **000** = torchrun/NCCL troubleshooting, **001 D1–D23** = the launch-and-debug
reference entries, **002** = the minimal-reproduction debugging guide.

| notebook | failure | reference | what distnb shows |
| --- | --- | --- | --- |
"""

README_TAIL = """
Hang cells use `%%on_ranks --timeout 6 --hang-after 1`: the diagnosis appears after a second and the
cell returns after six, with the hung ranks still blocked; `%dist_restart` replaces them. Every
notebook ends with `%dist_shutdown`. A failing `%%on_ranks` cell raises, which stops Run All; the
cells that fail on purpose carry Jupyter's `raises-exception` tag, so each notebook runs through.

The notebooks are generated, without outputs, by `_make.py` (`python notebooks/gallery/_make.py`);
edit that script, not the `.ipynb` files.
"""


def main() -> None:
    here = Path(__file__).parent
    for old in here.glob("[0-9]*.ipynb"):
        if old.stem not in {n.name for n in GALLERY}:
            old.unlink()
    rows = []
    for nb_def in GALLERY:
        nbformat.write(build(nb_def), str(here / f"{nb_def.name}.ipynb"))
        rows.append(f"| [{nb_def.name}]({nb_def.name}.ipynb) | {nb_def.title} | {nb_def.seed} | {nb_def.shows} |")
    (here / "README.md").write_text(README_HEAD + "\n".join(rows) + "\n" + README_TAIL)
    print(f"wrote {len(GALLERY)} notebooks and README.md to {here}")


if __name__ == "__main__":
    main()
