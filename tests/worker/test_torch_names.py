"""The private names of torch that distnb's hooks read (the table in ``worker/torch_hooks/__init__``),
pinned on the torch this runs on. CI's legs run this on torch 2.11 (the oldest ``pyproject.toml``
accepts), 2.13 (the CPU build) and the newest the index gives (2.15.0 today): a name torch moves or
drops fails here, in the fast subset, before a hook quietly degrades to its sentence in a user's
notebook. Names torch has only in some builds say so."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

#: hook → (module, attribute path) it reads.
NAMES: list[tuple[str, str, str]] = [
    ("call_log, group_state", "torch.distributed.distributed_c10d", "_world"),
    ("call_log", "torch.distributed.distributed_c10d", "_rank_not_in_group"),
    ("call_log, group_abort, regroup", "torch.distributed.distributed_c10d", "_get_default_store"),
    ("group_abort", "torch.distributed.distributed_c10d", "_abort_process_group"),
    ("gloo_unblock", "torch.distributed.distributed_c10d", "_unregister_all_process_groups"),
    ("regroup", "torch.distributed.distributed_c10d", "_update_default_pg"),
    ("the rank's later groups' timeout", "torch.distributed.distributed_c10d", "default_pg_timeout"),
    ("flight_recorder", "torch._C._distributed_c10d", "_dump_fr_trace"),
    ("flight_recorder, group_state", "torch.distributed", "ProcessGroup._get_sequence_number_for_group"),
    ("comms", "torch.distributed", "ProcessGroup.unbox"),
    ("meshes", "torch.distributed.device_mesh", "DeviceMesh"),
    ("comms", "torch.distributed.tensor.debug", "CommDebugMode"),
    ("comms", "torch.distributed.tensor._redistribute", "redistribute_local_tensor"),
    ("numerics", "torch._C", "_current_autograd_node"),
    ("numerics", "torch.distributed._functional_collectives", "AsyncCollectiveTensor"),
]


@pytest.mark.parametrize("hook, module, path", NAMES, ids=[f"{m}.{p}" for _, m, p in NAMES])
def test_each_name_a_hook_reads_is_in_this_torch(hook: str, module: str, path: str) -> None:
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(obj, part), f"torch {torch.__version__} has no {module}.{path}, which {hook} reads"
        obj = getattr(obj, part)


def test_the_world_holds_what_the_hooks_read() -> None:
    world = dist.distributed_c10d._world
    for attr in ("pg_names", "default_pg", "group_count", "pg_map"):
        assert hasattr(world, attr), f"torch {torch.__version__}'s _world has no {attr}"


def test_the_nccl_flight_recorders_dump_where_nccl_is_built() -> None:
    """``_dump_nccl_trace`` exists only in builds with NCCL (flight_recorder reads it on NCCL up
    to 2.12, ``_dump_fr_trace`` after)."""
    if not dist.is_nccl_available():
        pytest.skip(f"torch {torch.__version__} is built without NCCL")
    assert hasattr(torch._C._distributed_c10d, "_dump_nccl_trace"), f"torch {torch.__version__} has NCCL but no _dump_nccl_trace"


def test_the_compile_records_counters_are_where_compile_record_reads_them() -> None:
    """Read from the source, not imported: importing torch._dynamo takes seconds, and
    compile_record itself reads it only from ``sys.modules`` (a rank that never compiles pays nothing)."""
    spec = importlib.util.find_spec("torch._dynamo.utils")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    for name in ("counters", "_compilation_metrics"):
        assert re.search(rf"^{name}\b", source, re.M), f"torch {torch.__version__}'s torch._dynamo.utils defines no {name}"
