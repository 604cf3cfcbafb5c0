"""Where an op of ``--numerics`` runs: the module path, the pass, the notebook line, and which
ranks must hold the same values as this one (worker/torch_hooks/numerics.py records the ops).

Module paths come from torch's global module hooks (``register_module_forward_pre_hook`` and
``register_module_forward_hook``, public); a backward op takes its forward's module and line from
the autograd node that runs it (``torch._C._current_autograd_node``, where the forward left them in
the node's ``metadata``). The optimizer's step is seen through torch's global step hooks.

Which ranks must agree, as torch's own objects promise it:
  * a ``DistributedDataParallel`` module's parameters and buffers: over its process group (DDP
    makes replicas; its buffers are said to agree only as replicas should, see ``why``);
  * a parameter's gradient and optimizer state at the step: as the parameter;
  * a DTensor: over the mesh dimensions it is ``Replicate()`` on.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from distnb.wire.cell_code import CELL_PREFIX

__all__ = ["Context", "group_ranks", "replicas"]

Agree = tuple[int, ...]


def group_ranks(pg: Any) -> Agree | None:
    """The global ranks of a process group (None for a group of one, or unknown)."""
    import torch.distributed as dist

    try:
        ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
    except Exception:
        return None
    return ranks if len(ranks) > 1 else None


_replica_cache: dict[tuple[int, str], Agree | None] = {}


def replicas(dt: Any) -> Agree | None:
    """The ranks holding the same local tensor as this rank for a DTensor: those whose mesh
    coordinates equal this rank's on every dimension the tensor is not ``Replicate()`` on."""
    spec = getattr(dt, "_spec", None)
    if spec is None:
        return None
    mesh, placements = spec.mesh, tuple(spec.placements)
    key = (id(mesh), repr(placements))
    if key in _replica_cache:
        return _replica_cache[key]
    found: Agree | None = None
    try:
        coord = mesh.get_coordinate()
        if coord is not None and any(p.is_replicate() for p in placements):
            index = tuple(slice(None) if p.is_replicate() else c for p, c in zip(placements, coord))
            ranks = tuple(sorted(int(r) for r in mesh.mesh[index].flatten().tolist()))
            found = ranks if len(ranks) > 1 else None
    except Exception:
        found = None
    _replica_cache[key] = found
    return found


def _tag_nodes(value: Any, name: str, walk: bool) -> None:
    """Name the module in the ``metadata`` of the autograd nodes it made, so its backward ops are
    told as its own: from its outputs' nodes back to nodes already named (an inner module's, or
    its inputs', named when it was entered)."""
    from torch.utils._pytree import tree_flatten

    todo = [t.grad_fn for t in tree_flatten(value)[0] if getattr(t, "grad_fn", None) is not None]
    seen = 0
    while todo and seen < 100_000:
        node = todo.pop()
        seen += 1
        try:
            meta = node.metadata
        except Exception:
            continue
        if "distnb" in meta:
            continue
        meta["distnb"] = name
        if walk:
            todo.extend(n for n, _ in node.next_functions if n is not None)


class Context:
    """The module stack, the optimizer's step and the marks, for one cell under the record."""

    def __init__(self, namespace: dict[str, Any], mark: Callable[[Any, Agree, str, str], None],
                 agree_of: Callable[[Any], Agree | None]) -> None:
        self.ns = namespace
        self.mark = mark  # (tensor, ranks, why, label)
        self.agree_of = agree_of  # what the record knows of a tensor's ranks
        self.names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.stack: list[str] = []
        self.step = ""  # "optimizer step (Adam)" while one runs
        self.param_names: dict[int, str] = {}
        self.codes: dict[Any, int] = {}  # code object → its cell number (0: not a cell's)
        self._handles: list[Any] = []

    # -- hooks ----------------------------------------------------------------------------------
    def install(self) -> None:
        import torch.nn.modules.module as mm
        import torch.optim.optimizer as oo

        self._handles = [mm.register_module_forward_pre_hook(self._enter),
                         mm.register_module_forward_hook(self._leave, always_call=True),
                         oo.register_optimizer_step_pre_hook(self._step_pre),
                         oo.register_optimizer_step_post_hook(self._step_post)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _root_name(self, module: Any) -> str:
        for k, v in self.ns.items():
            if v is module and not k.startswith("_"):
                return k
        return type(module).__name__

    def _enter(self, module: Any, args: Any) -> None:
        if _compiling():
            return  # traced by torch.compile: its graph has no place for the bookkeeping below (see _compiling)
        name = self.names.get(module)
        if name is None:
            name = self._root_name(module) if not self.stack else f"{self.stack[-1]}.{type(module).__name__}"
            try:
                for sub, m in module.named_modules(prefix=name):
                    self.names.setdefault(m, sub)
                for pname, p in module.named_parameters(prefix=name):
                    self.param_names.setdefault(id(p), pname)
            except Exception:
                self.names[module] = name
        _tag_nodes(args, self.stack[-1] if self.stack else "", walk=False)  # the module's inputs: where its graph starts
        self.stack.append(name)
        self._mark_ddp(module, name)

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        if self.stack and not _compiling():
            _tag_nodes(output, self.stack.pop(), walk=True)

    def _mark_ddp(self, module: Any, name: str) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(module, DistributedDataParallel):
            return
        ranks = group_ranks(module.process_group)
        if ranks is None:
            return
        for pname, p in module.module.named_parameters(prefix=f"{name}.module"):
            self.mark(p, ranks, "DDP", pname)
        how = "DDP buffer" if module.broadcast_buffers else "DDP buffer, not broadcast"
        for bname, b in module.module.named_buffers(prefix=f"{name}.module"):
            self.mark(b, ranks, how, f"buffer {bname}")

    def _step_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.step = f"optimizer step ({type(opt).__name__})"
        for group in opt.param_groups:
            for p in group["params"]:
                ranks = self.agree_of(p)
                if ranks is None:
                    continue
                name = self.param_names.get(id(p), "a parameter")
                if p.grad is not None:
                    self.mark(p.grad, ranks, "gradient", f"{name}.grad")
                for key, value in opt.state.get(p, {}).items():
                    if hasattr(value, "shape"):
                        self.mark(value, ranks, "optimizer state", f"optimizer state {key!r} of {name}")

    def _step_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.step = ""

    # -- where an op is ---------------------------------------------------------------------------
    def module(self) -> tuple[str, str]:
        """(module path, pass) for a forward op or one outside any module."""
        if self.step:
            return self.step, "step"
        return (self.stack[-1], "fwd") if self.stack else ("", "")

    def line(self, frame: Any) -> tuple[int, int]:
        """(cell, line) of the outermost notebook frame above ``frame`` — the cell's own line, even
        inside a function an earlier cell defined; (0, 0) when none."""
        codes = self.codes
        found = (0, 0)
        while frame is not None:
            code = frame.f_code
            cell = codes.get(code)
            if cell is None:
                name = code.co_filename
                cell = codes[code] = int(name[len(CELL_PREFIX):-1]) if name.startswith(CELL_PREFIX) and name[-1] == ">" and \
                    name[len(CELL_PREFIX):-1].isdigit() else 0
            if cell:
                found = (cell, frame.f_lineno)
            frame = frame.f_back
        return found


def _compiling() -> bool:
    """Whether torch.compile is tracing the caller. Global module hooks are inlined into a compiled
    module's graph; the module names, weak references and autograd nodes they keep cannot be
    (dynamo fails, "already tracked for mutation"). Under compilation they do nothing: the ops of
    a compiled region are not seen one by one anyway (numerics.py: ignore_compile_internals)."""
    import torch

    return bool(torch.compiler.is_compiling())
