"""Multi-node pools: two simulated nodes × 2 ranks on this machine, joined through torchrun's c10d
rendezvous on loopback. The second node is a real node agent (``python -m distnb.node``) started
with the command the controller prints, or over "ssh" (a stand-in that runs the command here)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from magic_shell import Shell

import distnb
from distnb.controller.channel import TICK
from distnb.jobs import pools
from distnb.launching.remote_nodes import LOST_AFTER, NodeStarters
from distnb.wire.codec import Codec
from distnb.wire.peers import supervisor_identity
from distnb.wire.protocol import Msg
from distnb.wire.security import Credentials

from conftest import started_pids, track, wait_gone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HERE = Path(__file__).resolve().parents[1]  # the helpers beside conftest.py


class Agents:
    """Node agents this test module started (by the printed join command); stopped by PID."""

    def __init__(self, log_dir: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log_dir = log_dir

    def on_note(self, note: str) -> None:
        if "on each, run:" in note and not self.procs:
            command = note.split("\n")[1].strip()
            log = open(self.log_dir / "agent.log", "wb")
            proc = subprocess.Popen(shlex.split(command), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(proc)
            started_pids.add(proc.pid)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture(scope="module")
def two_nodes(leak_check, tmp_path_factory: pytest.TempPathFactory):
    """4 ranks: 2 on "this machine", 2 on a node agent joined with the printed command."""
    tmp = tmp_path_factory.mktemp("nodes")
    agents = Agents(tmp)
    notes: list[str] = []
    pool = distnb.Pool(nproc=2, nnodes=2, backend="gloo", start_timeout=90, key_file=str(tmp / "pool.key"))
    track(pool)
    try:
        pool.start(on_note=lambda n: (notes.append(n), agents.on_note(n)))
        track(pool)
        pool.notes = notes  # type: ignore[attr-defined]
        pool.agents = agents  # type: ignore[attr-defined]
        yield pool
    finally:
        pool.shutdown()
        agents.stop()


def test_the_controller_prints_one_command_and_nodes_join(two_nodes: distnb.Pool) -> None:
    notes = "\n".join(two_nodes.notes)  # type: ignore[attr-defined]
    assert "-m distnb.node --connect tcp://127.0.0.1:" in notes and "--key-file" in notes
    assert "node 1 of 1 joined: the node agent on" in notes
    key_file = Path(two_nodes.key_file or "")
    assert key_file.exists() and key_file.stat().st_mode & 0o077 == 0  # this user's alone


def test_a_collective_spans_both_nodes(two_nodes: distnb.Pool) -> None:
    res = two_nodes.run("mn_x = torch.ones(1) * (rank + 1); dist.all_reduce(mn_x); int(mn_x.item())", timeout=30)
    assert res.ok, res.text()
    assert {r: res.results[r].value_text for r in range(4)} == {r: "10" for r in range(4)}

    status = two_nodes.status()
    assert status.world_size == 4 and status.nnodes == 2
    assert [r.node for r in status.ranks] == [0, 0, 1, 1]  # rendezvous: this machine's agent first
    assert all(r.host for r in status.ranks)
    text = status.text()
    assert "4 ranks on 2 nodes" in text and "node" in text.splitlines()[1]
    assert "the node agent on" in text and "running, ranks 2,3" in text

    env = two_nodes.env()
    assert [env.env[r]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert [env.env[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "1"]
    assert "GROUP_RANK" in env.text() and "host" in env.text()


def test_export_keeps_the_multi_node_layout(two_nodes: distnb.Pool, tmp_path: Path) -> None:
    import nbformat

    res = two_nodes.run("mn_e = rank * 10", timeout=30)
    assert res.ok, res.text()
    res = two_nodes.run("mn_f = mn_e + 1", ranks="2,3", timeout=30)
    assert res.ok, res.text()
    script = Path(two_nodes.export(str(tmp_path / "repro.py"), cells=f"{res.cell - 1}-{res.cell}")).read_text()
    assert "torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d" in script
    assert "mn_e = rank * 10\n" in script and "if rank in {2, 3}:\n    mn_f = mn_e + 1" in script
    nb = nbformat.read(str(two_nodes.export(str(tmp_path / "repro.ipynb"), cells=f"{res.cell - 1}-{res.cell}")), as_version=4)
    assert "%dist_launch -n 2 --backend gloo --nnodes 2" in nb.cells[1].source
    assert "4 ranks" in nb.cells[0].source
    assert nb.cells[3].source.startswith("%%on_ranks 2,3\n")


def test_stacks_and_memory_reach_the_other_node(two_nodes: distnb.Pool) -> None:
    stacks = two_nodes.stacks()
    assert sorted(s.rank for s in stacks.ranks) == [0, 1, 2, 3]
    memory = two_nodes.memory()
    assert sorted(memory.current) == [0, 1, 2, 3]


def test_frames_signed_with_another_key_are_rejected_and_counted(two_nodes: distnb.Pool) -> None:
    before = two_nodes.status().rejected
    ctx = zmq.Context()
    try:
        # A would-be node agent, and a would-be rank supervisor (a live rank's name is taken: ZMQ
        # itself refuses a second peer with it).
        for identity in (b"n5", supervisor_identity(7)):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(two_nodes.status().address)
            hello = {"t": Msg.NODE_HELLO, "host": "evil", "pid": 1, "version": distnb.__version__}
            msg = hello if identity == b"n5" else {"t": Msg.RANK_EXIT, "returncode": -9}
            sock.send_multipart(Codec(b"\x07" * 32, identity.decode()).encode(msg))
            sock.close()
        deadline = time.monotonic() + 5
        while two_nodes.status().rejected < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        ctx.term()
    assert two_nodes.status().rejected == before + 2
    assert f"refused {before + 2} frame(s)" in two_nodes.status().text()
    assert len(two_nodes._tracker.nodes.agents) == 1 and two_nodes.state == distnb.PoolState.READY
    assert two_nodes.run("1 + 1", ranks=[2]).results[2].value_text == "2"


def _agent(address: str, key_file: Path, wait: float = 4.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "distnb.node", "--connect", address, "--key-file", str(key_file), "--wait", str(wait)],
        capture_output=True, text=True, timeout=60, start_new_session=True,
    )
    return proc


def test_a_node_agent_with_a_wrong_key_cannot_join(two_nodes: distnb.Pool, tmp_path: Path) -> None:
    before = two_nodes.status().rejected
    wrong = Credentials.new().write(tmp_path / "wrong.key")
    proc = _agent(two_nodes.status().address or "", wrong)
    assert proc.returncode == 2
    assert "no answer from a controller" in proc.stderr and "key file" in proc.stderr
    assert two_nodes.status().rejected > before
    assert len(two_nodes._tracker.nodes.agents) == 1

    wrong.chmod(0o644)
    proc = _agent(two_nodes.status().address or "", wrong)
    assert proc.returncode == 2 and "chmod 600" in proc.stderr


def test_a_worker_started_with_a_wrong_key_cannot_join(two_nodes: distnb.Pool) -> None:
    """A rank supervisor from another pool (or an old run) claiming rank 9 of this one."""
    before = two_nodes.status().rejected
    env = {**os.environ, "RANK": "9", "LOCAL_RANK": "0", "WORLD_SIZE": "10", "DISTNB_ADDR": two_nodes.status().address or "",
           "DISTNB_HEARTBEAT_TIMEOUT": "2", **Credentials.new().env()}
    proc = subprocess.Popen([sys.executable, "-m", "distnb.worker"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    started_pids.add(proc.pid)
    try:
        deadline = time.monotonic() + 10
        while two_nodes.status().rejected == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert two_nodes.status().rejected > before
        proc.wait(20)  # it hears no heartbeat from the controller, so it gives up
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    status = two_nodes.status()
    assert len(status.ranks) == 4 and all(r.state == distnb.RankState.IDLE for r in status.ranks)


def test_a_node_agent_with_the_right_key_cannot_join_a_running_pool(two_nodes: distnb.Pool) -> None:
    proc = _agent(two_nodes.status().address or "", Path(two_nodes.key_file or ""))
    assert proc.returncode == 2
    assert "refused this node" in proc.stderr and "not starting" in proc.stderr
    assert len(two_nodes._tracker.nodes.agents) == 1 and two_nodes.state == distnb.PoolState.READY


def test_a_node_agent_killed_mid_cell_takes_its_ranks_with_it(two_nodes: distnb.Pool) -> None:
    """Destructive: the last test on this pool."""
    res = two_nodes.submit("import time\ntime.sleep(1.5)\nmn_y = torch.ones(1)\ndist.all_reduce(mn_y)")
    time.sleep(0.5)
    agent = next(iter(two_nodes._tracker.nodes.agents.values()))
    killed = time.monotonic()
    os.kill(agent.pid, signal.SIGKILL)
    deadline = killed + 30
    while time.monotonic() < deadline and not all(two_nodes.status().ranks[r].state == distnb.RankState.DEAD for r in (2, 3)):
        time.sleep(0.05)
    status = two_nodes.status()
    assert [r.state == distnb.RankState.DEAD for r in status.ranks] == [False, False, True, True], status.text()
    # Lost after LOST_AFTER of silence, noticed at the next tick; the margin for a loaded machine.
    assert time.monotonic() - killed < LOST_AFTER + TICK + 6
    assert two_nodes.state == distnb.PoolState.BROKEN
    # Once the agent's silence is noticed, both ranks carry the reason.
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline and "lost with its machine" not in two_nodes.status().ranks[2].describe() + two_nodes.status().ranks[3].describe():
        time.sleep(0.1)
    text = two_nodes.status().text()
    assert f"the node agent on {agent.host} (pid {agent.pid}) stopped answering" in text, text
    assert "lost, ranks 2,3" in text
    two_nodes.wait(res, timeout=5)
    assert res.results[2].status == "dead" and res.results[3].status == "dead"
    assert "rank 2 died" in res.text() or "rank 3 died" in res.text()
    with pytest.raises(distnb.PoolBrokenError, match="dist_restart"):
        two_nodes.run("1")
    two_nodes.interrupt()


def test_start_timeout_names_the_missing_node(leak_check, tmp_path: Path) -> None:
    pool = track(distnb.Pool(nproc=1, nnodes=2, backend="gloo", start_timeout=5, key_file=str(tmp_path / "k.key")))
    with pytest.raises(distnb.LaunchError) as info:
        pool.start()
    text = str(info.value)
    assert "did not start within 5 s" in text
    assert "1 of 1 other node(s) never joined" in text
    assert "On each missing node run:" in text and "-m distnb.node --connect" in text
    assert pool.state == distnb.PoolState.STOPPED
    assert not (tmp_path / "k.key").exists()  # the key died with the launch


def test_a_failing_ssh_fails_the_launch_at_once_with_its_words(leak_check, monkeypatch: pytest.MonkeyPatch) -> None:
    # ssh's options, the host and the command arrive as $1..; this one fails the way ssh does.
    script = "echo \"ssh: connect to host $3 port 22: Connection refused\" >&2; exit 255"
    monkeypatch.setenv("DISTNB_SSH", f"/bin/sh -c {shlex.quote(script)} ssh")
    pool = track(distnb.Pool(nproc=1, hosts=("localhost",), backend="gloo", start_timeout=60))
    started = time.monotonic()
    with pytest.raises(distnb.LaunchError) as info:
        pool.start()
    text = str(info.value)
    assert time.monotonic() - started < 20, "waited for the start timeout instead of failing at once"
    assert "ssh localhost: exited with code 255\n  | ssh: connect to host localhost port 22: Connection refused" in text, text
    assert pool.state == distnb.PoolState.STOPPED


def test_start_timeout_lists_the_agents_it_started(leak_check, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTNB_SSH", "/bin/sh -c 'exec sleep 30' ssh")  # connects, never runs the agent
    pool = track(distnb.Pool(nproc=1, hosts=("localhost",), backend="gloo", start_timeout=4))
    with pytest.raises(distnb.LaunchError) as info:
        pool.start()
    text = str(info.value)
    assert "1 of 1 other node(s) never joined" in text
    assert re.search(r"Node agents started by this notebook:\n  ssh localhost: running \(pid \d+\)", text), text
    assert pool.state == distnb.PoolState.STOPPED and not pool.pids()


def test_launch_magic_starts_nodes_over_ssh_with_curve(leak_check, monkeypatch: pytest.MonkeyPatch) -> None:
    """``%dist_launch --hosts`` (ssh replaced by a stand-in that runs the command here) with CURVE."""
    monkeypatch.setenv("DISTNB_SSH", f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'fake_ssh.py'))}")
    monkeypatch.setattr(pools, "_current", None)
    sh = Shell()
    try:
        with pytest.raises(Exception, match="can't reach 127.0.0.1"):
            sh.line("dist_launch", "--hosts node2 -n 1")
        with pytest.raises(Exception, match="--nnodes"):
            sh.line("dist_launch", "--rdzv-endpoint node1:29400")
        _, out, _ = sh.line("dist_launch", "-n 1 --backend gloo --hosts localhost --curve --start-timeout 90")
        pool = pools.current_or_none()
        assert pool is not None
        track(pool)
        assert "started node agents over ssh on localhost" in out and "node 1 of 1 joined" in out, out
        assert "2 ranks on 2 nodes" in out
        out, err = sh.cell("", "mn_z = torch.tensor([float(rank + 1)]); dist.all_reduce(mn_z); print(int(mn_z.item()))")
        assert "[ranks 0,1] 3" in out, out + err

        # CURVE: a client without the pool's client key is refused at the handshake, and counted.
        before = pool.status().rejected
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        creds = Credentials.read(pool.key_file or "")
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = creds.curve_server_public, public, secret
        sock.connect(pool.status().address or "")
        sock.send_multipart(Codec(creds.key, "n9").encode({"t": Msg.NODE_HELLO, "host": "x", "pid": 1, "version": distnb.__version__}))
        deadline = time.monotonic() + 5
        while pool.status().rejected == before and time.monotonic() < deadline:
            time.sleep(0.05)
        sock.close()
        ctx.term()
        assert pool.status().rejected > before and len(pool._tracker.nodes.agents) == 1

        starters = pool._transport.multinode.starters if pool._transport.multinode else None
        assert starters is not None
        ssh_pids = sorted(starters.pids())
        started_pids.update(ssh_pids)
        _, out, _ = sh.line("dist_shutdown")
        assert "shut down" in out
        assert not wait_gone(ssh_pids, 10)
    finally:
        if pools.current_or_none() is not None:
            pools.current_pool().shutdown()


def test_srun_and_ssh_commands() -> None:
    config = distnb.LaunchConfig(nproc=4, hosts=("n2", "n3"), bind="0.0.0.0", node_python="/opt/py/bin/python")
    ssh = NodeStarters.ssh_commands(config, "tcp://n1:5555")
    assert [c[-2] for c in ssh] == ["n2", "n3"]
    assert ssh[0][-1] == "/opt/py/bin/python -m distnb.node --connect tcp://n1:5555 --key-file -"
    os.environ["SLURM_JOB_ID"] = "1"
    try:
        config = distnb.LaunchConfig(nproc=4, nnodes=3, slurm=True, bind="0.0.0.0")
    finally:
        del os.environ["SLURM_JOB_ID"]
    srun = NodeStarters.srun_command(config, "tcp://n1:5555", "/home/u/.distnb/keys/p.key")
    assert srun[0] == "srun" and "--nodes=2" in srun and "--ntasks-per-node=1" in srun
    assert any(a.startswith("--exclude=") for a in srun)
    assert srun[-6:] == ["-m", "distnb.node", "--connect", "tcp://n1:5555", "--key-file", "/home/u/.distnb/keys/p.key"]
