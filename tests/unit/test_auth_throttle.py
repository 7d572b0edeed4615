"""AuthThrottle: the doubling delay after failed authentications, the lockout, and its bounded memory."""

from __future__ import annotations

import pytest

from openvsan.protocol.auth_throttle import AuthThrottle, Verdict

KEY = ("iqn.2026-11.org.example:guesser", "192.0.2.7")
OTHER = ("iqn.2026-11.org.example:honest", "192.0.2.7")


def test_a_fresh_key_is_answered_at_once() -> None:
    t = AuthThrottle()
    v = t.check(KEY, 0.0)
    assert v == Verdict() and not v.locked and v.delay == 0


def test_the_delay_doubles_from_the_base_to_the_cap() -> None:
    t = AuthThrottle(delay_base=0.25, delay_max=8.0, lockout_failures=0)
    delays = []
    for i in range(9):
        t.failed(KEY, float(i))
        delays.append(t.check(KEY, float(i)).delay)
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert not t.check(KEY, 9.0).locked   # lockout_failures = 0: never locked out
    assert t.check(OTHER, 9.0).delay == 0  # another initiator from the same address is not held


def test_failed_returns_what_the_next_attempt_gets() -> None:
    t = AuthThrottle(delay_base=1.0, delay_max=3.0, lockout_failures=0)
    assert t.failed(KEY, 0).delay == 1.0
    assert t.failed(KEY, 0).delay == 2.0
    assert t.failed(KEY, 0).delay == 3.0
    assert t.failed(KEY, 0).failures == 4


def test_lockout_after_n_failures_then_it_ends() -> None:
    t = AuthThrottle(lockout_failures=3, lockout_seconds=60)
    assert not t.failed(KEY, 0).started_lockout
    assert not t.failed(KEY, 1).started_lockout
    third = t.failed(KEY, 2)
    assert third.started_lockout and third.locked and third.locked_for == 60
    v = t.check(KEY, 30)
    assert v.locked and v.locked_for == pytest.approx(32) and v.delay == 0
    # a failure finishing while locked (begun on another connection) neither extends nor re-announces it
    again = t.failed(KEY, 31)
    assert again.locked and not again.started_lockout and t.check(KEY, 61).locked
    assert not t.check(OTHER, 30).locked
    after = t.check(KEY, 62.5)
    assert not after.locked and after.delay == 0 and after.failures == 0   # a new round starts afresh


def test_success_resets_the_count() -> None:
    t = AuthThrottle(lockout_failures=3)
    t.failed(KEY, 0)
    t.failed(KEY, 0)
    t.succeeded(KEY)
    assert t.check(KEY, 0) == Verdict()
    t.failed(KEY, 0)
    t.failed(KEY, 0)
    assert not t.check(KEY, 0).locked   # two in a row, not four: the success broke the run


def test_old_failures_are_forgotten() -> None:
    t = AuthThrottle(forget_after=100, lockout_seconds=10)
    t.failed(KEY, 0)
    assert t.check(KEY, 99).delay > 0
    assert t.check(KEY, 101) == Verdict()
    assert len(t) == 0


def test_a_flood_of_names_is_bounded_and_keeps_the_locked_out() -> None:
    t = AuthThrottle(lockout_failures=2, lockout_seconds=300, max_entries=100)
    t.failed(KEY, 0)
    t.failed(KEY, 0)
    assert t.check(KEY, 1).locked
    for i in range(10_000):
        t.failed((f"iqn.2026-11.org.example:random{i}", "192.0.2.7"), 1 + i / 1000)
        assert len(t) <= 100
    assert t.check(KEY, 12).locked, "a flood of made-up names pushed the locked-out key out"


def test_zero_delay_max_means_no_delay() -> None:
    t = AuthThrottle(delay_max=0, lockout_failures=0)
    t.failed(KEY, 0)
    assert t.check(KEY, 0).delay == 0


def test_negative_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        AuthThrottle(lockout_seconds=-1)


# --- the iSCSI login machine with a throttle (protocol/iscsi/login.py) --------------------------------------

def _chap_attempt(throttle: AuthThrottle, clock: list[float], secret: str, *, initiator: str = "iqn.2026-11.org"
                  ".example:guesser", user: str = "alice", address: str = "192.0.2.7"):
    """One CHAP login up to the verdict on CHAP_R; returns the LoginResult of the last request sent."""
    import hashlib

    from test_iscsi_login import IQN, FakeTarget, login_pdu

    from openvsan.frontend.config import ChapCredential
    from openvsan.protocol.iscsi.keys import parse_text
    from openvsan.protocol.iscsi.login import LoginMachine

    t = FakeTarget(chap=ChapCredential("alice", "secretsecret12"))
    m = LoginMachine(lambda n: t if n == IQN else None, lambda st: 5, throttle=throttle, address=address,
                     clock=lambda: clock[0])
    r = m.receive(login_pdu(0, 1, False, [("InitiatorName", initiator), ("TargetName", IQN),
                                          ("AuthMethod", "CHAP,None")]))
    if r.failed:
        return r
    r = m.receive(login_pdu(0, 1, False, [("CHAP_A", "7")]))
    a = dict(parse_text(r.response[1]))
    resp = hashlib.sha256(bytes([int(a["CHAP_I"])]) + secret.encode() + bytes.fromhex(a["CHAP_C"][2:])).hexdigest()
    return m.receive(login_pdu(0, 1, True, [("CHAP_N", user), ("CHAP_R", "0x" + resp)]))


def _status(r) -> tuple[int, int]:
    return r.response[0][36], r.response[0][37]


def test_login_holds_answers_after_failures_and_locks_out() -> None:
    throttle = AuthThrottle(delay_base=0.25, delay_max=1.0, lockout_failures=4, lockout_seconds=60)
    clock = [100.0]
    first = _chap_attempt(throttle, clock, "wrongwrongwrong")
    assert first.failed and _status(first) == (2, 1) and first.delay == 0
    # the log line names the CHAP user, the initiator and the address; never a secret
    assert "CHAP user alice" in first.reason and "iqn.2026-11.org.example:guesser" in first.reason
    assert "192.0.2.7" in first.reason and "secretsecret12" not in first.reason and "wrong" not in first.reason
    assert [_chap_attempt(throttle, clock, "wrongwrongwrong").delay for _ in range(2)] == [0.25, 0.5]
    fourth = _chap_attempt(throttle, clock, "wrongwrongwrong", user="mallory")
    assert fourth.delay == 1.0 and "CHAP user mallory" in fourth.reason and "unknown CHAP user" in fourth.reason
    assert fourth.notice and "locked out for 60 s" in fourth.notice   # logged once, as it begins
    # locked out: even the right secret fails at once, before any challenge is made
    locked = _chap_attempt(throttle, clock, "secretsecret12")
    assert locked.failed and _status(locked) == (2, 1) and locked.delay == 0 and locked.quiet
    assert len(locked.response) == 1 and not locked.notice
    # another initiator from the same address is not held
    other = _chap_attempt(throttle, clock, "secretsecret12", initiator="iqn.2026-11.org.example:honest")
    assert not other.failed and other.delay == 0
    clock[0] += 61
    ok = _chap_attempt(throttle, clock, "secretsecret12")
    assert not ok.failed and _status(ok) == (0, 0) and ok.delay == 0
    # a success forgets the failures: the next wrong answer is the first again
    assert _chap_attempt(throttle, clock, "wrongwrongwrong").delay == 0


def test_a_right_answer_after_wrong_ones_is_held_too() -> None:
    throttle = AuthThrottle(delay_base=0.5, lockout_failures=0)
    clock = [0.0]
    _chap_attempt(throttle, clock, "wrongwrongwrong")
    ok = _chap_attempt(throttle, clock, "secretsecret12")
    assert not ok.failed and ok.delay == 0.5   # the delay tells a guesser nothing about the answer
    assert len(throttle) == 0
