"""Failed CHAP logins are throttled (protocol/auth_throttle.py), seen from libiscsi against a real `vsan serve`.

After a wrong CHAP response, further attempts from that (initiator name, address) are answered late, the delay
doubling up to [node] auth_delay_max; after auth_lockout_failures failures in a row the pair is refused at once
(Login status 0x0201), even with the right secret, for auth_lockout_seconds. Other initiators are not held.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_auth import SECRET, USER
from vsan_harness import TEST_INITIATOR, VsanServer, require_tools, run

pytestmark = pytest.mark.interop

GUESSER = "iqn.2026-11.org.openvsan.test:guesser"
DELAY_MAX, FAILURES, LOCKOUT = 2.0, 5, 6
# what the n-th wrong attempt waits for (n from 1): nothing, then 0.25 s doubling per failure, capped
EXPECTED = [0.0, 0.25, 0.5, 1.0, 2.0]


def attempt(server: VsanServer, initiator: str, secret: str, user: str = USER) -> tuple[int, float]:
    """One login and READ CAPACITY(16) with these credentials: (exit status, seconds it took)."""
    start = time.monotonic()
    rc = run(["iscsi-readcapacity16", "-i", initiator, "-s", server.url(user=user, secret=secret)],
             check=False, timeout=60).returncode
    return rc, time.monotonic() - start


def throttled_server(vsan: Callable[..., VsanServer]) -> VsanServer:
    server = vsan(chap=(USER, SECRET), start=False)
    text = server.config.read_text()
    server.config.write_text(text.replace('name = "test-node"\n', f'name = "test-node"\nauth_delay_max = {DELAY_MAX}\n'
                                          f"auth_lockout_failures = {FAILURES}\nauth_lockout_seconds = {LOCKOUT}\n", 1))
    server.start()
    return server


def test_wrong_chap_answers_are_delayed_then_locked_out(vsan: Callable[..., VsanServer]) -> None:
    require_tools("iscsi-readcapacity16")
    server = throttled_server(vsan)
    took = []
    for n, expected in enumerate(EXPECTED, 1):
        user = "mallory" if n == 3 else USER   # a wrong user name counts like a wrong secret
        with ThreadPoolExecutor(1) as pool:
            guess = pool.submit(attempt, server, GUESSER, "not-the-secret-1", user)
            if n == len(EXPECTED):
                # while the guesser's answer is held (2 s), the target serves others: the delay holds one
                # login response, not the event loop; another initiator from the same address is not held
                time.sleep(0.3)
                rc, other = attempt(server, TEST_INITIATOR, SECRET)
                assert rc == 0 and other < 1.0, f"an honest initiator was held {other:.2f} s (or refused: rc {rc})"
                assert not guess.done(), "the guesser was answered before its delay"
            rc, seconds = guess.result()
        assert rc != 0, f"wrong CHAP attempt {n} logged in"
        assert seconds >= expected, f"wrong attempt {n} was answered after {seconds:.2f} s, before its {expected} s"
        took.append(seconds)
    locked_at = time.monotonic()
    # the delays grew as they doubled: the fifth waited at least the fourth's 1 s more than the first
    assert took[4] - took[0] >= 1.9, took
    # locked out: the right secret is refused too, at once (not held: it is not evaluated)
    for _ in range(3):
        rc, seconds = attempt(server, GUESSER, SECRET)
        assert rc != 0, "a locked-out initiator logged in with the right secret"
        assert seconds < DELAY_MAX, f"a locked-out login took {seconds:.2f} s; it should fail at once"
    assert attempt(server, TEST_INITIATOR, SECRET)[0] == 0, "the lockout shut out another initiator"
    # the lockout ends by itself; then the right secret logs in, at once, and the count starts afresh
    time.sleep(max(0.0, LOCKOUT + 0.5 - (time.monotonic() - locked_at)))
    rc, seconds = attempt(server, GUESSER, SECRET)
    assert rc == 0, f"the lockout did not end after {LOCKOUT} s:\n{server.log_tail()}"
    assert seconds < DELAY_MAX

    log = server.log_text()
    failed = [line for line in log.splitlines() if "login failed" in line and GUESSER in line]
    assert len(failed) >= FAILURES, log
    # each failure names the CHAP user, the initiator and its address; no secret is ever logged
    assert any(f"CHAP user {USER}, initiator {GUESSER} at 127.0.0.1" in line for line in failed), failed
    assert any("CHAP user mallory" in line and "unknown CHAP user" in line for line in failed), failed
    assert SECRET not in log and "not-the-secret-1" not in log
    # the lockout is announced once, as a warning, however many logins it refuses
    lockouts = [line for line in log.splitlines() if re.search(r"WARNING.*locked out for \d+ s after", line)]
    assert len(lockouts) == 1 and GUESSER in lockouts[0] and "127.0.0.1" in lockouts[0], lockouts


def test_lockout_off_still_delays(vsan: Callable[..., VsanServer]) -> None:
    """auth_lockout_failures = 0: never locked out, but every guess after the first is still answered late."""
    require_tools("iscsi-readcapacity16")
    server = vsan(chap=(USER, SECRET), start=False)
    text = server.config.read_text()
    server.config.write_text(text.replace('name = "test-node"\n', 'name = "test-node"\nauth_delay_max = 0.5\n'
                                          "auth_lockout_failures = 0\n", 1))
    server.start()
    for n in range(1, 8):
        rc, seconds = attempt(server, GUESSER, "not-the-secret-1")
        assert rc != 0
        assert seconds >= (0.0 if n == 1 else 0.25), (n, seconds)
    rc, seconds = attempt(server, GUESSER, SECRET)
    assert rc == 0 and seconds >= 0.5, "the right secret after 7 failures was refused, or answered without delay"
