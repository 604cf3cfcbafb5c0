"""What the numerics record (numerics.py) knows of an op and of a tensor: the op's kind, read once
from its schema and tags (a view, an allocation, a collective, an op that makes values), and a live
tensor's entry (its version, fingerprint, producer and the ranks it must agree with)."""

from __future__ import annotations

import weakref
import zlib
from typing import Any

from distnb.wire.record_types import TENSORS_READ
from distnb.worker.torch_hooks.comms import OUTPUT_FIRST
from distnb.worker.torch_hooks.numerics_context import Agree

__all__ = ["OpKind", "TensorInfo", "leaves", "fills_memory", "intersect", "rng_state", "SCALARS", "VIEW", "SKIP", "COLL", "OP", "EMPTY"]

#: Collectives after which every member of the group holds the same result.
_AGREEING = {"allreduce_", "broadcast_", "allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "allreduce_coalesced_",
             "all_reduce", "all_reduce_", "all_gather_into_tensor", "all_gather_into_tensor_out", "all_reduce_coalesced",
             "all_reduce_coalesced_", "all_gather_into_tensor_coalesced", "broadcast"}
_COLLECTIVE_NS = {"c10d", "_c10d_functional", "c10d_functional"}
#: Ops whose output is their input's value (read as a view is: no fingerprint of their own).
_SAME_VALUE = {"detach", "lift_fresh", "wait_tensor", "_wrap_tensor_autograd", "alias", "clone"}
SCALARS = (int, float, bool, str, complex, type(None))
#: Ops that allocate without writing: their bytes are whatever the memory held (not a value to compare).
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
#: Ops whose later outputs are allocated, not written (FSDP2's copy-in returns the all-gather's
#: input and its uninitialised output buffer): how many outputs hold values.
_WRITTEN_OUTPUTS = {"all_gather_copy_in": 1}

VIEW, SKIP, COLL, OP, EMPTY = 0, 1, 2, 3, 4


class OpKind:
    __slots__ = ("kind", "name", "skip_first", "out_kw", "written", "in_place", "random", "stable", "agreeing", "valued")

    def __init__(self, func: Any) -> None:
        import torch

        schema = func._schema
        packet = func._overloadpacket.__name__
        self.name = f"{func.namespace}.{func.__name__}"
        self.out_kw = {a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write}
        self.written = [i for i, a in enumerate(schema.arguments)
                        if not a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        #: It writes tensors it was given (``add_``, ``out=``): their versions move after the record's kernel returns.
        self.in_place = bool(self.written or self.out_kw)
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        self.stable = torch.Tag.nondeterministic_bitwise not in func.tags  # equal inputs, equal bits
        self.valued = _WRITTEN_OUTPUTS.get(packet, TENSORS_READ)
        returns = any("Tensor" in str(r.type) for r in schema.returns)
        collective = func.namespace in _COLLECTIVE_NS
        self.agreeing = collective and packet in _AGREEING
        self.skip_first = packet == "copy_" or (collective and packet.rstrip("_") in OUTPUT_FIRST)
        if func.namespace == "profiler":
            self.kind = SKIP
        elif packet in _UNINITIALISED:
            self.kind = EMPTY
        elif func.is_view or packet in _SAME_VALUE:
            self.kind = VIEW
        elif collective and packet != "wait_tensor":
            self.kind = COLL
        elif returns or self.written or self.out_kw:
            self.kind = OP
        else:
            self.kind = SKIP  # .item(), equal(): nothing made


class TensorInfo:
    """What the record knows of one live tensor."""

    __slots__ = ("ref", "version", "agree", "why", "label", "producer", "fp", "pending", "uninit")

    def __init__(self, t: Any) -> None:
        self.ref = weakref.ref(t)
        self.version = -1
        self.agree: Agree | None = None
        self.why = ""
        self.label: str | None = None
        self.producer = -1
        self.fp: list[Any] | None = None  # [hash, sum]: device tensors until fetched, then numbers
        self.pending = -1  # the collective whose unread output this is
        self.uninit = -1  # allocated uninitialised (empty_like): the version it had then


def leaves(x: Any) -> list[Any]:
    """An op's arguments flattened: what torch's pytree does for them (tuples, lists, dicts of
    leaves), at a fraction of its cost per op."""
    out: list[Any] = []
    todo = [x]
    while todo:
        v = todo.pop()
        if isinstance(v, (tuple, list)):
            todo.extend(reversed(v))
        elif isinstance(v, dict):
            todo.extend(reversed(list(v.values())))
        else:
            out.append(v)
    return out


def fills_memory(t: Any) -> bool:
    """Its elements fill its memory once: contiguous, or a 2-D transpose of a contiguous tensor."""
    return bool(t.is_contiguous() or (t.dim() == 2 and t.stride() == (1, t.shape[0])))


def intersect(agrees: list[Agree | None]) -> Agree | None:
    if not agrees or any(a is None for a in agrees):
        return None
    common = set(agrees[0] or ())
    for a in agrees[1:]:
        common &= set(a or ())
    return tuple(sorted(common)) if len(common) > 1 else None


def rng_state(kwargs: dict[str, Any], tensors: list[Any]) -> int:
    """A fingerprint of the generator a random op is about to draw from (its ``generator=``, else
    its device's default): ranks whose states match draw the same numbers. 0 where none is read."""
    import torch

    try:
        gen = kwargs.get("generator")
        if gen is None:
            device = torch.device(kwargs.get("device") or (tensors[0].device if tensors else "cpu"))
            if device.type == "cpu":
                gen = torch.default_generator
            elif device.type == "cuda":
                gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
            else:
                return 0
        return zlib.crc32(gen.get_state().numpy().tobytes()) or 1
    except Exception:  # a generator that cannot say its state: the comparison goes without it
        return 0
