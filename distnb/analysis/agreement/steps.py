"""Training loops seen through their collectives: the repeating pattern of one step (DDP: one
all_reduce per bucket; FSDP: all_gathers then reduce_scatters), and how many steps each rank ran."""

from __future__ import annotations

__all__ = ["step_pattern", "uneven_steps"]


def step_pattern(ops: list[str]) -> list[str] | None:
    """The shortest op sequence that ``ops`` repeats at least twice (a last step may be partial)."""
    for period in range(1, len(ops) // 2 + 1):
        if all(ops[i] == ops[i % period] for i in range(len(ops))):
            return ops[:period]
    return None


def uneven_steps(ahead: list[str], behind: list[str]) -> tuple[list[str], int, int] | None:
    """``(step, steps ahead, steps behind)`` when ``behind`` (a rank's ops in the cell, all done)
    stopped at a step boundary that ``ahead`` (a rank now waiting in its next op) went past: a
    loop that ran fewer times on one rank. ``ahead`` includes the op it waits in. Ops before the
    loop (a broadcast of the initial weights, say) may precede it on both."""
    if not behind or ahead[: len(behind)] != behind:
        return None
    # The loop starts where the ops begin to repeat (the first such place: a later one would
    # cut a step in two).
    start = next((i for i in range(len(behind)) if step_pattern(ahead[i:]) is not None), None)
    if start is None:
        return None
    step = step_pattern(ahead[start:])
    assert step is not None
    if (len(behind) - start) % len(step):
        return None
    return step, -(-(len(ahead) - start) // len(step)), (len(behind) - start) // len(step)
