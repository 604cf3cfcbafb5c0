"""The signed wire protocol: nothing unsigned is ever unpickled, replays are dropped, and any
garbage a peer sends surfaces as BadFrame and nothing else."""

from __future__ import annotations

import hashlib
import hmac
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distnb import protocol
from distnb.protocol import (
    MAGIC,
    BadFrame,
    Codec,
    Msg,
    ReplayGuard,
    control_identity,
    exec_identity,
    new_key,
    parse_identity,
    supervisor_identity,
)

KEY = b"k" * 32
OTHER_KEY = b"o" * 32

# Unpickling a _Trap runs _side_effect: proof that a body was (or was not) unpickled.
SIDE_EFFECTS: list[str] = []


def _side_effect(tag: str) -> dict:
    SIDE_EFFECTS.append(tag)
    return {"t": "pwned", "_s": "C", "_n": 1}


class _Trap:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __reduce__(self):
        return (_side_effect, (self.tag,))


def sign(key: bytes, body: bytes) -> list[bytes]:
    return [MAGIC, hmac.new(key, body, hashlib.sha256).digest(), body]


@pytest.fixture(autouse=True)
def _clear_side_effects():
    SIDE_EFFECTS.clear()
    yield
    SIDE_EFFECTS.clear()


def test_round_trip_keeps_the_message_and_adds_sender_and_counter():
    tx, rx = Codec(KEY, "x2"), Codec(KEY, "C")
    msg = {"t": Msg.EXEC, "cell": 7, "code": "print('hi')", "blob": b"\x00\xff" * 10, "nested": {"a": [1, 2.5, None]}}
    frames = tx.encode(dict(msg))
    assert len(frames) == 3 and frames[0] == MAGIC and len(frames[1]) == 32
    out = rx.decode(frames, ReplayGuard())
    assert {k: out[k] for k in msg} == msg
    assert out["_s"] == "x2" and isinstance(out["_n"], int)
    assert rx.rejected == 0


def test_counters_increase_so_consecutive_frames_pass_the_guard():
    tx, rx, guard = Codec(KEY, "s0"), Codec(KEY, "C"), ReplayGuard()
    counters = [rx.decode(tx.encode({"t": Msg.PING}), guard)["_n"] for _ in range(50)]
    assert counters == sorted(counters) and len(set(counters)) == 50


def test_recreated_codec_keeps_counting_upwards():
    # A sender that restarts (new codec) must not look like a replay to a long-lived receiver.
    guard, rx = ReplayGuard(), Codec(KEY, "C")
    rx.decode(Codec(KEY, "x0").encode({"t": Msg.PING}), guard)
    rx.decode(Codec(KEY, "x0").encode({"t": Msg.PING}), guard)


def test_wrong_key_is_rejected_counted_and_never_unpickled():
    body = pickle.dumps(_Trap("wrong-key"), protocol=pickle.HIGHEST_PROTOCOL)
    rx = Codec(KEY, "C")
    with pytest.raises(BadFrame, match="signature"):
        rx.decode(sign(OTHER_KEY, body))
    assert rx.rejected == 1
    assert SIDE_EFFECTS == [], "a frame signed with the wrong key was unpickled"
    # Control: the same body with the right key *is* live, so the check above is meaningful.
    assert rx.decode(sign(KEY, body))["t"] == "pwned"
    assert SIDE_EFFECTS == ["wrong-key"]


def test_frame_from_another_pool_is_rejected():
    frames = Codec(new_key(), "x0").encode({"t": Msg.DONE})
    rx = Codec(new_key(), "C")
    with pytest.raises(BadFrame):
        rx.decode(frames)
    assert rx.rejected == 1


def test_tampered_body_is_rejected():
    frames = Codec(KEY, "x0").encode({"t": Msg.DONE, "value": 1})
    body = bytearray(frames[2])
    body[-2] ^= 0x01
    with pytest.raises(BadFrame, match="signature"):
        Codec(KEY, "C").decode([frames[0], frames[1], bytes(body)])


@pytest.mark.parametrize(
    "mangle, match",
    [
        (lambda f: f[:2], "not a distnb frame"),
        (lambda f: f + [b"extra"], "not a distnb frame"),
        (lambda f: [], "not a distnb frame"),
        (lambda f: [b"DNB0", f[1], f[2]], "not a distnb frame"),
        (lambda f: [f[0], f[1][:-1], f[2]], "signature length"),
        (lambda f: [f[0], b"", f[2]], "signature length"),
        (lambda f: [f[0], f[1], f[2][: len(f[2]) // 2]], "bad signature"),
        (lambda f: [f[0], f[1], b""], "bad signature"),
    ],
    ids=["two-frames", "four-frames", "empty", "bad-magic", "short-sig", "no-sig", "truncated-body", "empty-body"],
)
def test_malformed_frames_are_rejected(mangle, match):
    frames = Codec(KEY, "x0").encode({"t": Msg.DONE, "value": "x" * 100})
    rx = Codec(KEY, "C")
    with pytest.raises(BadFrame, match=match):
        rx.decode(mangle(frames))
    assert rx.rejected == 1


@pytest.mark.parametrize(
    "body, match",
    [
        (b"\x80\x05garbage", "undecodable"),
        (pickle.dumps([1, 2, 3]), "not a message"),
        (pickle.dumps({"no_type": 1}), "not a message"),
        (pickle.dumps({"t": "x", "_s": "x0", "_n": "soon"}), "counter"),
        (pickle.dumps({"t": "x", "_s": "x0", "_n": None}), "counter"),
        (pickle.dumps({"t": "x", "_s": "x0", "_n": 1.5}), "counter"),
        (pickle.dumps({"t": "x", "_s": "x0", "_n": True}), "counter"),
    ],
    ids=["garbage", "list", "no-type", "str-counter", "none-counter", "float-counter", "bool-counter"],
)
def test_signed_but_invalid_bodies_are_rejected(body, match):
    rx = Codec(KEY, "C")
    with pytest.raises(BadFrame, match=match):
        rx.decode(sign(KEY, body), ReplayGuard())
    assert rx.rejected == 1


def test_oversized_frame_is_refused_before_checking(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_FRAME_BYTES", 64)
    frames = Codec(KEY, "x0").encode({"t": Msg.OUTPUT, "data": b"x" * 100})
    with pytest.raises(BadFrame, match="exceeds the limit"):
        Codec(KEY, "C").decode(frames)


def test_replayed_frame_is_rejected_by_the_guard():
    tx, rx, guard = Codec(KEY, "x1"), Codec(KEY, "C"), ReplayGuard()
    frames = tx.encode({"t": Msg.DONE, "status": "ok"})
    assert rx.decode(frames, guard)["status"] == "ok"
    with pytest.raises(BadFrame, match="replayed"):
        rx.decode(frames, guard)
    assert rx.rejected == 1
    # Without a guard the same frame decodes (the guard is what stops replays).
    assert rx.decode(frames)["status"] == "ok"


def test_reordered_frames_are_rejected_and_senders_are_independent():
    a, b, rx, guard = Codec(KEY, "x0"), Codec(KEY, "x1"), Codec(KEY, "C"), ReplayGuard()
    first, second = a.encode({"t": "m", "i": 1}), a.encode({"t": "m", "i": 2})
    other = b.encode({"t": "m", "i": 3})
    assert rx.decode(second, guard)["i"] == 2
    with pytest.raises(BadFrame, match="reordered"):
        rx.decode(first, guard)
    assert rx.decode(other, guard)["i"] == 3  # another sender has its own counter


def test_replay_guard_check_and_forget():
    guard = ReplayGuard()
    guard.check("s0", 5)
    with pytest.raises(BadFrame):
        guard.check("s0", 5)
    with pytest.raises(BadFrame):
        guard.check("s0", 4)
    guard.check("s0", 6)
    guard.check("s1", 0)
    guard.forget("s0")
    guard.check("s0", 1)


def test_short_key_is_refused():
    with pytest.raises(ValueError, match="16 bytes"):
        Codec(b"short", "C")
    assert len(new_key()) == 32 and new_key() != new_key()


def test_identities_round_trip():
    for make, kind in ((exec_identity, "x"), (control_identity, "c"), (supervisor_identity, "s")):
        for rank in (0, 7, 1023):
            assert parse_identity(make(rank)) == (kind, rank)


@pytest.mark.parametrize("identity", [b"", b"x", b"y1", b"x-1", b"x1a", b"X1", b"\xff\xfe", b"c 1", b"s" + b"9" * 0 + b"\x00"])
def test_bad_identities_raise_badframe(identity):
    with pytest.raises(BadFrame):
        parse_identity(identity)


# -- fuzzing: whatever arrives, decode returns a message or raises BadFrame ----------------------

_frame = st.binary(max_size=200)
_frames = st.one_of(
    st.lists(_frame, max_size=5),
    st.tuples(st.just(MAGIC), st.binary(min_size=32, max_size=32), _frame).map(list),
    st.tuples(st.sampled_from([MAGIC, b"DNB", b""]), _frame, _frame).map(list),
)
_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=_frames, use_guard=st.booleans())
def test_fuzz_random_frames_only_raise_badframe(frames, use_guard):
    rx = Codec(KEY, "C")
    try:
        msg = rx.decode(frames, ReplayGuard() if use_guard else None)
    except BadFrame:
        assert rx.rejected == 1
    else:  # practically unreachable without the key; if it happens it must be a real message
        assert isinstance(msg, dict) and "t" in msg
    assert SIDE_EFFECTS == []


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=120), use_guard=st.booleans())
def test_fuzz_signed_random_bodies_only_raise_badframe(body, use_guard):
    # Signed with the right key: exercises everything after the signature check.
    rx = Codec(KEY, "C")
    try:
        msg = rx.decode(sign(KEY, body), ReplayGuard() if use_guard else None)
    except BadFrame:
        pass
    else:
        assert isinstance(msg, dict) and "t" in msg


@settings(max_examples=300, deadline=None)
@given(
    msg=st.dictionaries(st.sampled_from(["t", "_s", "_n", "x"]), _values, max_size=4),
    use_guard=st.booleans(),
)
def test_fuzz_signed_dicts_only_raise_badframe(msg, use_guard):
    rx = Codec(KEY, "C")
    try:
        out = rx.decode(sign(KEY, pickle.dumps(msg)), ReplayGuard() if use_guard else None)
    except BadFrame:
        pass
    else:
        assert set(out) == set(msg) and "t" in out
