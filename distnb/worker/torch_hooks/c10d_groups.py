"""What the call log reads of torch's process-group tables: a group's name, members, description
and next sequence number, a rank's global number from its number in a group, how many groups were
made, and whether torch will skip a call on a group (the rank is not a member). Each read is of
``torch.distributed.distributed_c10d`` as already imported (never an import of its own: a control
thread must not wait on the main thread's import lock), and answers None or "?" where torch has
moved a name."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["description", "global_rank", "group_count", "group_name", "members", "next_seq", "not_a_member"]


def group_name(group: Any) -> str:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return "?"
    try:
        pg = group if group is not None else c10d._world.default_pg
        return str(c10d._world.pg_names.get(pg, "?"))
    except Exception:
        return "?"


def not_a_member(group: Any) -> bool:
    """Whether torch will skip a call on ``group`` here: new_group gave a rank outside the group
    ``GroupMember.NON_GROUP_MEMBER``, and every c10d call on it returns at once, doing nothing
    (torch's own test, which the calls make)."""
    if group is None:
        return False
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        return bool(c10d._rank_not_in_group(group))  # type: ignore[union-attr]
    except Exception:
        return False


def next_seq(group: Any) -> int | None:
    """The number the group's next collective will have in its sequence (None: unknown, e.g. a
    group this rank is not a member of)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        pg = group if group is not None else c10d._world.default_pg  # type: ignore[union-attr]
        return int(pg._get_sequence_number_for_group()) + 1
    except Exception:
        return None


def group_count() -> int | None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        return int(c10d._world.group_count)  # type: ignore[union-attr]
    except Exception:
        return None


def global_rank(group: Any, group_rank: Any) -> int | None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        return int(c10d.get_global_rank(group if group is not None else c10d._world.default_pg, int(group_rank)))  # type: ignore[union-attr]
    except Exception:
        return None


def members(group: Any) -> list[int] | None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        return sorted(int(r) for r in c10d.get_process_group_ranks(group if group is not None else c10d._world.default_pg))  # type: ignore[union-attr]
    except Exception:
        return None


def description(group: Any) -> str | None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        desc = (group if group is not None else c10d._world.default_pg).group_desc  # type: ignore[union-attr]
        return str(desc) if desc else None
    except Exception:
        return None
