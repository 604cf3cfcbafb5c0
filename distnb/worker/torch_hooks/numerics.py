"""``%%on_ranks --numerics``: every op the cell runs on a rank, with a fingerprint of what it made.

A ``TorchDispatchMode`` (torch/utils/_python_dispatch.py) sees each op below autograd — forward,
backward (the engine runs CPU work on the calling thread, and carries the mode to its own threads),
the optimizer's step, and the collectives torch.distributed, DDP, FSDP2 and DTensor issue, which
go through the dispatcher as ``c10d``/``_c10d_functional`` ops. A DTensor op is seen once, at the
DTensor level (its local ops run with the mode popped); its outputs are fingerprinted by their
local piece. PyTorch's ``DebugMode`` (torch/utils/_debug_mode) logs the same ops with
``torch.hash_tensor``, as a string per call for one process; this mode keeps, per op, only what the
notebook compares across ranks: op, module path, pass, cell line, each output's shape, dtype and
fingerprint (``torch.hash_tensor`` and a float64 sum, computed on the tensor's device and fetched
in batches: one host sync per ``_FETCH`` ops) with ``SAMPLE`` of its elements (what gives a
divergence its size), the tensor inputs' fingerprints, and which ranks must hold the same output
(numerics_context.py), propagated op by op: an output made only from tensors that must agree must
agree too.

A collective's output is not ready when its op returns (the Work is waited later): it is
fingerprinted when an op first reads it, or at the cell's end. At most ``LIMIT`` ops are kept
(``DISTNB_NUMERICS_OPS``): the record stays bounded on a long cell, and says how many ran.
"""

from __future__ import annotations

import math
import os
import sys
import zlib
from typing import Any, Callable

from distnb.wire.record_types import SAMPLE, TENSORS_READ, CellOutcome, InputRead, NumericsRecord, OpRecord, OutputStats
from distnb.worker.torch_hooks.comms import process_group_of
from distnb.worker.torch_hooks.meshes import describe_meshes
from distnb.worker.torch_hooks.numerics_context import Agree, Context, group_ranks, replicas
from distnb.worker.torch_hooks.numerics_ops import COLL, EMPTY, SCALARS, SKIP, VIEW, OpKind, TensorInfo, fills_memory, intersect, leaves, rng_state

__all__ = ["LIMIT", "run_with_numerics"]

LIMIT = int(os.environ.get("DISTNB_NUMERICS_OPS") or 20000)
_TENSORS = TENSORS_READ
_FETCH = 256  # ops between two fetches of the fingerprints from their devices
_PENDING = 256  # collective outputs kept for a later read; past it the oldest go unread
_ENDS = 4096  # elements at each end of a tensor whose places its fingerprint's order sum weighs
def _mode_class() -> Any:
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    Tensor = torch.Tensor
    current_node = torch._C._current_autograd_node
    are_deterministic = torch.are_deterministic_algorithms_enabled

    class Record(TorchDispatchMode):
        """Fingerprints every op (``collectives``: only the collectives) while it is entered."""

        def __init__(self, namespace: dict[str, Any], collectives: bool, limit: int) -> None:
            super().__init__()
            self.collectives, self.limit = collectives, limit
            self.ctx = Context(namespace, self._mark, self._agree_of)
            self.kinds: dict[Any, OpKind] = {}
            self.tensors: dict[int, TensorInfo] = {}
            self.prune_at = 4096
            self.raw: list[list[Any]] = []
            self.total = 0
            self.unfetched: list[list[Any]] = []
            self.pending: dict[int, tuple[list[Any], bool]] = {}
            #: Tensors the last op wrote in place, whose version is read at the next op: the version
            #: counter is bumped by the ADInplaceOrView kernel *after* this mode's kernel returns, so
            #: read inside it, it is one behind — and every later read looked like a write nobody recorded.
            self.written: list[tuple[TensorInfo, Any]] = []
            self.samples: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # (shape, device) → where _fp samples
            self.weights: dict[Any, Any] = {}  # (device, dtype) → the weights of _order

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            # As torch's DebugMode: without it, torch.compile falls back to eager under this mode
            # (convert_frame's "non-infra torch dispatch mode present"), and a run recorded as
            # "compiled" would be eager. With it, the compiled code runs, and the record holds the
            # ops it still dispatches (extern kernels, collectives) and the ops around it.
            return True

        # -- what is known of a tensor ----------------------------------------------------------
        def _entry(self, t: Any) -> TensorInfo | None:
            e = self.tensors.get(id(t))
            if e is not None and e.ref() is t:
                return e
            inner = getattr(t, "elem", None)  # funcol's AsyncCollectiveTensor, made in Python around an op's output
            e = self.tensors.get(id(inner)) if isinstance(inner, Tensor) else None
            return e if e is not None and e.ref() is inner else None

        def _new(self, t: Any) -> TensorInfo:
            if len(self.tensors) > self.prune_at:
                self.tensors = {k: v for k, v in self.tensors.items() if v.ref() is not None}
                self.prune_at = 2 * len(self.tensors) + 4096
            e = self.tensors[id(t)] = TensorInfo(t)
            if isinstance(t, DTensor):
                e.agree, e.why = replicas(t), "Replicate"
            e.label = self.ctx.param_names.get(id(t))
            return e

        def _mark(self, t: Any, ranks: Agree, why: str, label: str) -> None:
            e = self._entry(t) or self._new(t)
            if e.agree is None:
                e.agree, e.why = ranks, why
            if e.label is None:
                e.label = label

        def _agree_of(self, t: Any) -> Agree | None:
            e = self._entry(t)
            return e.agree if e is not None else (replicas(t) if isinstance(t, DTensor) else None)

        def _fp(self, t: Any) -> list[Any] | None:
            local = t._local_tensor if isinstance(t, DTensor) else t
            try:
                if local.device.type == "meta" or type(local).__name__ == "FakeTensor":
                    return None
                if local.numel() == 0:
                    return [0, 0.0, (), 0, 0.0]
                if local.is_complex():
                    local = torch.view_as_real(local)
                fp = [torch.hash_tensor(local).view(torch.int64), local.sum(dtype=torch.float64),
                      local[self._sample_at(local)].reshape(-1).to(torch.float64, copy=True), local.numel(), self._order(local)]
            except Exception:
                return None
            self.unfetched.append(fp)
            return fp

        def _order(self, t: Any) -> Any:
            """A sum of the elements at each end of ``t`` (``_ENDS`` each, in logical order), each
            weighted by its place: the xor and the sum cannot tell a tensor from a permutation of it
            (``mesh == rank`` on two ranks: one True each), and agreement inferred from equal
            inputs must. One dot product in the tensor's own floating type (two kernels at most:
            every op's outputs pay it)."""
            flat = t.reshape(-1)  # a view where contiguous; a copy only of a strided tensor
            if not flat.is_floating_point():
                flat = flat.to(torch.float32)
            n = flat.numel()
            ends = flat if n <= 2 * _ENDS else torch.cat([flat[:_ENDS], flat[-_ENDS:]])
            key = (flat.device, flat.dtype)
            w = self.weights.get(key)
            if w is None:
                w = self.weights[key] = torch.rand(2 * _ENDS, generator=torch.Generator().manual_seed(0)).add_(1).to(flat.device, flat.dtype)
            return torch.dot(ends, w[:ends.numel()])

        def _sample_at(self, t: Any) -> tuple[Any, ...]:
            """Index tensors that pick ``SAMPLE`` elements spread evenly in ``t``'s logical order
            (every element of a smaller tensor): the same elements on every rank, whatever the
            layout; one gather, no copy of the tensor."""
            key = (tuple(t.shape), t.device)
            at = self.samples.get(key)
            if at is None:
                if len(self.samples) > 1024:
                    self.samples.clear()
                n = t.numel()
                flat = torch.arange(n) if n <= SAMPLE else torch.linspace(0, n - 1, SAMPLE).round().long()
                at = self.samples[key] = tuple(i.to(t.device) for i in torch.unravel_index(flat, t.shape))
            return at

        def _fetch(self) -> None:
            """Every fingerprint still on its device to numbers: one copy per device."""
            todo, self.unfetched = self.unfetched, []
            by_device: dict[Any, list[list[Any]]] = {}
            for fp in todo:
                by_device.setdefault(fp[0].device, []).append(fp)
            for fps in by_device.values():
                try:
                    hashes = torch.stack([f[0] for f in fps]).tolist()
                    sums = torch.stack([f[1] for f in fps]).tolist()
                except Exception:
                    hashes = sums = [None] * len(fps)
                try:
                    flat = torch.cat([f[2] for f in fps]).tolist()
                except Exception:  # the values are a size's detail: the fingerprints stand without them
                    flat = []
                try:
                    orders = torch.stack([f[4].float() for f in fps]).tolist()  # float32 already, mostly: no copy
                except Exception:  # without it, nothing is inferred from these inputs
                    orders = [math.nan] * len(fps)
                at = 0
                for f, h, s, o in zip(fps, hashes, sums, orders):
                    n = f[2].numel() if flat else 0
                    f[0], f[1], f[2], f[4] = h, s, tuple(flat[at:at + n]), o
                    at += n

        def _settle(self, seq: int) -> None:
            """A collective's outputs, read now that an op reads one of them (or the cell ended)."""
            held = self.pending.pop(seq, None)
            if held is None:
                return
            outs, functional = held
            rec = self.raw[seq]
            rec[8] = []
            for t in outs:
                if functional:  # a functional collective's output is ready once waited (what reading it does)
                    torch.ops._c10d_functional.wait_tensor(t)
                e = self._entry(t)
                fp = self._fp(t)
                if e is not None and e.pending == seq:
                    e.pending, e.fp, e.version = -1, fp, t._version
                rec[8].append([tuple(t.shape), str(t.dtype).replace("torch.", ""), fp])

        # -- the op ------------------------------------------------------------------------------
        def _versions(self) -> None:
            """The versions of what the last op wrote in place, now that they are bumped."""
            for e, t in self.written:
                e.version = t._version
            self.written.clear()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if self.written:
                self._versions()
            kind = self.kinds.get(func)
            if kind is None:
                kind = self.kinds[func] = OpKind(func)
            if kind.kind == SKIP or (self.collectives and kind.kind != COLL):
                return func(*args, **kwargs)
            if len(self.raw) >= self.limit:
                self.total += kind.kind != VIEW
                return func(*args, **kwargs)
            if kind.kind in (VIEW, EMPTY):
                out = func(*args, **kwargs)
                self._inherit(args, out, kind.kind == EMPTY)
                return out
            self.total += 1
            seq = len(self.raw)
            read = args[1:] if kind.skip_first else args
            flat_in = leaves((read, {k: v for k, v in kwargs.items() if k not in kind.out_kw}))
            tensors_in = [t for t in flat_in if isinstance(t, Tensor)]
            reads: list[list[Any]] = []
            agrees: list[Agree | None] = []
            blank = 0  # inputs allocated and not written: nothing to read, and no value of theirs to fix
            for k, t in enumerate(tensors_in[:_TENSORS]):
                e = self._entry(t)
                if e is not None and e.pending >= 0:
                    self._settle(e.pending)
                if e is None:
                    e = self._new(t)
                agrees.append(e.agree)
                if e.uninit == t._version:
                    blank += 1
                    continue  # allocated and not written yet (a random op's buffer): its shape is all it gives
                if e.fp is None or e.version != t._version:
                    if e.version != -1 and e.version != t._version:
                        e.producer = -1  # written since by an op not recorded
                    e.fp, e.version = self._fp(t), t._version
                reads.append([k, e.fp, e.agree, e.why, e.label, e.producer])
            digest = zlib.crc32(repr([a if isinstance(a, SCALARS) else str(a) for a in flat_in
                                      if isinstance(a, SCALARS) or isinstance(a, (torch.dtype, torch.device))]).encode())
            module, phase, cell, line = self._where()
            rng = rng_state(kwargs, tensors_in) if kind.random else 0
            out = func(*args, **kwargs)
            outs = [t for t in leaves(out) if isinstance(t, Tensor)]
            for i in kind.written:
                if i < len(args):
                    outs.extend(t for t in leaves(args[i]) if isinstance(t, Tensor) and all(t is not o for o in outs))
            for name in kind.out_kw:
                outs.extend(t for t in leaves(kwargs.get(name)) if isinstance(t, Tensor) and all(t is not o for o in outs))
            if kind.kind == COLL:
                agree = group_ranks(process_group_of(args)) if kind.agreeing else None
                why = func._overloadpacket.__name__.rstrip("_") if agree else ""
            elif outs and isinstance(outs[0], DTensor):
                agree, why = replicas(outs[0]), "Replicate"
            else:
                agree, why = intersect(agrees), "inputs"
            specs: list[list[Any]] | None = None
            if kind.kind == COLL:
                self._hold(seq, outs, agree, why, func.namespace != "c10d")
            else:
                specs = []
                for n, t in enumerate(outs[:_TENSORS]):
                    e = self._entry(t)
                    label = e.label if e is not None else None
                    e = self._new(t)
                    e.agree, e.why, e.label, e.producer, e.version = agree, why or e.why, label, seq, t._version
                    if n >= kind.valued:
                        e.uninit = t._version
                        continue
                    e.fp = self._fp(t)
                    if kind.in_place:
                        self.written.append((e, t))
                    specs.append([tuple(t.shape), str(t.dtype).replace("torch.", ""), e.fp])
            # Whether what was read fixes the outputs: every tensor input read, and equal inputs give
            # equal bits (CPU kernels do; an accelerator's only under use_deterministic_algorithms:
            # cuBLAS split-K, atomics; never a kernel torch tags nondeterministic_bitwise).
            determined = kind.stable and (not outs or outs[0].device.type in ("cpu", "meta") or are_deterministic()) \
                and len(reads) + blank == len(tensors_in) and all(rd[1] is not None for rd in reads)
            self.raw.append([seq, kind.name, module, phase, cell, line, agree, why if agree else "", specs, reads, f"{digest:08x}",
                             kind.random, kind.kind == COLL, determined, rng])
            if len(self.unfetched) >= 2 * _FETCH:
                self._fetch()
            return out

        def _hold(self, seq: int, outs: list[Any], agree: Agree | None, why: str, functional: bool) -> None:
            if len(self.pending) >= _PENDING:
                self.pending.pop(next(iter(self.pending)))  # its output goes unread: never compared
            self.pending[seq] = (outs, functional)
            for t in outs:
                e = self._new(t)
                e.agree, e.why, e.producer, e.pending, e.version = agree, why, seq, seq, t._version
                self.written.append((e, t))  # c10d's collectives write their tensors in place

        def _inherit(self, args: Any, out: Any, empty: bool = False) -> None:
            """A view (or an op that returns its input's value) carries what is known of its input;
            an uninitialised allocation like a tensor (``empty``) carries only which ranks it must agree with."""
            base = args[0] if args and isinstance(args[0], Tensor) else next(
                (t for t in leaves(args) if isinstance(t, Tensor)), None)
            e = self._entry(base) if base is not None else None
            if e is None and base is not None and not empty:
                e = self._new(base)  # a parameter first seen through a view: its name and replicas travel on
            if e is None and not empty:
                return
            for t in (out,) if isinstance(out, Tensor) else leaves(out):
                if isinstance(t, Tensor) and t is not base:
                    v = self._new(t)
                    if e is not None and (not isinstance(t, DTensor) or v.agree is None):
                        v.agree, v.why = e.agree, e.why
                    if empty:
                        v.uninit = t._version
                    elif e is not None:
                        v.label, v.producer, v.pending = e.label, e.producer, e.pending
                        if base is not None and e.fp is not None and e.version == base._version and t.numel() == base.numel() \
                                and t.storage_offset() == base.storage_offset() and fills_memory(t) and fills_memory(base) \
                                and not isinstance(t, DTensor):
                            # the same memory, read in another order or shape (t(), view, detach): the
                            # fingerprint (an xor and a sum) is the base's, not computed again
                            v.fp, v.version = e.fp, t._version

        def _where(self) -> tuple[str, str, int, int]:
            node = current_node()
            if node is not None:
                try:
                    module = str(node.metadata.get("distnb", ""))  # type: ignore[attr-defined]  # a dict on a Node
                except Exception:
                    module = ""
                cell, line = self.ctx.line(sys._getframe(2))
                return module, "bwd", cell, line
            module, phase = self.ctx.module()
            cell, line = self.ctx.line(sys._getframe(2))
            return module, phase, cell, line

        # -- the record ----------------------------------------------------------------------------
        def finish(self) -> NumericsRecord:
            self._versions()
            for seq in list(self.pending):
                self._settle(seq)
            self._fetch()
            ops = []
            for seq, name, module, phase, cell, line, agree, why, specs, reads, digest, random, coll, determined, rng in self.raw:
                outputs = [OutputStats(shape, dtype, int(fp[0]), float(fp[1]), fp[2]) for shape, dtype, fp in specs or []
                           if fp is not None and fp[0] is not None]
                inputs = [InputRead(k, int(fp[0]), float(fp[1]), agree_in, why_in if agree_in else "", label, producer, fp[2], fp[3], fp[4])
                          for k, fp, agree_in, why_in, label, producer in reads if fp is not None and fp[0] is not None]
                ops.append(OpRecord(seq, name, module, phase, cell, line, agree, why, outputs, inputs, digest, random, coll, determined, rng))
            self.tensors.clear()
            return {"mode": "collectives" if self.collectives else "ops", "ops": ops, "total": self.total, "limit": self.limit,
                    "mesh_groups": self._mesh_groups()}

        def _mesh_groups(self) -> dict[str, list[int]]:
            """This rank's group along each named dimension of the meshes the cells hold (for
            ``agree="tp"``): read only where a mesh was made."""
            if "torch.distributed.device_mesh" not in sys.modules:
                return {}
            meshes = describe_meshes(self.ctx.ns)
            groups: dict[str, list[int]] = {}
            for mesh in meshes if isinstance(meshes, list) else []:
                for name, group in mesh["groups"].items():
                    if mesh.get("named") and "ranks" in group:
                        groups.setdefault(name, list(group["ranks"]))
            return groups

    return Record


def run_with_numerics(run: Callable[[], CellOutcome], mode: str, namespace: dict[str, Any]) -> CellOutcome:
    """``run()`` (the cell) under the record; its reply gains ``numerics``."""
    try:
        record = _mode_class()(namespace, mode == "collectives", LIMIT)
    except Exception as exc:  # a torch without what the record reads: the cell still runs
        reply = run()
        reply["numerics"] = {"error": f"the numerics record needs torch.hash_tensor and DTensor ({type(exc).__name__}: {exc})"}
        return reply
    record.ctx.install()
    try:
        with record:
            reply = run()
    finally:
        record.ctx.remove()
    try:
        reply["numerics"] = record.finish()
    except Exception as exc:
        reply["numerics"] = {"error": f"the numerics record failed: {type(exc).__name__}: {exc}"}
    return reply
