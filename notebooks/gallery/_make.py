"""Builds the failure gallery (run: python notebooks/gallery/_make.py).

Each notebook reproduces one failure from the field's catalogue (../shared/seeds/ in the project's
workspace: 000 = torchrun/NCCL troubleshooting, 001 = reference entries D1–D23, 002 = the minimal-
reproduction guide) on a CPU pool: the symptom, how distnb reveals it, the fix, the fix passing.
A code cell's ``distnb_expect`` metadata lists text its output must contain; tests/test_gallery.py
executes every notebook and checks those.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

Cell = tuple  # ("md", text) or ("code", source, [expected substrings])

HANG = "%%on_ranks --timeout 6 --hang-after 1"

GALLERY: dict[str, tuple[str, list[Cell]]] = {
    "01_rank_conditional_barrier": (
        "Rank-conditional collective: checkpointing on rank 0 only (001 D21)",
        [
            ("md", "Saving or evaluating only on rank 0 is right — unless the code inside the `if` issues a collective. "
                   "Here rank 0 calls `dist.barrier()` after saving, the others never do, and the job freezes."),
            ("code", "%load_ext distnb\n%dist_launch -n 3 --backend gloo", ["pool ready: 3 ranks"]),
            ("code", f"{HANG}\nstate = {{'step': 10, 'w': torch.ones(3) * rank}}\nif rank == 0:\n    torch.save(state, f'/tmp/ckpt_{{world_size}}.pt')\n    dist.barrier()   # BUG: only rank 0 gets here",
             ["rank-conditional collective: rank 0 entered barrier", "ranks 1,2 finished the cell without entering it"]),
            ("md", "distnb names the rank that waits, the collective and the cell line, and the ranks that never came. "
                   "The stacks say the same:"),
            ("code", "%dist_stacks", ["in barrier", "dist.barrier()"]),
            ("md", "**Fix:** every rank reaches the collective; only the I/O is rank-conditional."),
            ("code", "%dist_restart", ["pool ready"]),
            ("code", "%%on_ranks --timeout 30\nstate = {'step': 10, 'w': torch.ones(3) * rank}\nif rank == 0:\n    torch.save(state, f'/tmp/ckpt_{world_size}.pt')\ndist.barrier()   # everyone\n'saved'",
             ["Out[ranks 0-2]: 'saved'"]),
            ("code", "%dist_shutdown", ["pool stopped"]),
        ],
    ),
    "02_uneven_batches": (
        "Uneven batches per rank: one rank runs an extra step (001 D9/D22)",
        [
            ("md", "When ranks see different numbers of batches (a sampler without padding, `drop_last=False`, a filtered "
                   "dataset), the rank with more batches waits in the gradient all_reduce of a step the others never take."),
            ("code", "%load_ext distnb\n%dist_launch -n 3 --backend gloo", ["pool ready"]),
            ("code", f"{HANG}\nbatches = [torch.ones(4)] * (5 if rank == 0 else 4)   # rank 0 got one more\nfor b in batches:\n    g = b.clone()\n    dist.all_reduce(g)",
             ["uneven loop lengths: rank 0 made", "ranks 1,2 stopped after"]),
            ("code", "%dist_collectives --last 3", ["first divergence", "rank 0 entered all_reduce, ranks 1,2 never did"]),
            ("md", "**Fix:** agree on the number of steps first (or pad the data, or use "
                   "`torch.distributed.algorithms.Join`)."),
            ("code", "%dist_restart", ["pool ready"]),
            ("code", "%%on_ranks --timeout 30\nbatches = [torch.ones(4)] * (5 if rank == 0 else 4)\nn = torch.tensor(len(batches))\ndist.all_reduce(n, op=dist.ReduceOp.MIN)\nfor b in batches[: int(n)]:\n    g = b.clone()\n    dist.all_reduce(g)\nint(n)",
             ["Out[ranks 0-2]: 4"]),
            ("code", "%dist_shutdown", ["pool stopped"]),
        ],
    ),
    "03_shape_mismatch": (
        "Shape mismatch in all_reduce",
        [
            ("md", "Ranks all_reduce tensors of different sizes. Without a debug mode gloo may hang (or abort the "
                   "process); distnb reads every rank's collective log and names the mismatch."),
            ("code", "%load_ext distnb\n%dist_launch -n 3 --backend gloo", ["pool ready"]),
            ("code", f"{HANG}\nx = torch.ones(3 if rank == 0 else 4)\ndist.all_reduce(x)",
             ["shape or dtype mismatch at collective #1 on group 0", "rank 0 all_reduce [3] f32", "ranks 1,2 all_reduce [4] f32"]),
            ("md", "`--debug detail` (TORCH_DISTRIBUTED_DEBUG=DETAIL) turns the mismatch into an error on every rank that "
                   "names the field, instead of a hang or an abort."),
            ("code", "%dist_shutdown\n%dist_launch -n 3 --backend gloo --debug detail", ["pool ready"]),
            ("code", "%%on_ranks --timeout 30\nx = torch.ones(3 if rank == 0 else 4)\ndist.all_reduce(x)",
             ["Detected mismatch between collectives on ranks", "Tensor shapes"]),
            ("md", "**Fix:** the same shape on every rank (here: pad to the largest)."),
            ("code", "%%on_ranks --timeout 30\nx = torch.ones(3 if rank == 0 else 4)\nn = torch.tensor([x.numel()])\ndist.all_reduce(n, op=dist.ReduceOp.MAX)\nx = torch.nn.functional.pad(x, (0, int(n) - x.numel()))\ndist.all_reduce(x)\nx",
             ["Out[ranks 0-2]: tensor([3., 3., 3., 2.])"]),
            ("code", "%dist_shutdown", ["pool stopped"]),
        ],
    ),
    "04_rank_raises": (
        "One rank raises before a collective (001 D20)",
        [
            ("md", "A rank hits an exception (a corrupt sample, a missing file) and leaves the step; the others wait in "
                   "the next all_reduce forever, and the log shows only their timeout. distnb names the root cause."),
            ("code", "%load_ext distnb\n%dist_launch -n 3 --backend gloo", ["pool ready"]),
            ("code", f"{HANG}\nsample = {{'label': 3}} if rank != 1 else {{}}\nloss = torch.tensor(float(sample['label']))\ndist.all_reduce(loss)",
             ["rank 1 raised KeyError", "Root cause: the error on rank 1", "KeyError on rank 1 at cell line 2"]),
            ("md", "**Fix:** handle the bad sample on that rank (or make every rank skip the step together)."),
            ("code", "%dist_restart", ["pool ready"]),
            ("code", "%%on_ranks --timeout 30\nsample = {'label': 3} if rank != 1 else {}\nloss = torch.tensor(float(sample.get('label', 0)))\ndist.all_reduce(loss)\nloss",
             ["Out[ranks 0-2]: tensor(6.)"]),
            ("code", "%dist_shutdown", ["pool stopped"]),
        ],
    ),
    "05_ddp_unused_parameters": (
        "DDP with unused parameters (001 D8)",
        [
            ("md", "A branch of the model is not used in `forward`. DDP waits for gradients that never come and fails "
                   "on the next iteration."),
            ("code", "%load_ext distnb\n%dist_launch -n 2 --backend gloo", ["pool ready"]),
            ("code", "%%on_ranks\nimport torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                     "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.used = nn.Linear(4, 4)\n        self.unused = nn.Linear(4, 4)\n"
                     "    def forward(self, x):\n        return self.used(x)\n", []),
            ("code", "%%on_ranks --timeout 60\nmodel = DDP(Net())\nfor step in range(2):\n    model(torch.randn(8, 4)).sum().backward()",
             ["Expected to have finished reduction in the prior iteration", "RuntimeError on rank"]),
            ("md", "**Fix:** `find_unused_parameters=True` (or drop the unused branch)."),
            ("code", "%%on_ranks --timeout 60\nmodel = DDP(Net(), find_unused_parameters=True)\nfor step in range(2):\n    model(torch.randn(8, 4)).sum().backward()\n'ok'",
             ["Out[ranks 0,1]: 'ok'"]),
            ("code", "%dist_shutdown", ["pool stopped"]),
        ],
    ),
    "06_rank_vs_local_rank": (
        "RANK vs LOCAL_RANK: the wrong GPU on the second node (001 D3)",
        [
            ("md", "`torch.cuda.set_device(rank)` works on one node and breaks on two: global rank 4 on node 1 asks for "
                   "GPU 4 of a 4-GPU machine. The device must come from `LOCAL_RANK`. `%dist_env` shows what each rank "
                   "was given."),
            ("code", "%load_ext distnb\n%dist_launch -n 2 --backend gloo", ["pool ready"]),
            ("code", "%dist_env", ["RANK", "LOCAL_RANK", "per rank, as expected", "WORLD_SIZE"]),
            ("md", "The same arithmetic on a simulated layout of 2 nodes × 4 GPUs (8 ranks):"),
            ("code", "%%on_ranks 0\nfor global_rank in range(8):\n    node, local = divmod(global_rank, 4)\n    bug = global_rank            # cuda:{RANK}\n    right = local                # cuda:{LOCAL_RANK}\n    print(f'rank {global_rank} on node {node}: cuda:{bug} (bug{\" — no such GPU\" if bug >= 4 else \"\"}) vs cuda:{right}')",
             ["rank 5 on node 1: cuda:5 (bug — no such GPU) vs cuda:1"]),
            ("md", "**Fix:** `device = torch.device('cuda', int(os.environ['LOCAL_RANK']))` — which distnb's ranks "
                   "already do: `device` in every rank's namespace comes from LOCAL_RANK."),
            ("code", "%%on_ranks\nimport os\n(int(os.environ['LOCAL_RANK']) == local_rank, str(device))", ["Out[ranks 0,1]: (True, 'cpu')"]),
            ("code", "%dist_shutdown", ["pool stopped"]),
        ],
    ),
    "07_memory_imbalance": (
        "One rank runs out of memory while the others have room (000 issue 6)",
        [
            ("md", "One rank keeps references the others drop (here: rank 1 caches every batch), so only it grows "
                   "until it is OOM-killed. Each cell's memory line and `%dist_memory` show it long before."),
            ("code", "%load_ext distnb\n%dist_launch -n 2 --backend gloo", ["pool ready"]),
            ("code", "%%on_ranks\ncache = []\nfor step in range(40):\n    batch = torch.ones(2_500_000)          # 10 MB\n    if rank == 1:\n        cache.append(batch)                # BUG: keeps every batch",
             ["rank 1 peaks at"]),
            ("code", "%dist_memory --plot", ["rank 1 peaks at", "memory of ranks 0,1"]),
            ("md", "**Fix:** don't keep the batches (or keep `.item()`s / detached scalars)."),
            ("code", "%%on_ranks\ncache.clear()\nimport gc; gc.collect()\nfor step in range(20):\n    batch = torch.ones(2_500_000)\nlen(cache)", ["Out[ranks 0,1]: 0"]),
            ("code", "%dist_memory", ["memory of ranks 0,1"]),
            ("code", "%dist_shutdown", ["pool stopped"]),
        ],
    ),
    "08_effective_batch_lr": (
        "Effective batch size and learning rate across world sizes (001 D11)",
        [
            ("md", "With data parallelism the global batch is the per-rank batch × world size. Moving from 1 to N "
                   "ranks without adjusting the learning rate (or the per-rank batch) changes the optimisation."),
            ("code", "%load_ext distnb\n%dist_launch -n 4 --backend gloo", ["pool ready"]),
            ("code", "per_rank_batch, base_lr, base_batch = 32, 0.1, 32\n%dist_push per_rank_batch base_lr base_batch", []),
            ("code", "%%on_ranks\nglobal_batch = per_rank_batch * world_size\nlr = base_lr * global_batch / base_batch   # linear scaling rule\nn = torch.tensor(per_rank_batch)\ndist.all_reduce(n)\nprint(f'global batch {global_batch} (all_reduce says {int(n)}), lr {lr}')",
             ["[ranks 0-3] global batch 128 (all_reduce says 128), lr 0.4"]),
            ("md", "Every rank agrees: the global batch is 128, and the linearly scaled learning rate 0.4 "
                   "(use a warm-up for large factors)."),
            ("code", "%dist_shutdown", ["pool stopped"]),
        ],
    ),
    "09_batchnorm_buffers": (
        "BatchNorm buffers diverging across ranks (001 D10)",
        [
            ("md", "BatchNorm's running mean/var are buffers, not parameters: DDP averages gradients, not buffers. "
                   "With `broadcast_buffers=False` each rank's statistics drift apart, and evaluation differs per rank."),
            ("code", "%load_ext distnb\n%dist_launch -n 2 --backend gloo", ["pool ready"]),
            ("code", "%%on_ranks\nimport torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\ntorch.manual_seed(0)\n"
                     "model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), broadcast_buffers=False)\n"
                     "for step in range(3):\n    model(torch.randn(16, 4) * (rank + 1)).sum().backward()", []),
            ("code", "%dist_check model", ["module.1.running_mean", "odd rank: 1"]),
            ("md", "The parameters agree (DDP synchronised the gradients); the buffers don't. **Fix:** on GPUs, "
                   "`nn.SyncBatchNorm.convert_sync_batchnorm(model)` computes the statistics across ranks (it needs "
                   "CUDA). On any device, DDP's default `broadcast_buffers=True` makes rank 0's buffers everyone's "
                   "before each forward:"),
            ("code", "%%on_ranks\ntorch.manual_seed(0)\nmodel = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))\nfor step in range(3):\n    model(torch.randn(16, 4) * (rank + 1)).sum().backward()\nmodel(torch.ones(2, 4)).sum().backward()", []),
            ("code", "%dist_check model", ["check model:", "identical"]),
            ("code", "%dist_shutdown", ["pool stopped"]),
        ],
    ),
}


def build(title: str, cells: list[Cell]) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.cells.append(new_markdown_cell(f"# {title}"))
    for cell in cells:
        if cell[0] == "md":
            nb.cells.append(new_markdown_cell(cell[1]))
        else:
            code = new_code_cell(cell[1])
            if cell[2]:
                code.metadata["distnb_expect"] = list(cell[2])
            nb.cells.append(code)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def main() -> None:
    here = Path(__file__).parent
    index = ["# The failure gallery\n", "Each notebook reproduces a failure on a CPU pool, shows how distnb reveals it, fixes it, and runs the fix.\n"]
    for name, (title, cells) in GALLERY.items():
        nbformat.write(build(title, cells), str(here / f"{name}.ipynb"))
        index.append(f"- [{title}]({name}.ipynb)")
    (here / "README.md").write_text("\n".join(index) + "\n")
    print(f"wrote {len(GALLERY)} notebooks to {here}")


if __name__ == "__main__":
    main()
