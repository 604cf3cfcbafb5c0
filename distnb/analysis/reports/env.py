"""Each rank's distributed environment side by side (``%dist_env``, ``pool.env()``), with the
variables that differ between ranks flagged."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distnb.ranks import format_ranks, group_by

__all__ = ["CONTRACT_ENV", "EnvReport", "PER_RANK_ENV"]


#: Variables that are meant to differ between ranks.
PER_RANK_ENV = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK"}
#: torchrun's contract and the device mask: always listed, "<unset>" where a rank lacks one (an
#: unset CUDA_VISIBLE_DEVICES is the usual way several ranks end up on GPU 0).
CONTRACT_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")


@dataclass
class EnvReport:
    """Each rank's distributed environment, with the variables that differ flagged."""

    env: dict[int, dict[str, str]]
    hosts: dict[int, str | None] = field(default_factory=dict)

    def names(self) -> list[str]:
        """Every variable some rank has, and torchrun's contract whether set or not."""
        return sorted({k for e in self.env.values() for k in e} | set(CONTRACT_ENV))

    def differing(self) -> list[str]:
        """Names whose value is not the same on every rank (and is not meant to differ)."""
        return [n for n in self.names() if n not in PER_RANK_ENV and len({e.get(n) for e in self.env.values()}) > 1]

    def text(self) -> str:
        ranks = sorted(self.env)
        names = self.names()
        flagged = set(self.differing())
        width = max([20, *map(len, names)])
        differ = f" — {len(flagged)} variable(s) differ between ranks: {', '.join(sorted(flagged))}" if flagged else ""
        lines = [f"environment of {format_ranks(ranks)}{differ}"]
        if self.hosts:
            for hs, host in group_by((r, self.hosts.get(r)) for r in ranks):
                lines.append(f"  {'host':<{width}} {host or '?'} ({format_ranks(hs)})")
        for name in names:
            values = group_by((r, self.env[r].get(name)) for r in ranks)
            if len(values) == 1:
                value = values[0][1]
                lines.append(f"  {name:<{width}} {'<unset>' if value is None else value} (all ranks)")
            elif name in PER_RANK_ENV and all(len(rs) == 1 for rs, _ in values):
                lines.append(f"  {name:<{width}} " + ", ".join(f"{v}" for _, v in values) + " (per rank, as expected)")
            else:
                mark = "!" if name in flagged else " "
                shown = "; ".join(f"{format_ranks(rs)}: {'<unset>' if v is None else v}" for rs, v in values)
                lines.append(f"{mark} {name:<{width}} {shown}" + ("  <- differs" if name in flagged else ""))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())
