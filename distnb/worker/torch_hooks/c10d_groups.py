"""What the call log reads of torch's process-group tables: a group's name, members, description
and next sequence number, a rank's global number from its number in a group, how many groups were
made, whether torch will skip a call on a group (the rank is not a member), and the default group's
rendezvous store (``--profile`` meets the cell's ranks on it). Each read is of
``torch.distributed.distributed_c10d`` as already imported (never an import of its own: a control
thread must not wait on the main thread's import lock), and answers None or "?" where torch has
moved a name."""

from __future__ import annotations

from typing import Any

from distnb.worker.torch_hooks.imported import imported_module

__all__ = ["default_store", "description", "global_rank", "group_count", "group_name", "members", "next_seq", "not_a_member"]


def _c10d() -> Any:
    return imported_module("torch.distributed.distributed_c10d")


def _pg(group: Any) -> Any:
    """``group``, or the default group for None (raises where torch.distributed is not up)."""
    return group if group is not None else _c10d()._world.default_pg


def group_name(group: Any) -> str:
    try:
        return str(_c10d()._world.pg_names.get(_pg(group), "?"))
    except Exception:  # torch.distributed not imported, or a name torch moved
        return "?"


def not_a_member(group: Any) -> bool:
    """Whether torch will skip a call on ``group`` here: new_group gave a rank outside the group
    ``GroupMember.NON_GROUP_MEMBER``, and every c10d call on it returns at once, doing nothing
    (torch's own test, which the calls make)."""
    if group is None:
        return False
    try:
        return bool(_c10d()._rank_not_in_group(group))
    except Exception:
        return False


def next_seq(group: Any) -> int | None:
    """The number the group's next collective will have in its sequence (None: unknown, e.g. a
    group this rank is not a member of)."""
    try:
        return int(_pg(group)._get_sequence_number_for_group()) + 1
    except Exception:
        return None


def default_store() -> Any:
    """The default group's rendezvous store; None where there is no default group (not up yet,
    or a cell destroyed it)."""
    try:
        return _c10d()._get_default_store()
    except Exception:
        return None


def group_count() -> int | None:
    try:
        return int(_c10d()._world.group_count)
    except Exception:
        return None


def global_rank(group: Any, group_rank: Any) -> int | None:
    try:
        return int(_c10d().get_global_rank(_pg(group), int(group_rank)))
    except Exception:
        return None


def members(group: Any) -> list[int] | None:
    try:
        return sorted(int(r) for r in _c10d().get_process_group_ranks(_pg(group)))
    except Exception:
        return None


def description(group: Any) -> str | None:
    try:
        desc = _pg(group).group_desc
        return str(desc) if desc else None
    except Exception:
        return None
