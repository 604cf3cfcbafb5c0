"""Notebook values on their way to the ranks: checked and pickled before anything is sent."""

from __future__ import annotations

import pickle
from typing import Any

from distnb._text import mib
from distnb.controller.requests import Requests
from distnb.errors import RemoteError
from distnb.ranks import format_ranks
from distnb.wire import codec
from distnb.wire.peers import exec_identity
from distnb.wire.protocol import Msg

__all__ = ["errors_of", "fetch_value", "pack_values", "send_values"]

#: How long a push or pull waits for the ranks' answers (a rank may be finishing a cell first).
VALUES_TIMEOUT = 60.0


def pack_values(values: dict[str, Any]) -> bytes:
    """``values`` pickled as one push; ValueError naming the culprit (and what to do instead) for
    a value that can't be pickled or a push over distnb's per-message limit."""
    if not values:
        raise ValueError("name at least one value to push, e.g. pool.push(lr=0.1).")
    for name, value in values.items():
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise ValueError(
                f"{name!r} can't be sent to the ranks: {type(exc).__name__}: {exc}. "
                "Push picklable data (tensors, numbers, dicts) or build the object in a cell."
            ) from None
    blob = pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL)
    room = codec.MAX_FRAME_BYTES - 4096  # the message's own fields and signature
    if len(blob) > room:
        sizes = ", ".join(f"{n!r} {mib(len(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)))}" for n, v in values.items())
        raise ValueError(
            f"the push is {mib(len(blob))} pickled ({sizes}), over distnb's limit of {mib(room)} per message. "
            "Push fewer names at a time, send a smaller value, or save it to a file the ranks can read "
            "(torch.save(value, path), then torch.load(path) in a cell); DISTNB_MAX_FRAME_BYTES raises the limit."
        )
    return blob


def errors_of(replies: dict[int, dict[str, Any]]) -> dict[int, str]:
    """The ranks whose reply is not ``ok``, with their error."""
    return {r: str(m.get("error")) for r, m in sorted(replies.items()) if m.get("status") != "ok"}


def send_values(requests: Requests, blob: bytes, targets: list[int], names: tuple[str, ...]) -> None:
    """A packed push into the targets' namespaces; RemoteError naming the ranks that refused it."""
    errors = errors_of(requests.ask(exec_identity, targets, {"t": Msg.PUSH, "values": blob}, VALUES_TIMEOUT))
    if errors:
        raise RemoteError(f"push of {', '.join(names)} failed on {format_ranks(errors)}: {next(iter(errors.values()))}",
                          errors=errors)


def fetch_value(requests: Requests, name: str, targets: list[int]) -> dict[int, Any]:
    """``{rank: value}`` of ``name`` on the targets; RemoteError naming the ranks that lack it."""
    replies = requests.ask(exec_identity, targets, {"t": Msg.PULL, "names": [name]}, VALUES_TIMEOUT)
    errors = errors_of(replies)
    if errors:
        first = next(iter(errors.values()))
        hint = " Check the spelling, or define it in an %%on_ranks cell first." if "is not defined" in first else ""
        raise RemoteError(f"pull of {name!r} failed on {format_ranks(errors)}: {first}.{hint}", errors=errors)
    return {r: pickle.loads(replies[r]["values"][name]) for r in targets}
