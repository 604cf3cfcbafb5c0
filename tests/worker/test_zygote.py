"""A zygote forks rank processes on the pipes its supervisor sends (worker/process/zygote.py): the
child's stdio are those pipes, and its exit status comes through the zygote (that a rank dies with
its zygote: tests/controller/test_restart.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from distnb.worker.process.zygote import ForkedRank, Zygote, heavy_modules


def test_only_torch_and_its_libraries_modules_are_warmed() -> None:
    names = ["torch._dynamo", "sympy.core", "json", "mypackage.train", "torchvision", "numpy.linalg", "torch"]
    assert heavy_modules(names) == ["torch._dynamo", "sympy.core", "numpy.linalg", "torch"]


def _read_all(fd: int, deadline: float) -> str:
    out = b""
    while time.monotonic() < deadline:
        data = os.read(fd, 65536)
        if not data:
            break
        out += data
    return out.decode()


@pytest.mark.slow  # a zygote imports torch
@pytest.mark.timeout(120)
def test_a_forked_rank_writes_on_its_own_pipes_and_its_exit_comes_through_the_zygote() -> None:
    zygote = Zygote.start(dict(os.environ), lambda: None)
    try:
        zygote.warm(["torch.distributed.fsdp", "json"])
        assert zygote.modules == {"torch.distributed.fsdp"}
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        extra_r, extra_w = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != "RANK"}  # the rank then fails, on its stderr, at once
        rank = zygote.fork(env, out_w, err_w, {"DISTNB_FAULT_FD": extra_w}, timeout=90.0)
        for fd in (out_w, err_w, extra_w):
            os.close(fd)
        assert isinstance(rank, ForkedRank)
        assert rank.wait(60.0) == 1
        assert "KeyError: 'RANK'" in _read_all(err_r, time.monotonic() + 10), "the child's stderr is not the pipe it was given"
        assert _read_all(extra_r, time.monotonic() + 10) == ""  # every copy of the passed pipe closed with the child
        assert rank.poll() == 1
        # A second fork, killed: its signal, as a Popen would say it.
        out_r2, out_w2 = os.pipe()
        rank2 = zygote.fork(env | {"RANK": "x"}, out_w2, out_w2, {}, timeout=30.0)
        os.close(out_w2)
        assert rank2 is not None
        rank2.kill()
        assert rank2.wait(30.0) in (-signal.SIGKILL, 1)  # killed, or it had already failed on RANK=x
    finally:
        zygote.close()
    assert not zygote.alive()



def test_a_zygote_refuses_to_fork_beside_a_python_thread_or_the_cuda_driver(tmp_path) -> None:
    plain, cuda = tmp_path / "maps", tmp_path / "maps-cuda"
    plain.write_text("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    cuda.write_text(plain.read_text() + "7f20-7f30 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
    script = ("import sys, threading, time\nfrom distnb.worker.process.zygote import fork_refusal\n"
              "print(repr(fork_refusal(sys.argv[1])))\nprint(repr(fork_refusal(sys.argv[2])))\n"
              "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\nprint(repr(fork_refusal(sys.argv[1])))\n")
    out = subprocess.run([sys.executable, "-c", script, str(plain), str(cuda)], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.splitlines() == ["''", "'the zygote has loaded the CUDA driver'", "'the zygote has 2 Python threads'"], out


@pytest.mark.slow  # a zygote imports torch
@pytest.mark.timeout(120)
def test_a_dead_zygote_forks_nothing_and_says_so_by_none() -> None:
    """The supervisor then starts the rank as a process (worker/process/supervisor.py)."""
    zygote = Zygote.start(dict(os.environ), lambda: None)
    zygote.proc.kill()
    zygote.proc.wait(30.0)
    zygote.warm(["torch.distributed.fsdp"])  # to a dead zygote: nothing, no error
    r, w = os.pipe()
    try:
        assert zygote.fork(dict(os.environ), w, w, {}, timeout=30.0) is None
    finally:
        os.close(r)
        os.close(w)
        zygote.close()
