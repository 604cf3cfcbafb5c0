"""A torchrun script pasted into cells: its ``init_process_group`` and its clean-up.

Every rank of a pool has its default process group from launch. A script's first lines
(``dist.init_process_group("nccl")``) would raise "trying to initialize the default process group
twice!", and its last (``dist.destroy_process_group()``) would leave every later cell without a
group. Both are kept to what the pool can honour: the pool's group stays, and the rank says so in
one line, naming what the script asked for that differs from what it has."""

from __future__ import annotations

import contextlib
import sys
from datetime import timedelta
from typing import Any, Callable, Iterator

from distnb.worker.torch_hooks.patching import wrap_c10d

__all__ = ["distnb_calls", "install"]

#: Calls distnb makes itself (a regroup destroys and re-creates the default group) pass through.
_own = 0


@contextlib.contextmanager
def distnb_calls() -> Iterator[None]:
    """Around distnb's own group changes: the wrappers step aside."""
    global _own
    _own += 1
    try:
        yield
    finally:
        _own -= 1


def _note(text: str) -> None:
    print(f"[distnb] {text}", file=sys.stderr, flush=True)


def _differences(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """What the script asked of ``init_process_group`` that the pool's group is not."""
    import torch.distributed as dist

    asked = dict(zip(("backend", "init_method", "timeout", "world_size", "rank"), args)) | kwargs
    have: dict[str, Any] = {"backend": str(dist.get_backend()), "world_size": dist.get_world_size(), "rank": dist.get_rank()}
    out = []
    backend = asked.get("backend")
    if backend is not None and str(backend).lower() not in str(have["backend"]).lower():
        out.append(f"backend {backend!r} asked, the pool's is {have['backend']!r} (%dist_launch --backend {backend})")
    for name in ("world_size", "rank"):
        value = asked.get(name)
        if value is not None and value != -1 and value != have[name]:
            out.append(f"{name} {value} asked, this rank's is {have[name]}")
    timeout = asked.get("timeout")
    if isinstance(timeout, timedelta):
        out.append(f"timeout {timeout.total_seconds():.0f} s asked: the pool's is %dist_launch --pg-timeout")
    return out


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    import torch.distributed as dist

    if name == "init_process_group":

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            if _own or not dist.is_initialized():
                return original(*args, **kwargs)
            differs = _differences(args, kwargs)
            _note(f"init_process_group: kept the pool's process group ({dist.get_backend()}, {dist.get_world_size()} ranks), "
                  "which every rank has had since launch"
                  + (f"; {'; '.join(differs)}." if differs else "."))
            return None

        return init_process_group

    def destroy_process_group(group: Any = None) -> Any:
        from torch.distributed import distributed_c10d as c10d

        if _own or not dist.is_initialized() or (group is not None and group is not c10d.GroupMember.WORLD):
            return original(group) if group is not None else original()
        _note("destroy_process_group: kept the pool's process group, which the next cells use "
              "(a script's clean-up has nothing to do here; %dist_restart gives fresh ranks).")
        return None

    return destroy_process_group


def install() -> None:
    """After the pool's own ``init_process_group``: a cell's calls meet the wrappers."""
    wrap_c10d(("init_process_group", "destroy_process_group"), _wrap, "__distnb_pasted__")
