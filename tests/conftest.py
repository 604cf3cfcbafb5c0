"""Shared fixtures: pools shared by every module that asks for the same options, fresh pools for
destructive tests, one ``wait_until``, a session-end check that no process of distnb's outlives
the test run, and the controller's seam for tests without processes: :class:`FakeTransport` and
:func:`feed` (messages in through the wire's own checks, as the channel delivers them).

End-to-end tests (anything that starts a process) are marked ``slow``: ``python -m pytest -m
"not slow"`` is the fast loop."""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any, Callable, Iterable

import pytest

import distnb
from distnb import _processes
from distnb.wire.peers import Peer, PeerKind
from distnb.wire.protocol import accept

# Every process a pool starts inherits this variable, so the leak check can tell this test run's
# processes from anyone else's (another test run, a notebook) on the same machine.
#: Fixtures shared by test modules: the two network-namespace hosts (``net``).
pytest_plugins = ["netns_hosts"]

RUN_MARK = "DISTNB_TEST_RUN"
os.environ[RUN_MARK] = uuid.uuid4().hex
_PATTERNS = (b"distnb.worker", b"distnb.node", b"torch.distributed.run")

#: Every PID a test pool (or a test's own subprocess) was seen with.
started_pids: set[int] = set()
_pools: list[distnb.Pool] = []


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def session_id(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[3]) if len(fields) > 3 else None


def run_processes() -> list[int]:
    """Live processes of this test run that look like distnb's (torchrun agent, supervisor, rank)."""
    mark = f"{RUN_MARK}={os.environ[RUN_MARK]}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        cmdline = _read(f"/proc/{name}/cmdline")
        if not any(p in cmdline for p in _PATTERNS):
            continue
        if mark in _read(f"/proc/{name}/environ").split(b"\0") and _processes.pid_alive(int(name)):
            found.append(int(name))
    return sorted(found)


def marked_processes(var: str, value: str) -> set[int]:
    """Live processes (other than this one) whose environment carries ``var=value``: a test sets a
    fresh value in the environment of what it starts (a kernel, a server), and everything those
    start inherits it, so the test finds exactly its own processes."""
    needle = f"{var}={value}".encode()
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        if needle in _read(f"/proc/{name}/environ").split(b"\0") and _processes.pid_alive(int(name)):
            found.add(int(name))
    return found


def cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip() or "(gone)"


def run_notebook(nb, cwd: str, var: str, on_cell_executed=None, timeout: float = 120):
    """Execute ``nb`` in a real kernel (nbclient) with ``var`` set to a fresh token; afterwards
    nothing the kernel started may be left. Returns the executed notebook."""
    from nbclient import NotebookClient

    token = uuid.uuid4().hex
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}},
                            on_cell_executed=on_cell_executed)
    try:
        client.execute(env={**os.environ, var: token})
    finally:
        left = reap_marked(var, token)
    assert not left, "the notebook left processes behind:\n  " + "\n  ".join(left)
    return nb


def reap_marked(var: str, token: str, timeout: float = 5.0) -> list[str]:
    """After a kernel started with ``var=token`` is gone: give what it started ``timeout`` seconds
    to exit, kill the rest (ours: they carry this run's token) and describe them, one per line."""
    left = marked_processes(var, token)
    started_pids.update(left)
    survivors = wait_gone(left, timeout)
    details = [f"{p}: {cmdline(p)}" for p in survivors]
    kill_pids(survivors)  # don't leave them to the next test
    return details


def wait_until(predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.01) -> None:
    """Poll ``predicate`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


#: Cell code defining ``dbg_mark_inside(path)``: touch ``path`` once this rank's main thread is
#: inside torch's ``all_reduce``, and ``dbg_mark_calling(path, line)``: once it is inside a call
#: to C on that line of the cell (``req.wait()``: no Python frame of torch's to look for). A peer
#: that waits for the files then finds the ranks already waiting there, however busy the machine:
#: a file written just before the call let a descheduled rank be read "running Python code" still.
MARK_INSIDE = """\
def _dbg_mark_when(path, found):
    # A thread touches path once found(the main thread's innermost frame) holds; at most 120 s,
    # so that a test that failed first leaves nothing looking for ever.
    import sys, threading, time
    main, end = threading.main_thread().ident, time.monotonic() + 120
    def watch():
        while time.monotonic() < end:
            frame = sys._current_frames().get(main)
            if frame is not None and found(frame):
                open(path, "w").close()
                return
            time.sleep(0.005)
    threading.Thread(target=watch, daemon=True).start()


def dbg_mark_inside(path, name="all_reduce"):
    def found(frame):
        while frame is not None and not (frame.f_code.co_name == name and frame.f_code.co_filename.endswith("distributed_c10d.py")):
            frame = frame.f_back
        return frame is not None
    _dbg_mark_when(path, found)


def dbg_mark_calling(path, line):
    import dis
    _dbg_mark_when(path, lambda frame: frame.f_code.co_name == "<module>" and frame.f_lineno == line
                   and dis.opname[frame.f_code.co_code[frame.f_lasti]].startswith("CALL"))
"""


def usable(pool: distnb.Pool) -> distnb.Pool:
    """The pool, restarted first if an earlier test left it broken, hung or busy."""
    if pool.state != distnb.PoolState.READY or any(s.state == distnb.RankState.RUNNING for s in pool.status().ranks):
        pool.restart()
    return pool


class SharedPools:
    """One live pool per set of options, shared by every test module that asks for it (a launch
    costs seconds on 2 cores); tracked for the leak check and shut down at the session's end."""

    def __init__(self) -> None:
        self._pools: dict[tuple[tuple[str, object], ...], distnb.Pool] = {}

    def get(self, **options: object) -> distnb.Pool:
        options.setdefault("backend", "gloo")
        key = tuple(sorted(options.items()))
        pool = self._pools.get(key)
        if pool is None or pool.state in (distnb.PoolState.STOPPED, distnb.PoolState.NEW):
            pool = self._pools[key] = distnb.Pool(**options)  # type: ignore[arg-type]
            _pools.append(pool)
            pool.start()
        return usable(track(pool))

    def shutdown(self) -> None:
        for pool in self._pools.values():
            started_pids.update(pool.pids())
            pool.shutdown()


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` is alive; return the survivors."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _processes.pid_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def pool_processes(pool: distnb.Pool) -> set[int]:
    """The pool's PIDs plus every live process in their sessions (ranks, supervisors, helpers)."""
    pids = set(pool.pids())
    sids = {s for s in (session_id(p) for p in pids) if s is not None}
    for name in os.listdir("/proc"):
        if name.isdigit() and session_id(int(name)) in sids and _processes.pid_alive(int(name)):
            pids.add(int(name))
    return pids


def track(pool: distnb.Pool) -> distnb.Pool:
    """Remember a pool (and its PIDs) for the session-end leak check."""
    if pool not in _pools:
        _pools.append(pool)
    started_pids.update(pool.pids())
    return pool


def kill_pids(pids: Iterable[int]) -> None:
    """Last-resort cleanup: SIGKILL PIDs that this test run started (never by name)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="session")
def leak_check():
    """Session teardown: every pool shut down, and no distnb process of this run left."""
    yield
    errors = []
    for pool in _pools:
        started_pids.update(pool.pids())
        try:
            pool.shutdown()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(f"{pool!r}.shutdown() raised {exc!r}")
    survivors = wait_gone(started_pids, 10.0)
    strays = [p for p in run_processes() if _processes.pid_alive(p)]
    if strays:
        strays = wait_gone(strays, 10.0)
    leftover = sorted(set(survivors) | set(strays))
    if leftover:
        details = [f"{p}: {_read(f'/proc/{p}/cmdline').replace(bytes(1), b' ').decode(errors='replace')}" for p in leftover]
        kill_pids(leftover)  # don't leave them for the next run
        errors.append("distnb processes outlived the test session:\n  " + "\n  ".join(details))
    assert not errors, "\n".join(errors)


@pytest.fixture(scope="session", autouse=True)
def _session_leak_check(leak_check):
    yield


@pytest.fixture(scope="session")
def shared_pools(leak_check) -> SharedPools:
    pools = SharedPools()
    yield pools
    pools.shutdown()


@pytest.fixture
def pool4(shared_pools: SharedPools) -> distnb.Pool:
    """4 gloo ranks, shared by the whole session (a majority to name an odd rank against, a 2×2
    mesh); tests use unique variable names."""
    return shared_pools.get(nproc=4)


@pytest.fixture
def pool3(shared_pools: SharedPools) -> distnb.Pool:
    """3 gloo ranks that call a hang after 1 s, shared by the session."""
    return shared_pools.get(nproc=3, hang_after=1.0)


@pytest.fixture
def pool2(shared_pools: SharedPools) -> distnb.Pool:
    """2 gloo ranks that call a hang after 1 s, shared by the session."""
    return shared_pools.get(nproc=2, hang_after=1.0)


@pytest.fixture
def pool(pool4: distnb.Pool) -> distnb.Pool:
    """``pool4``, checked usable before and idle after each test that shares it."""
    assert pool4.state == distnb.PoolState.READY, f"the shared pool is {pool4.state.value}; an earlier test broke it"
    yield pool4
    busy = [r for r in pool4.status().ranks if r.state == distnb.RankState.RUNNING]
    if busy:  # a test left a cell running: interrupt it so the next test finds the pool idle
        pool4.interrupt()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(r.state == distnb.RankState.RUNNING for r in pool4.status().ranks):
            time.sleep(0.05)


@pytest.fixture
def fresh_pool(leak_check) -> Callable[..., distnb.Pool]:
    """Factory for pools a test may break or kill: ``fresh_pool(nproc=2)``; shut down after the test.

    Without spare rank processes unless the test asks (``spares=True``): a spare imports torch once
    more per rank (~2.5 s of CPU each here), for a restart that most of these short-lived pools
    never make, while the test's own cells run beside it. A restart without spares starts its
    ranks then; the tests of restarts ask for the user's default."""
    made: list[distnb.Pool] = []

    def make(nproc: int = 2, **kwargs) -> distnb.Pool:
        kwargs.setdefault("backend", "gloo")
        kwargs.setdefault("spares", False)
        pool = distnb.Pool(nproc=nproc, **kwargs)
        made.append(pool)
        _pools.append(pool)
        pool.start()
        return track(pool)

    yield make
    for pool in made:
        pids = pool_processes(pool) | set(pool.pids())
        started_pids.update(pids)
        pool.shutdown()
        assert not wait_gone(pids, 5.0), f"processes of {pool!r} survived shutdown"


#: Fixtures that start a pool: a test asking for one is end-to-end, whatever its module says.
_POOL_FIXTURES = {"pool", "pool2", "pool3", "pool4", "fresh_pool", "shared_pools", "small_pool", "sh", "two_nodes"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that starts a pool as ``slow``, so ``-m "not slow"`` can't pick one up by
    accident; modules that start kernels, browsers or subprocesses mark themselves."""
    for item in items:
        if _POOL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _own_cell_names(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test that makes up a result for "cell 7" names it so, whatever In[n] a real pool's
    cell 7 had earlier in this process (cell names live in one process-wide table): tests that
    start no pool see a table of their own."""
    if not _POOL_FIXTURES & set(request.fixturenames):
        from distnb import cell_names

        monkeypatch.setattr(cell_names, "_labels", {})


class FakeTransport:
    """The controller's :class:`~distnb.controller.requests.Transport` without a socket: records
    what the tracker (or a service) sends; a test answers as a rank would, with :func:`feed`."""

    def __init__(self) -> None:
        self.heartbeat_peers: set[bytes] = set()
        self.sent: list[tuple[bytes, dict[str, Any]]] = []
        self.on_send: Any = None

    def send(self, identity: bytes, msg: dict[str, Any]) -> None:
        self.send_many((identity,), msg)

    def send_many(self, identities: Iterable[bytes], msg: dict[str, Any]) -> None:
        for identity in identities:
            self.sent.append((identity, dict(msg)))
            if self.on_send is not None:
                self.on_send(identity, dict(msg))

    def kinds(self) -> list[str]:
        return [m["t"] for _, m in self.sent]


def feed(tracker: Any, kind: str, number: int, msg: dict[str, Any]) -> None:
    """Deliver ``msg`` from peer ``kind`` (``"x"``, ``"c"``, ``"s"``, ``"n"``) ``number`` as the
    channel does: checked by :func:`~distnb.wire.protocol.accept` first (a malformed message
    raises here, as it is rejected there), then handed to ``tracker.on_message``."""
    peer_kind = PeerKind(kind)
    tracker.on_message(Peer(peer_kind, number), accept(peer_kind, msg))


@pytest.fixture
def transport() -> FakeTransport:
    return FakeTransport()
