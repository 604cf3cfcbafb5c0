"""The direct path's check (distnb/worker/quiet.py): a rank and its supervisor share a counter that
the supervisor moves around every read of the rank's pipes."""

from __future__ import annotations

import os

from distnb.worker.process.quiet import QuietCheck, ReadFence


def _pair() -> tuple[ReadFence, QuietCheck, list[tuple[int, int]]]:
    pipes = [os.pipe() for _ in range(3)]
    fence = ReadFence()
    # The rank maps the fence through its own descriptor (inherited across exec in real use).
    check = QuietCheck(os.dup(fence.fd), tuple(w for _, w in pipes))
    return fence, check, pipes


def _close(fence: ReadFence, pipes: list[tuple[int, int]]) -> None:
    fence.close()
    for r, w in pipes:
        os.close(r)
        os.close(w)


def test_a_cell_that_wrote_nothing_is_quiet() -> None:
    fence, check, pipes = _pair()
    mark = check.mark()
    assert mark is not None and check.quiet_since(mark)
    _close(fence, pipes)


def test_unread_output_in_any_pipe_is_not_quiet() -> None:
    for i in range(3):
        fence, check, pipes = _pair()
        mark = check.mark()
        os.write(pipes[i][1], b"x")
        assert not check.quiet_since(mark), f"pipe {i}"
        os.read(pipes[i][0], 1)  # read without the fence: only a bug in the supervisor would
        assert check.quiet_since(mark)
        _close(fence, pipes)


def test_output_the_supervisor_read_or_is_reading_is_not_quiet() -> None:
    fence, check, pipes = _pair()
    mark = check.mark()
    os.write(pipes[0][1], b"out")
    fence.enter()
    os.read(pipes[0][0], 3)  # taken out of the pipe, not yet forwarded
    assert not check.quiet_since(mark)
    fence.leave()  # forwarded: still not quiet, the cell's output went the ordered way
    assert not check.quiet_since(mark)
    assert check.quiet_since(check.mark())  # the next cell starts afresh
    _close(fence, pipes)


def test_a_cell_that_began_during_a_read_is_never_quiet() -> None:
    fence, check, pipes = _pair()
    fence.enter()
    mark = check.mark()
    fence.leave()
    fence.enter()  # an odd counter again at the end: equal, and still not to be trusted
    assert not check.quiet_since(mark)
    _close(fence, pipes)


def test_without_a_fence_or_with_a_closed_pipe_the_ordered_path_is_kept() -> None:
    r, w = os.pipe()
    bare = QuietCheck(None, (w,))
    assert bare.mark() is None and not bare.quiet_since(bare.mark())
    fence = ReadFence()
    check = QuietCheck(os.dup(fence.fd), (w,))
    mark = check.mark()
    os.close(w)
    assert not check.quiet_since(mark)
    os.close(r)
    fence.close()


def test_the_supervisor_keeps_only_the_mapping_once_the_rank_has_the_descriptor() -> None:
    """Its copy of the memfd is closed after the spawn: a later close() must not close a number
    that has since been reused (a spare's pipe, say)."""
    fence = ReadFence()
    check = QuietCheck(os.dup(fence.fd), ())
    fence.passed()
    assert fence.fd == -1
    reused_r, reused_w = os.pipe()
    mark = check.mark()
    fence.enter()
    fence.leave()
    assert check.mark() == mark + 2  # the shared page still works without the descriptor
    fence.close()
    os.write(reused_w, b"still open")
    assert os.read(reused_r, 10) == b"still open"
    os.close(reused_r)
    os.close(reused_w)
