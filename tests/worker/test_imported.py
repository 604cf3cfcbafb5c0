"""A rank's own threads read torch only as the main thread has imported it (worker/torch_hooks/imported.py):
the control thread's readers, asked while a fresh rank's main thread still imports torch, once ran
``from torch._C import …`` there and the rank died (``terminate called after throwing an instance of
'python_error'``, or ``_DeadlockError`` on ``torch._C``'s import lock: CI, torch 2.15)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from importlib.machinery import ModuleSpec

import pytest

from distnb.worker.torch_hooks.imported import imported_module


def _module(monkeypatch: pytest.MonkeyPatch, name: str, initializing: bool) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = ModuleSpec(name, None)
    module.__spec__._initializing = initializing  # type: ignore[attr-defined]  (what importlib sets while it runs the module)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_a_module_counts_once_it_and_every_package_above_it_have_finished_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    top = _module(monkeypatch, "distnb_fake_top", initializing=True)
    inner = _module(monkeypatch, "distnb_fake_top.inner", initializing=False)
    assert imported_module("distnb_fake_top") is None and imported_module("distnb_fake_top.inner") is None  # its package still runs
    top.__spec__._initializing = False  # type: ignore[union-attr]
    assert imported_module("distnb_fake_top") is top and imported_module("distnb_fake_top.inner") is inner
    inner.__spec__._initializing = True  # type: ignore[union-attr]
    assert imported_module("distnb_fake_top.inner") is None
    assert imported_module("distnb_fake_top.never") is None and imported_module("distnb_fake_absent") is None
    assert "distnb_fake_top.never" not in sys.modules  # looked up, never imported


_RACE = textwrap.dedent("""
    import sys, threading, time
    from distnb.worker.recorders.memory_sampler import MemorySampler
    from distnb.worker.torch_hooks.compile_record import CompileRecorder
    from distnb.worker.torch_hooks.flight_recorder import GROUPS, CellClock, SeqWatch, read_collectives
    from distnb.worker.torch_hooks.imported import imported_module
    from distnb.worker.torch_hooks.meshes import describe_meshes

    done = threading.Event()
    during = []

    def control():  # what the control thread reads when the controller asks a starting rank
        clock, seqs, memory, compiles = CellClock(), SeqWatch(), MemorySampler(), CompileRecorder()
        compiles.on = True
        while not done.is_set():
            importing = "torch" in sys.modules and imported_module("torch") is None
            read_collectives(-1, clock, groups=True)
            GROUPS.fields(True)
            seqs.snapshot()
            memory.stop()
            compiles.snapshot()
            describe_meshes({})
            if importing:
                during.append(1)
            time.sleep(0.001)

    thread = threading.Thread(target=control, daemon=True)
    thread.start()
    import torch.distributed
    done.set()
    thread.join()
    print("reads while torch imported:", len(during), "SeqWatch usable:", SeqWatch().usable)
""")


@pytest.mark.timeout(300)
def test_the_control_threads_readers_never_import_torch_while_the_main_thread_does() -> None:
    """A fresh process, since torch is imported once per process: the readers run throughout the
    main thread's first import of torch. Before the fix this aborted the process, 3 times in 3."""
    proc = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads = int(proc.stdout.split("reads while torch imported:")[1].split()[0])
    assert reads > 0, proc.stdout  # the readers really ran inside the import's window
