"""%dist_minimize on four of the gallery's failures, each in a session grown as a notebook grows:
cells of set-up that the failure does not need before it, statements it does not need inside it.

    python benchmarks/bench_minimize.py [--budget 300] [--ab | --warm-ab] [--only NAME …]

The failures (notebooks/gallery/): a rank that raises (04), a rank-conditional collective (01), an
uneven loop (02) and a mesh dimension read per rank (10); and a session shaped like a pasted GPT
training script (6 cells, 54 statements) whose master-only loss all_reduce sits inside the
gradient-accumulation loop. ``--ab`` runs each also without the slice first (the tries alone),
interleaved; ``--warm-ab`` each also with every try's ranks started anew (no zygote: each fresh rank
imports what the session's cells imported again), interleaved. For each, on a real gloo pool of the
gallery's size: the session's size and the case's (cells, top-level statements, lines), the tries
and seconds it took, whether the case's script reproduced the failure under torchrun, and the
case itself. Written to benchmarks/results/minimize.json; reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import distnb
from distnb.services.cases import code_cuts

HERE = Path(__file__).resolve().parent
_SLICE = code_cuts.slice_case
_WARM = distnb.Pool.warm

#: Set-up a session accumulates before the failure: none of it is needed.
NOISE = [
    "import math\nlr = 0.1\nsteps = 3",
    "def helper(v):\n    return v * 2\nmodel = torch.nn.Linear(4, 4)",
    "print('setup done on rank', rank)\nwarm = helper(torch.ones(2))",
]

#: name → (world size, cells the failure needs, interleaved after the noise, failing cell, its timeout)
CASES: dict[str, tuple[int, list[str], str, float]] = {
    "04_rank_raises": (3, [], "note = math.sqrt(4)\n"
                       "batch = [{'label': 3}, {}, {'label': 1}][rank]   # BUG: rank 1's sample has no label\n"
                       "scaled = helper(lr)\n"
                       "loss = torch.tensor(float(batch['label']))\n"
                       "dist.all_reduce(loss)", 6.0),
    "01_rank_conditional_barrier": (3, ["import os, tempfile\nckpt_path = os.path.join(tempfile.mkdtemp(), f'ckpt{rank}.pt')"],
                                    "state = {'step': 100, 'weights': torch.full((3,), 0.5)}\n"
                                    "extra = model(torch.ones(4)).sum()\n"
                                    "if rank == 0:\n"
                                    "    torch.save(state, ckpt_path)\n"
                                    "    dist.barrier()                 # BUG: the barrier is inside the `if`\n"
                                    "done = True", 6.0),
    "02_uneven_batches": (3, [], "dataset = torch.arange(7.)\n"
                          "shard = dataset[rank::world_size]          # BUG: 3 samples on rank 0, 2 on ranks 1,2\n"
                          "print(f'{len(shard)} batches')\n"
                          "for sample in shard:\n"
                          "    grad = sample * torch.ones(4)\n"
                          "    dist.all_reduce(grad)\n"
                          "total = float(grad.sum())", 6.0),
    "10_hsdp_wrong_group": (4, ["from torch.distributed.device_mesh import init_device_mesh\n"
                                "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('replicate', 'shard'))\n"
                                "mesh.get_coordinate()"],
                            "loss = torch.tensor([float(rank)])\n"
                            "lr_now = lr * 0.5\n"
                            "dim = 'shard' if rank == 1 else 'replicate'   # BUG: rank 1 read the dimension from its own config\n"
                            "dist.all_reduce(loss, group=mesh.get_group(dim))", 6.0),
}


#: A session shaped like a pasted GPT training script (config, DDP set-up, data, model, optimizer
#: and schedule, the loop), written for this benchmark: its bug is the issue's — a loss all_reduce
#: only the master makes, inside the gradient-accumulation loop (gloo aborts rank 0 on the sizes).
GPT_CELLS = [
    "import os, math, time\nfrom contextlib import nullcontext\nout_dir = 'out'\neval_interval = 2\nlog_interval = 1\neval_iters = 2\n"
    "always_save_checkpoint = False\ngradient_accumulation_steps = 2\nbatch_size = 4\nblock_size = 16\nn_layer = 2\nn_head = 2\n"
    "n_embd = 32\ndropout = 0.0\nbias = False\nlearning_rate = 6e-4\nmax_iters = 6\nweight_decay = 1e-1\nbeta1, beta2 = 0.9, 0.95\n"
    "grad_clip = 1.0\ndecay_lr = True\nwarmup_iters = 2\nlr_decay_iters = 6\nmin_lr = 6e-5",
    "ddp_rank = int(os.environ['RANK'])\nddp_local_rank = int(os.environ['LOCAL_RANK'])\nddp_world_size = int(os.environ['WORLD_SIZE'])\n"
    "master_process = ddp_rank == 0\nseed_offset = ddp_rank\n"
    "tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size\n"
    "if master_process:\n    print(f'tokens per iteration will be: {tokens_per_iter:,}')\n"
    "torch.manual_seed(1337 + seed_offset)\nctx = nullcontext()",
    "vocab_size = 64\ndata = torch.randint(0, vocab_size, (4096,), generator=torch.Generator().manual_seed(0))\n"
    "def get_batch(split):\n    ix = torch.randint(len(data) - block_size, (batch_size,))\n"
    "    x = torch.stack([data[i:i + block_size] for i in ix])\n    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])\n"
    "    return x, y",
    "import torch.nn as nn\nfrom torch.nn import functional as F\n"
    "class Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.ln = nn.LayerNorm(n_embd)\n"
    "        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))\n"
    "    def forward(self, x):\n        return x + self.mlp(self.ln(x))\n"
    "class TinyGPT(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.wte = nn.Embedding(vocab_size, n_embd)\n"
    "        self.wpe = nn.Embedding(block_size, n_embd)\n        self.blocks = nn.Sequential(*[Block() for _ in range(n_layer)])\n"
    "        self.head = nn.Linear(n_embd, vocab_size, bias=bias)\n"
    "    def forward(self, idx, targets=None):\n        pos = torch.arange(idx.shape[1])\n"
    "        logits = self.head(self.blocks(self.wte(idx) + self.wpe(pos)))\n"
    "        loss = None if targets is None else F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))\n"
    "        return logits, loss\n"
    "model = TinyGPT()\nprint(f'{sum(p.numel() for p in model.parameters()):,} parameters')",
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(beta1, beta2), weight_decay=weight_decay)\n"
    "model = DDP(model)\nraw_model = model.module\n"
    "def get_lr(it):\n    if it < warmup_iters:\n        return learning_rate * (it + 1) / (warmup_iters + 1)\n"
    "    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)\n"
    "    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (learning_rate - min_lr)\n"
    "@torch.no_grad()\ndef estimate_loss():\n    out = {}\n    model.eval()\n    for split in ['train', 'val']:\n"
    "        losses = torch.zeros(eval_iters)\n        for k in range(eval_iters):\n            X, Y = get_batch(split)\n"
    "            losses[k] = model(X, Y)[1].item()\n        out[split] = losses.mean()\n    model.train()\n    return out\n"
    "iter_num = 0\nbest_val_loss = 1e9",
]
GPT_FAILING = (
    "X, Y = get_batch('train')\nt0 = time.time()\nlocal_iter_num = 0\n"
    "while iter_num < max_iters:\n"
    "    lr = get_lr(iter_num) if decay_lr else learning_rate\n"
    "    for param_group in optimizer.param_groups:\n        param_group['lr'] = lr\n"
    "    for micro_step in range(gradient_accumulation_steps):\n"
    "        model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)\n"
    "        with ctx:\n            logits, loss = model(X, Y)\n            loss = loss / gradient_accumulation_steps\n"
    "        X, Y = get_batch('train')\n        loss.backward()\n"
    "        if iter_num % log_interval == 0 and master_process:\n"
    "            dist.all_reduce(loss)   # BUG: only the master makes it, inside the accumulation loop\n"
    "    if grad_clip != 0.0:\n        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n"
    "    optimizer.step()\n    optimizer.zero_grad(set_to_none=True)\n"
    "    dt = time.time() - t0\n    t0 = time.time()\n"
    "    if iter_num % log_interval == 0 and master_process:\n"
    "        print(f'iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, time {dt * 1000:.2f}ms')\n"
    "    iter_num += 1\n    local_iter_num += 1"
)

#: name → (world size, the session's cells before the failing one, the failing cell, its timeout)
SESSIONS: dict[str, tuple[int, list[str], str, float]] = {
    **{name: (world, NOISE + needed, failing, timeout) for name, (world, needed, failing, timeout) in CASES.items()},
    "pasted_gpt_script": (4, GPT_CELLS, GPT_FAILING, 60.0),
}


def run_case(name: str, budget: float, out_dir: Path, slice_first: bool = True, warm: bool = True) -> dict[str, object]:
    world, before, failing, timeout = SESSIONS[name]
    distnb.Pool.warm = _WARM if warm else (lambda self, modules: None)  # type: ignore[method-assign]
    if not slice_first:  # the A/B arm: the tries alone, as before the slice
        code_cuts.slice_case = lambda *_: None  # type: ignore[assignment]
    else:
        code_cuts.slice_case = _SLICE
    pool = distnb.launch(nproc=world, backend="gloo")
    try:
        for code in before:
            res = pool.run(code, timeout=60)
            assert res.ok, res.text()
        failed = pool.run(failing, timeout=timeout)
        assert not failed.ok, failed.text()
        t0 = time.monotonic()
        found = pool.minimize(budget=budget, path=str(out_dir / f"{name}.py"), on_progress=lambda line: print(line, flush=True))
        took = time.monotonic() - t0
        case = found.code()
        cells, stmts = found.size()
        return {
            "world": world, "session_cells": found.started_with[0], "session_statements": found.started_with[1],
            "case_cells": cells, "case_statements": stmts,
            "case_lines": sum(1 for c in found.cells for line in c.code.splitlines() if line.strip() and not line.strip().startswith("#")),
            "tries": found.tries, "not_tried": found.unrun, "minimize_seconds": round(found.seconds, 1), "with_verify_and_replay_seconds": round(took, 1),
            "slice_first": slice_first, "warm": warm, "stopped": found.stopped, "reproduced": bool(found.verified and found.verified.reproduced),
            "signature": found.signature.text(), "case": case, "account": found.steps,
        }
    finally:
        pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=300.0, help="seconds each minimization may take")
    parser.add_argument("--only", nargs="*", default=list(SESSIONS), help="cases to run")
    parser.add_argument("--ab", action="store_true", help="each case also without the slice first, interleaved (the tries alone)")
    parser.add_argument("--warm-ab", action="store_true", help="each case also with fresh ranks started anew (no zygote), interleaved")
    args = parser.parse_args()
    path = HERE / "results" / "minimize.json"
    # The cases not run now keep their last results (each says its own budget).
    kept = json.loads(path.read_text())["cases"] if path.exists() else {}
    out: dict[str, object] = {"python": platform.python_version(), "torch": __import__("torch").__version__,
                              "machine": f"{__import__('os').cpu_count()} cores", "cases": kept}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            arms = [(False, True), (True, True)] if args.ab else [(True, False), (True, True)] if args.warm_ab else [(True, True)]
            for slice_first, warm in arms:
                arm = "" if slice_first and warm else " (tries alone)" if not slice_first else " (no zygote)"
                print(f"== {name}{arm}", flush=True)
                result = {"budget": args.budget, **run_case(name, args.budget, Path(tmp), slice_first, warm)}
                key = name + arm + ("" if args.budget == 300 else f" ({args.budget:.0f} s)")
                out["cases"][key] = result  # type: ignore[index]
                print(json.dumps({k: v for k, v in result.items() if k != "case"}, indent=1), flush=True)
                print(result["case"], flush=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
