"""%dist_minimize on four of the gallery's failures, each in a session grown as a notebook grows:
cells of set-up that the failure does not need before it, statements it does not need inside it.

    python benchmarks/bench_minimize.py [--budget 300]

The failures (notebooks/gallery/): a rank that raises (04), a rank-conditional collective (01), an
uneven loop (02) and a mesh dimension read per rank (10). For each, on a real gloo pool of the
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

HERE = Path(__file__).resolve().parent

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


def run_case(name: str, budget: float, out_dir: Path) -> dict[str, object]:
    world, needed, failing, timeout = CASES[name]
    pool = distnb.launch(nproc=world, backend="gloo")
    try:
        for code in NOISE + needed:
            res = pool.run(code, timeout=60)
            assert res.ok, res.text()
        failed = pool.run(failing, timeout=timeout)
        assert not failed.ok, failed.text()
        t0 = time.monotonic()
        found = pool.minimize(budget=budget, path=str(out_dir / f"{name}.py"))
        took = time.monotonic() - t0
        case = found.code()
        cells, stmts = found.size()
        return {
            "world": world, "session_cells": found.started_with[0], "session_statements": found.started_with[1],
            "case_cells": cells, "case_statements": stmts,
            "case_lines": sum(1 for c in found.cells for line in c.code.splitlines() if line.strip() and not line.strip().startswith("#")),
            "tries": found.tries, "minimize_seconds": round(found.seconds, 1), "with_verify_and_replay_seconds": round(took, 1),
            "stopped": found.stopped, "reproduced": bool(found.verified and found.verified.reproduced),
            "signature": found.signature.text(), "case": case, "account": found.steps,
        }
    finally:
        pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=300.0, help="seconds each minimization may take")
    parser.add_argument("--only", nargs="*", default=list(CASES), help="cases to run")
    args = parser.parse_args()
    out: dict[str, object] = {"python": platform.python_version(), "torch": __import__("torch").__version__,
                              "machine": f"{__import__('os').cpu_count()} cores", "budget": args.budget, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            print(f"== {name}", flush=True)
            result = run_case(name, args.budget, Path(tmp))
            out["cases"][name] = result  # type: ignore[index]
            print(json.dumps({k: v for k, v in result.items() if k != "case"}, indent=1), flush=True)
            print(result["case"], flush=True)
    path = HERE / "results" / "minimize.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
