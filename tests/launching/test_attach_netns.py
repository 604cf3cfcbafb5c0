"""Attach to a job across two machines (issue 40): a 4-rank torchrun job on two hosts made of
network namespaces (tests/netns.py), started by the test under ``python -m distnb run`` on each
host with ``DISTNB_ATTACH_HOST`` at that host's address, hung by a rank-conditional collective.
The notebook on hosta reads hostb's discovery files over real ssh (``--hosts``) or, inside a
Slurm allocation of both hosts, with one srun step (``--slurm``), reaches hostb's ranks over the
bridge with CURVE, and diagnoses the hang as on one machine; a client without the keys gets no
answer.

Needs root, iproute2 and sshd (skipped otherwise, unless DISTNB_REQUIRE_NETNS=1, as in CI)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import hung_job
import pytest

from conftest import marked_processes, started_pids, wait_gone
from netns import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = str(Path(__file__).resolve().parents[2])
MARK = "DISTNB_ATTACH_NETNS_TEST"

SCRIPT = hung_job.script(300)

#: Run on hosta, as the notebook would: attach (hostb over ssh) until the hang is diagnosed, then
#: print what it saw as JSON; also ask one of hostb's ranks without its CURVE keys, and look into one's frame.
NOTEBOOK = """
import dataclasses, json, sys, time
import distnb
from distnb.controller.attach_link import AttachLink
from distnb.wire.protocol import Msg

job, where = sys.argv[1], sys.argv[2]
how = {"slurm": True} if where == "--slurm" else {"hosts": [where]}
deadline = time.monotonic() + 150
while True:
    try:
        # A busy machine: the ranks get the product's own bound several times over, and the test
        # asks again until every rank has answered (a verdict of ranks not answering is not the hang).
        with distnb.attach(job, timeout=10.0, **how) as a:
            answered = len(a.files.ranks) == 4 and all(rs.threads for rs in a.stacks().ranks)
            verdict = a.diagnose() if answered else None
            if verdict is not None and verdict.rule == "disagree" or time.monotonic() > deadline:
                verdict = verdict or a.diagnose()
                bare = dataclasses.replace(a.files.ranks[2], creds="")
                link = AttachLink({2: bare})
                unkeyed = link.ask([2], {"t": Msg.STACKS, "all_threads": False}, 3.0)
                link.close()
                # %dist_debug's look into a rank on hostb (over CURVE): its own frame's ``rank``.
                frames = a.peek(3)["frames"]
                looked = a.peek(3, "eval", max(i for i, f in enumerate(frames) if f.user), "rank").get("value")
                print(json.dumps({"looked": looked, "culprits": verdict.culprits, "rule": verdict.rule, "text": verdict.text(),
                                  "machines": {r: e.machine for r, e in a.files.ranks.items()},
                                  "curve": {r: bool(e.creds) for r, e in a.files.ranks.items()},
                                  "stacks": a.stacks().text(), "unkeyed": sorted(unkeyed)}))
                break
    except distnb.AttachError as exc:
        if time.monotonic() > deadline:
            print(json.dumps({"error": str(exc)}))
            break
    time.sleep(1)
"""


def _job(net: Cluster, host: str, node_rank: int, jobs: Path, folder: Path, env: dict[str, str], job: str) -> subprocess.Popen[bytes]:
    h, a = net.hosts[host], net.hosts["hosta"]
    env = {**env, "DISTNB_JOBS_DIR": str(jobs), "DISTNB_ATTACH_HOST": h.addr, "GLOO_SOCKET_IFNAME": h.iface}
    return net.popen(host, [sys.executable, "-m", "distnb", "run", "--job-id", job, "--", sys.executable, "-m", "torch.distributed.run",
                            "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "2", "--master-addr", a.addr,
                            "--master-port", "29461", str(folder / "hang.py")],
                     cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _attach_across(net: Cluster, tmp_path: Path, jobs_a: Path, jobs_b: Path, notebook: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The hung job on both hosts (each host's ranks' files under its folder) and NOTEBOOK run on
    hosta with ``env``: ``notebook`` is the command that runs it, its last item NOTEBOOK's second
    argument (a host, or ``--slurm``); returns what NOTEBOOK saw."""
    (tmp_path / "hang.py").write_text(SCRIPT)
    (tmp_path / "notebook.py").write_text(NOTEBOOK)
    token, job = uuid.uuid4().hex, f"two-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, **env, MARK: token, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    procs = [_job(net, "hosta", 0, jobs_a, tmp_path, env, job), _job(net, "hostb", 1, jobs_b, tmp_path, env, job)]
    try:
        out = subprocess.run(net.command("hosta", [*notebook[:-1], str(tmp_path / "notebook.py"), job, notebook[-1]]), capture_output=True,
                             text=True, timeout=240, env={**env, "DISTNB_JOBS_DIR": str(jobs_a)})
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {"error": out.stderr[-3000:]}
    finally:
        pids = marked_processes(MARK, token)
        started_pids.update(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(20)
        assert not wait_gone(pids, 10)


def test_attach_reads_the_other_machine_over_ssh_and_its_ranks_over_curve(net: Cluster, tmp_path: Path) -> None:
    b = net.hosts["hostb"]
    # One filesystem: each host's files in a folder of its own, as on two machines (hostb's ssh sessions list its own).
    seen = _attach_across(net, tmp_path, tmp_path / "jobs-a", net.jobs_b, [sys.executable, b.addr],  # type: ignore[attr-defined]
                          {"DISTNB_SSH": net.ssh})  # type: ignore[attr-defined]
    assert "error" not in seen, seen
    assert seen["machines"] == {"0": "", "1": "", "2": b.addr, "3": b.addr}, seen["machines"]
    assert seen["curve"] == {"0": True, "1": True, "2": True, "3": True}, seen  # bound beyond loopback: CURVE on every rank
    assert seen["culprits"] == [0] and seen["rule"] == "disagree", seen["text"]
    assert "rank 0 in all_reduce #4" in seen["text"] and "ranks 1-3 in barrier #4" in seen["text"], seen["text"]
    assert "hang.py:13 in <module>: dist.barrier()" in seen["stacks"], seen["stacks"]
    assert seen["unkeyed"] == [], "a client without the rank's CURVE keys got an answer"
    assert seen["looked"] == "3", seen  # a look into a frame of a rank on the other machine


def test_attach_in_a_slurm_allocation_lists_every_node_with_one_srun_step(net: Cluster, slurm: Any, tmp_path: Path) -> None:
    """The notebook inside ``salloc -N 2`` on hosta: ``attach(slurm=True)`` lists each node's files
    with one srun step. Both hosts' ranks write to one folder, as on a shared home: each node
    lists only the files it wrote (hostb's pids mean nothing on hosta, and hosta's own listing is
    not read twice)."""
    shared = tmp_path / "jobs-shared"
    seen = _attach_across(net, tmp_path, shared, shared, ["salloc", "-N", "2", "--quiet", sys.executable, "--slurm"], slurm.env)
    assert "error" not in seen, seen
    assert seen["machines"] == {"0": "", "1": "", "2": "hostb", "3": "hostb"}, seen["machines"]
    assert seen["culprits"] == [0] and seen["rule"] == "disagree", seen["text"]
    assert "rank 0 in all_reduce #4" in seen["text"] and "ranks 1-3 in barrier #4" in seen["text"], seen["text"]
    assert seen["unkeyed"] == [], "a client without the rank's CURVE keys got an answer"
