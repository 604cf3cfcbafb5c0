"""%dist_minimize's engine on a real pool: a session's failure cut down to the cells and statements
it needs and to the ranks it needs (a pool of its own for the smaller world), verified under
torchrun, and the session's state given back (issue 37, item 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

import distnb

CELLS = ["a = torch.ones(2)", "b = a * 2\nc = 3", "d = {'k': 1}"]
FAILING = "x = 1\ny = b.sum()\nif rank == 1:\n    raise ValueError(f'bad batch {int(y)}')\nz = 2"


@pytest.mark.timeout(600)  # the minimize budget (400 s) with its verification and the replay after it
def test_a_failure_is_cut_down_to_what_it_needs_and_verified(fresh_pool, tmp_path: Path) -> None:
    pool = fresh_pool(3, spares=True)
    for code in CELLS:
        assert pool.run(code, timeout=60).ok
    res = pool.run(FAILING, timeout=60)
    assert res[1].status == "error", res.text()
    seen: list[str] = []
    found = pool.minimize(budget=400, path=str(tmp_path / "case.py"), on_progress=seen.append)
    text = found.text()
    assert not found.stopped, text
    # The cells it needs (a, then b — not c, not d), and of the failing cell the two statements.
    assert [c.code for c in found.cells] == ["a = torch.ones(2)", "b = a * 2", "y = b.sum()\nif rank == 1:\n    raise ValueError(f'bad batch {int(y)}')"], text
    assert "minimized: 4 cells, 8 statements → 3 cells, 4 statements on 2 ranks (the session had 3)" in text, text
    assert "rank 1 raised ValueError: bad batch 4" in text and "removed 1 of the 3 ranks: ranks 0,1 fail as they did" in text, text
    assert found.world_size == 2 and found.cells[-1].ranks == (0, 1), text
    assert found.verified is not None and found.verified.reproduced, text  # run under torchrun on 2 ranks
    assert "--nproc-per-node 2" in (tmp_path / "case.py").read_text() and "-n 2 " in (tmp_path / "case.ipynb").read_text()
    assert seen and seen[-1].startswith("minimizing: "), seen[-3:]
    # The session is as it was: its namespaces back, its history without the tries.
    assert pool.run("(float(b.sum()), c, d['k'])", timeout=60).values == {r: "(4.0, 3, 1)" for r in range(3)}
    assert distnb.current_pool() is pool and pool.world_size == 3


#: A pasted training script's shape, small: its settings, a seed and an autocast context that is
#: nullcontext() on the CPU, a model under DDP with an optimizer, and a loop whose
#: gradient-accumulation loop holds the issue's bug — a loss all_reduce only the master makes (gloo
#: aborts rank 0: its scalar meets rank 1's gradient bucket).
SCRIPT_CELLS = ["from contextlib import nullcontext\nlr = 0.05\naccum = 2\nsteps = 2\nlog_every = 1\nwidth = 8\ndevice_type = 'cpu'\n"
                "ctx = nullcontext() if device_type == 'cpu' else torch.autocast(device_type)\ntorch.manual_seed(1337 + rank)",
                "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(torch.nn.Linear(width, width))\n"
                "opt = torch.optim.SGD(model.parameters(), lr=lr)\nmaster = rank == 0"]
SCRIPT_FAILING = ("for step in range(steps):\n    opt.zero_grad()\n    for micro in range(accum):\n"
                  "        model.require_backward_grad_sync = micro == accum - 1\n"
                  "        with ctx:\n            loss = model(torch.ones(2, width)).sum() / accum\n        loss.backward()\n"
                  "        if step % log_every == 0 and master:\n            dist.all_reduce(loss)  # BUG: the master only\n"
                  "    opt.step()\n    print('step', step)")


@pytest.mark.timeout(600)  # the budget (400 s) with its verification and the replay after it
def test_a_pasted_training_scripts_failure_is_cut_to_the_loop_that_makes_it(fresh_pool, tmp_path: Path) -> None:
    pool = fresh_pool(2, spares=True)
    for code in SCRIPT_CELLS:
        assert pool.run(code, timeout=120).ok
    res = pool.run(SCRIPT_FAILING, timeout=20)
    assert res[0].status == "dead", res.text()  # gloo aborted it, as in the nanoGPT session
    found = pool.minimize(budget=400, path=str(tmp_path / "case.py"))
    text, case = found.text(), found.code()
    assert not found.stopped, text
    assert found.signature.text() == "rank 0 died" and found.verified is not None and found.verified.reproduced, text
    # The settings written in, and the with over nullcontext() as its body, in one try; the seed in
    # one more; the optimizer gone with the step that used it; the accumulation loop kept, cut down
    # to the call, its condition and what they read.
    assert ("wrote 6 settings in where they are read (accum, device_type, log_every, lr, steps, width; 1 `with` block over "
            "nullcontext() as its body; one try)") in text, text
    assert "kept for the process-wide state they set (`torch.manual_seed(1337 + rank)`)" in text, text
    assert "opt" not in case and "print" not in case and "lr" not in case, case
    assert "ctx" not in case and "nullcontext" not in case and "manual_seed" not in case, case
    assert "        if step % 1 == 0 and master:\n            dist.all_reduce(loss)" in case and "for micro in range(2):" in case, case
    assert "model.require_backward_grad_sync = micro == 1" in case, case
    assert "model = DDP(torch.nn.Linear(8, 8))" in case, case
