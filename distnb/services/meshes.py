"""``%dist_mesh``: every rank's device meshes, asked of its control thread (it answers while a
cell runs), compared, with each rank's collectives counted per mesh dimension from the log."""

from __future__ import annotations

from collections import Counter

from distnb.analysis.agreement.groups import GroupInfo
from distnb.analysis.reports.meshes import MeshReport
from distnb.controller.collective_log import CollectiveLog
from distnb.controller.requests import Requests
from distnb.wire.peers import control_identity
from distnb.wire.protocol import Msg

__all__ = ["MESHES_TIMEOUT", "mesh_report"]

#: How long the ranks have to list their meshes (a walk of the garbage collector's objects).
MESHES_TIMEOUT = 10.0


def mesh_report(requests: Requests, log: CollectiveLog, targets: list[int]) -> MeshReport:
    replies = requests.ask(control_identity, targets, {"t": Msg.MESHES}, MESHES_TIMEOUT, partial=True)
    meshes, errors = {}, {}
    for r in targets:
        got = replies.get(r, {}).get("meshes")
        if isinstance(got, list):
            meshes[r] = got
        elif isinstance(got, dict):
            errors[r] = str(got.get("error"))
        else:
            errors[r] = (f"did not answer within {MESHES_TIMEOUT:.0f} s (its control thread is starved: a C call holding the GIL?); "
                         "try again, or see %dist_stacks")
    counts: dict[int, dict[str, int]] = {}
    for r in targets:
        # By the rank's own description of each group: a rank that named a dimension otherwise counts under its name.
        roles = Counter(GroupInfo(e["group"], e.get("desc")).role() for e in log.entries.get(r, {}).values() if not e["p2p"])
        counts[r] = dict(roles)
    return MeshReport(meshes, errors, counts)
