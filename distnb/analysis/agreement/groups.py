"""Process groups named as the user built them.

torch numbers groups (``"3"``) or hashes their members (NCCL's mesh groups: 40 hex digits), and
neither is what a user wrote. What the user wrote survives in two places: a device mesh names each
dimension's groups ``mesh_<dim>`` (torch's ``group_desc``), and a plain ``new_group`` call has a
site in a cell (distnb's call log). A group reads ``dp (ranks 1,3)``, ``group 0`` (the default
group, by the name every torch user knows), or ``group 5 (ranks 0,1), from new_group at cell 2
line 3``.

A group's *role* is what ranks in step share while their groups differ: on a (dp, tp) mesh rank 0
reduces over ``tp`` = ranks 0,1 and rank 2 over ``tp`` = ranks 2,3 — two groups, one role. Ranks
issuing the same collective at the same point in a cell must agree on the role.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from distnb.cell_names import cell_name
from distnb.ranks import format_ranks
from distnb.wire.record_types import CallRecord

__all__ = ["GroupInfo", "info_from", "mesh_dim", "short_name", "site_of"]

_HASH = re.compile(r"[0-9a-f]{16,}")


def mesh_dim(desc: str | None) -> str | None:
    """``dp`` for a group a device mesh made for its dimension ``dp`` (torch's ``mesh_dp``)."""
    if desc and desc.startswith("mesh_") and desc != "mesh_default":
        return desc[len("mesh_"):]
    return None


def short_name(name: str) -> str:
    """A hashed group name (NCCL's split groups) cut to its first 8 digits, like a git commit."""
    return name[:8] if _HASH.fullmatch(name) else name


@dataclass(frozen=True)
class GroupInfo:
    """What distnb knows of one process group, from any rank: its name, torch's description of it,
    its members and, for a plain ``new_group``, where the call was made."""

    name: str
    desc: str | None = None
    ranks: tuple[int, ...] | None = None
    site: tuple[int, int] | None = None  # (cell, line) of the new_group call that made it

    @property
    def dim(self) -> str | None:
        return mesh_dim(self.desc)

    @property
    def described(self) -> bool:
        """torch was given a description of its own (``group_desc=``), not its ``undefined``."""
        return bool(self.desc) and self.desc != "undefined"

    @property
    def world(self) -> bool:
        return self.name == "0" or self.desc == "default_pg"

    def label(self) -> str:
        """``dp (ranks 1,3)``, ``group 0``, ``group 5 (ranks 0,1), from new_group at cell 2 line 3``."""
        return self._label

    @functools.cached_property
    def _label(self) -> str:  # named in every line about the group: its members formatted once
        members = f" ({format_ranks(list(self.ranks))})" if self.ranks else ""
        if self.world:
            return f"group {short_name(self.name)}"
        if self.dim is not None:
            return f"{self.dim}{members}"
        if self.described:
            return f"{self.desc}{members}"
        site = f", from new_group at {cell_name(self.site[0])} line {self.site[1]}" if self.site else ""
        return f"group {short_name(self.name)}{members}{site}"

    def role(self) -> str:
        """What ranks in step must share: the mesh dimension, torch's description, the size of a
        ``new_group`` group (or its site), or (knowing none of these) the group itself."""
        if self.world:
            return "group 0"
        if self.dim is not None:
            return self.dim
        if self.described:
            return str(self.desc)
        # Groups new_group made are alike when they are as large: ``lo = new_group([0, 1]); hi =
        # new_group([2, 3])`` at two lines are one role (``mine = lo if rank < 2 else hi``).
        if self.ranks:
            return f"the groups of {len(self.ranks)} ranks made by new_group"
        if self.site:
            return f"the groups of new_group at {cell_name(self.site[0])} line {self.site[1]}"
        return f"group {short_name(self.name)}"


def info_from(name: str, groups: dict[str, list[int]], descs: dict[str, str], sites: dict[str, tuple[int, int]]) -> GroupInfo:
    ranks = groups.get(name)
    return GroupInfo(name, descs.get(name), tuple(ranks) if ranks else None, sites.get(name))


def site_of(call: CallRecord) -> tuple[int, int] | None:
    """A new_group call's (cell, line), when it was made from a cell."""
    cell, line = call.get("cell"), call.get("line")
    return (cell, line) if cell is not None and line is not None else None
