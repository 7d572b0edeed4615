"""The login phase of one connection as a state machine (RFC 7143 §6.3, §11.12, §11.13).

Login requests go in; login responses come out. The machine knows nothing of sockets or sessions: the
caller gives it a way to look targets up and a way to admit the finished login into a session (which picks
the TSIH and handles reinstatement), and sends what it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from openvsan.protocol.auth_throttle import AuthThrottle
from openvsan.protocol.iscsi import pdu as P
from openvsan.protocol.iscsi.chap import ChapAuthenticator, ChapError
from openvsan.protocol.iscsi.keys import (
    DECLARED_BY_INITIATOR,
    TARGET_ONLY,
    Params,
    TextError,
    encode_text,
    negotiate_key,
    parse_text,
)

VERSION = 0x00          # RFC 7143 §11.12.4: the only version there is
CMD_WINDOW = 128        # commands the initiator may have queued beyond ExpCmdSN
MAX_LOGIN_TEXT = 65536  # a login's text may span PDUs (C bit); this bounds what we hold
MAX_LOGGED_NAME = 224   # characters of an initiator-chosen name (CHAP_N, InitiatorName) put in a log line


def printable(name: str) -> str:
    """A name the initiator chose, fit for one log line: quoted and escaped when it is not plain text."""
    name = name[:MAX_LOGGED_NAME] + ("..." if len(name) > MAX_LOGGED_NAME else "")
    return name if name.isprintable() and name and " " not in name else repr(name)


class Stage(IntEnum):
    SECURITY = 0
    OPERATIONAL = 1
    FULL_FEATURE = 3


class Status:
    """Login status class/detail, RFC 7143 §11.13.5."""

    SUCCESS = (0, 0)
    INITIATOR_ERROR = (2, 0)
    AUTH_FAILURE = (2, 1)
    AUTHORIZATION_FAILURE = (2, 2)
    NOT_FOUND = (2, 3)
    TARGET_REMOVED = (2, 4)
    UNSUPPORTED_VERSION = (2, 5)
    TOO_MANY_CONNECTIONS = (2, 6)
    MISSING_PARAMETER = (2, 7)
    CANT_INCLUDE_IN_SESSION = (2, 8)
    SESSION_TYPE_NOT_SUPPORTED = (2, 9)
    SESSION_DOES_NOT_EXIST = (2, 10)
    INVALID_DURING_LOGIN = (2, 11)
    TARGET_ERROR = (3, 0)
    SERVICE_UNAVAILABLE = (3, 1)
    OUT_OF_RESOURCES = (3, 2)


class TargetInfo(Protocol):
    iqn: str
    allowed_initiators: list[str] | None
    alias: str | None
    portal_group_tag: int

    @property
    def chap(self) -> object: ...

    @property
    def mutual_chap(self) -> object: ...


class LoginFailed(Exception):
    def __init__(self, status: tuple[int, int], why: str, *, delay: float = 0.0, quiet: bool = False,
                 notice: str = "") -> None:
        super().__init__(why)
        self.status = status
        self.delay = delay
        self.quiet = quiet
        self.notice = notice


@dataclass
class LoginResult:
    """What one login request produced."""

    response: list[bytes]            # BHS + data segment to send
    done: bool = False               # the connection is now in full feature phase
    failed: bool = False             # close the connection after sending
    reason: str = ""
    delay: float = 0.0               # seconds to hold the response: earlier failed authentications (AuthThrottle)
    quiet: bool = False              # a refusal not worth a line of its own (a locked-out peer, logged once)
    notice: str = ""                 # a warning to log once (a lockout begins)


@dataclass
class LoginState:
    isid: bytes = b""
    tsih: int = 0
    cid: int = 0
    itt: int = 0
    cmdsn: int = 0
    initiator_name: str = ""
    initiator_alias: str = ""
    target_name: str = ""
    session_type: str = "Normal"
    target: TargetInfo | None = None
    params: Params = field(default_factory=Params)


class LoginMachine:
    def __init__(self, lookup: Callable[[str], TargetInfo | None],
                 admit: Callable[[LoginState], int], *, our_mrdsl: int = 262144,
                 initial_statsn: int = 0, throttle: AuthThrottle | None = None, address: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lookup = lookup
        # failed CHAP responses are counted per (initiator name, source address): see _check_throttle
        self.throttle = throttle
        self.address = address
        self.clock = clock
        self._hold = 0.0
        self.admit = admit          # returns the TSIH, or raises LoginFailed
        self.our_mrdsl = our_mrdsl
        self.state = LoginState()
        self.stage = Stage.SECURITY
        self.statsn = initial_statsn
        self._first = True
        self._leading_done = False  # the first request's text may span PDUs (C bit): not the same as _first
        self._text = bytearray()
        self._seen_keys: dict[str, str] = {}
        self._auth_done = False
        self._chap: ChapAuthenticator | None = None
        self._chap_step = ""
        self._declared_mrdsl = False

    # ---------------------------------------------------------------------------------------------
    def receive(self, pdu: P.Pdu) -> LoginResult:
        try:
            return self._receive(pdu)
        except LoginFailed as e:
            return LoginResult([self._response(pdu, 0, e.status, b"")], failed=True, reason=str(e), delay=e.delay,
                               quiet=e.quiet, notice=e.notice)
        except TextError as e:
            return LoginResult([self._response(pdu, 0, Status.INITIATOR_ERROR, b"")], failed=True,
                               reason=str(e))

    def _receive(self, pdu: P.Pdu) -> LoginResult:
        b = pdu.bhs
        if pdu.opcode != P.Op.LOGIN_REQ:
            raise LoginFailed(Status.INVALID_DURING_LOGIN, f"opcode 0x{pdu.opcode:02x} during login")
        flags = b[1]
        transit, cont = bool(flags & P.F_TRANSIT), bool(flags & P.F_CONTINUE)
        csg, nsg = (flags >> 2) & 3, flags & 3
        isid, tsih, itt, cid = bytes(b[8:14]), pdu.u16(14), pdu.itt, pdu.u16(20)
        st = self.state
        if self._first:
            vmax, vmin = b[2], b[3]
            if vmin > VERSION or vmax < VERSION:  # §11.12.4
                raise LoginFailed(Status.UNSUPPORTED_VERSION, f"version {vmin}..{vmax}")
            st.isid, st.tsih, st.itt, st.cid, st.cmdsn = isid, tsih, itt, cid, pdu.u32(24)
            if csg == Stage.OPERATIONAL:
                self.stage = Stage.OPERATIONAL  # §6.3: the security stage may be skipped
        elif (isid, tsih, itt, cid) != (st.isid, st.tsih, st.itt, st.cid):
            raise LoginFailed(Status.INITIATOR_ERROR, "ISID/TSIH/ITT/CID changed within a login")
        if transit and cont:
            raise LoginFailed(Status.INITIATOR_ERROR, "T and C both set")  # §11.12.2
        if csg != self.stage or csg == 2 or (transit and (nsg <= csg or nsg == 2)):
            raise LoginFailed(Status.INITIATOR_ERROR, f"bad stage transition CSG={csg} NSG={nsg}")
        self._text += pdu.data
        if len(self._text) > MAX_LOGIN_TEXT:
            raise LoginFailed(Status.INITIATOR_ERROR, "login text too long")
        if cont:
            # §6.3: acknowledge a partial text with an empty response and wait for the rest
            self._first = False
            return LoginResult([self._response(pdu, 0, Status.SUCCESS, b"")])
        pairs = parse_text(bytes(self._text))
        self._text.clear()
        keys: dict[str, str] = {}
        for k, v in pairs:
            if k in keys:
                raise LoginFailed(Status.INITIATOR_ERROR, f"key {k} sent twice")
            if k in self._seen_keys and not k.startswith("CHAP_"):
                # §6.2 lets us refuse any renegotiation; an identical restatement of a declaration (libiscsi
                # re-sends InitiatorName after AuthMethod=None, tgt and LIO accept it) changes nothing
                if k in DECLARED_BY_INITIATOR and self._seen_keys[k] == v:
                    continue
                raise LoginFailed(Status.INITIATOR_ERROR, f"key {k} sent twice")
            keys[k] = v
        self._seen_keys.update(keys)
        answer: list[tuple[str, str]] = []
        self._first = False
        if not self._leading_done:
            self._leading_done = True
            self._leading(keys, answer)
        for k in TARGET_ONLY & keys.keys():
            raise LoginFailed(Status.INITIATOR_ERROR, f"initiator sent target-only key {k}")
        if csg == Stage.SECURITY:
            self._security(keys, answer)
        elif not self._auth_done:
            if self._auth_required():
                raise LoginFailed(Status.AUTH_FAILURE, "authentication required but security stage skipped")
            self._auth_done = True
        discovery = st.session_type == "Discovery"
        for k, v in keys.items():
            if k in DECLARED_BY_INITIATOR or k.startswith("CHAP_") or k == "AuthMethod":
                continue
            reply = negotiate_key(k, v, discovery=discovery, params=st.params)
            if reply is not None:
                answer.append((k, reply))
        if csg == Stage.OPERATIONAL and not self._declared_mrdsl:
            # MaxRecvDataSegmentLength is declarative (§13.12): state ours once
            self._declared_mrdsl = True
            st.params.target_mrdsl = self.our_mrdsl
            answer.append(("MaxRecvDataSegmentLength", str(self.our_mrdsl)))
        st.params.first_burst_length = min(st.params.first_burst_length, st.params.max_burst_length)
        # May we move on? Security needs authentication finished first (§6.3.1).
        go = transit and (csg != Stage.SECURITY or self._auth_done)
        done = False
        out_flags = csg << 2
        if go:
            out_flags |= P.F_TRANSIT | nsg
            if nsg == Stage.FULL_FEATURE:
                st.tsih = self.admit(st)
                done = True
            self.stage = Stage(nsg)
        data = encode_text(answer)
        if len(data) > 8192:
            raise LoginFailed(Status.TARGET_ERROR, "login response too long")
        hold, self._hold = self._hold, 0.0
        return LoginResult([self._response(pdu, out_flags, Status.SUCCESS, data), data], done=done, delay=hold)

    # ---------------------------------------------------------------------------------------------
    def _leading(self, keys: dict[str, str], answer: list[tuple[str, str]]) -> None:
        """The first request names the initiator, the session type and the target (§13.4, §13.5, §13.21)."""
        st = self.state
        name = keys.get("InitiatorName")
        if not name:
            raise LoginFailed(Status.MISSING_PARAMETER, "InitiatorName missing")
        st.initiator_name = name
        st.initiator_alias = keys.get("InitiatorAlias", "")
        st.session_type = keys.get("SessionType", "Normal")
        if st.session_type not in ("Normal", "Discovery"):
            raise LoginFailed(Status.SESSION_TYPE_NOT_SUPPORTED, f"SessionType={st.session_type}")
        if st.session_type == "Normal":
            tname = keys.get("TargetName")
            if not tname:
                raise LoginFailed(Status.MISSING_PARAMETER, "TargetName missing")
            target = self.lookup(tname)
            if target is None:
                raise LoginFailed(Status.NOT_FOUND, f"no target {tname}")
            if target.allowed_initiators is not None and name not in target.allowed_initiators:
                raise LoginFailed(Status.AUTHORIZATION_FAILURE, f"{name} not allowed on {tname}")
            st.target, st.target_name = target, tname
            answer.append(("TargetPortalGroupTag", str(target.portal_group_tag)))  # §13.9
            if target.alias:
                answer.append(("TargetAlias", target.alias))

    def _auth_required(self) -> bool:
        t = self.state.target
        return t is not None and t.chap is not None

    def _security(self, keys: dict[str, str], answer: list[tuple[str, str]]) -> None:
        """AuthMethod and the CHAP exchange (§12.1.3)."""
        if "AuthMethod" in keys:
            offered = [m.strip() for m in keys["AuthMethod"].split(",")]
            if self._auth_required():
                if "CHAP" not in offered:
                    raise LoginFailed(Status.AUTH_FAILURE, "target requires CHAP")
                t = self.state.target
                assert t is not None
                self._check_throttle()   # a locked-out peer is refused here, before any challenge
                chap, mutual = t.chap, t.mutual_chap
                self._chap = ChapAuthenticator(chap.user, chap.secret,  # type: ignore[attr-defined]
                                               getattr(mutual, "user", None), getattr(mutual, "secret", None))
                self._chap_step = "A"
                answer.append(("AuthMethod", "CHAP"))
            elif "None" in offered:
                answer.append(("AuthMethod", "None"))
                self._auth_done = True
            else:
                answer.append(("AuthMethod", "Reject"))
                raise LoginFailed(Status.AUTH_FAILURE, f"no acceptable AuthMethod in {keys['AuthMethod']}")
        elif not self._chap and not self._auth_done:
            if self._auth_required():
                raise LoginFailed(Status.AUTH_FAILURE, "AuthMethod not offered")
            self._auth_done = True
        if self._chap is None:
            return
        try:
            if self._chap_step == "A" and "CHAP_A" in keys:
                answer.extend(self._chap.choose(keys["CHAP_A"]))
                self._chap_step = "R"
            elif self._chap_step == "R" and "CHAP_R" in keys:
                hold = self._check_throttle()
                try:
                    answer.extend(self._chap.verify(keys))
                except ChapError as e:
                    raise self._chap_failed(e, hold) from e
                if self.throttle is not None:
                    self.throttle.succeeded(self._throttle_key())
                self._hold = hold   # a right answer after wrong ones waits too: the delay says nothing
                self._chap_step = "done"
                self._auth_done = True
            elif any(k.startswith("CHAP_") for k in keys):
                raise ChapError("CHAP keys out of order")
        except ChapError as e:
            raise LoginFailed(Status.AUTH_FAILURE, str(e)) from e

    # --- throttling of failed CHAP responses (protocol/auth_throttle.py) ----------------------------------
    def _throttle_key(self) -> tuple[str, str]:
        return (self.state.initiator_name, self.address)

    def _who(self) -> str:
        user = self._chap.claimed_user if self._chap is not None else None
        who = f"CHAP user {printable(user)}, " if user is not None else ""
        return f"{who}initiator {printable(self.state.initiator_name)}" + (f" at {self.address}" if self.address else "")

    def _check_throttle(self) -> float:
        """The delay this CHAP attempt's answer is held by; a locked-out (initiator, address) fails at once with
        0x0201, its CHAP not evaluated."""
        if self.throttle is None:
            return 0.0
        v = self.throttle.check(self._throttle_key(), self.clock())
        if v.locked:
            raise LoginFailed(Status.AUTH_FAILURE, f"{self._who()}: locked out for {v.locked_for:.0f} s more after "
                              f"{v.failures} failed CHAP logins; refused without evaluating CHAP", quiet=True)
        return v.delay

    def _chap_failed(self, e: ChapError, hold: float) -> LoginFailed:
        """A wrong CHAP response: counted, answered `hold` seconds late (earlier failures), logged by name."""
        notice = ""
        failures = 0
        if self.throttle is not None:
            v = self.throttle.failed(self._throttle_key(), self.clock())
            failures = v.failures
            if v.started_lockout:
                notice = (f"{self._who()}: locked out for {v.locked_for:.0f} s after {v.failures} failed CHAP logins "
                          "in a row")
        count = f" (failure {failures} in a row)" if failures else ""
        return LoginFailed(Status.AUTH_FAILURE, f"{self._who()}: {e}{count}", delay=hold, notice=notice)

    def _response(self, pdu: P.Pdu, flags: int, status: tuple[int, int], data: bytes) -> bytes:
        st = self.state
        statsn = self.statsn
        self.statsn = (self.statsn + 1) & 0xFFFFFFFF
        isid = st.isid or bytes(pdu.bhs[8:14])
        return P.login_response(flags, VERSION, VERSION, isid, st.tsih,
                                pdu.itt, statsn, st.cmdsn, (st.cmdsn + CMD_WINDOW - 1) & 0xFFFFFFFF,
                                status[0], status[1], len(data))
