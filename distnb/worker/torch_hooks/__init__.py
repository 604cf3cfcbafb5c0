"""Every place the rank side reads or wraps PyTorch beyond its public API, in one room.

torch's private names move between releases; keeping every use here means a new torch is checked
against one folder, and each module degrades to a sentence in the notebook when what it reads is
missing, never to a failing cell. distnb accepts ``torch>=2.11,<3``; CI runs the whole suite on
the newest torch the index gives (2.15.0, Python 3.11), the fast subset with the core end-to-end
tests on torch 2.11, and the fast subset on torch 2.13's CPU build and on 2.15 under Python 3.12
and 3.13. ``tests/worker/test_torch_names.py`` pins every name below in each of those (present on
2.11, 2.13 and 2.15; ``_dump_nccl_trace`` only in builds with NCCL).

==================  =====================================================  =============================================
module              what it reads from torch                               without it
==================  =====================================================  =============================================
call_log            wraps ``torch.distributed``'s collectives, p2p and     no call sites or arguments: verdicts name the
                    ``new_group``; ``distributed_c10d._world``             op and group only
                    (``pg_names``, ``default_pg``, ``group_count``),       a call torch skipped on a rank outside its
                    ``_rank_not_in_group``; ``_get_default_store``         group is not named as such; --profile's ranks
                    (c10d_groups, for --profile's start)                   start the cell unaligned, and say so
flight_recorder     ``torch._C._distributed_c10d._dump_fr_trace`` (gloo    "no Flight Recorder could be read": the
                    and NCCL ≥ 2.13), ``_dump_nccl_trace`` (NCCL ≤ 2.12),  collective views and hang verdicts say so
                    ``ProcessGroup._get_sequence_number_for_group``
group_state         ``_world.pg_map``, ``_world.group_count``,             no end-of-cell desync check (None)
                    ``_get_sequence_number_for_group``, NCCL backends'
                    ``get_error``
group_abort         ``distributed_c10d._abort_process_group``,             the interrupt or %dist_regroup says what
gloo_unblock        ``_unregister_all_process_groups``,                    failed; %dist_restart (new processes) still
regroup             ``_update_default_pg``, ``_get_default_store``         works
gloo_idle           ``init_process_group``'s ``backend`` argument;         gloo threads stay at the default timer slack
                    gloo's loop thread by its name ``gloo_tcp_loop``       (before 2.12, when gloo leaves it unnamed:
                    (≥ 2.12); ``device_mesh``'s own ``new_group``          found as the threads a group's creation started)
pasted              ``init_process_group``/``destroy_process_group``       a pasted init runs for real and fails
patching            the functions' homes in ``torch.distributed``          (used by the above)
meshes              ``torch.distributed.device_mesh.DeviceMesh``           %dist_mesh: "no device mesh"
compile_record      ``torch._dynamo.utils.counters``,                      %%on_ranks --paths: no compile notes
                    ``_compilation_metrics``
comms               ``torch.distributed.tensor.debug.CommDebugMode``,      --comms: "this torch has no CommDebugMode"
                    DTensor's ``_redistribute``, ``ProcessGroup.unbox``
numerics            ``torch._C._current_autograd_node``, a DTensor's       --numerics: "the numerics record needs …"
numerics_context    ``_spec``/``_local_tensor``, ``Tensor._version``,      (no module names in the backward when the
numerics_ops        an op's ``_schema``, ``_overloadpacket`` and tags,
                    funcol's ``AsyncCollectiveTensor.elem``, autograd      metadata is missing: "")
                    ``Node.metadata``
==================  =====================================================  =============================================
"""
