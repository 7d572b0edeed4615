"""The initiator's login as a state machine (RFC 7143 §6.3, §11.12-13, CHAP §12.1.3).

`start()` gives the first Login Request; each Login Response goes to `receive()`, which gives the next request
or says the connection is in full feature phase (then `params` holds what was negotiated). No sockets, no
clock: the caller sends what it gets and feeds back what arrives.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field

from openvsan.protocol.iscsi import chap as C
from openvsan.protocol.iscsi.initiator_pdus import LoginResponse, login_request
from openvsan.protocol.iscsi.keys import Params, encode_text, negotiate_key, parse_text
from openvsan.protocol.iscsi.pdu import Op, Pdu

SECURITY, OPERATIONAL, FULL_FEATURE = 0, 1, 3
MAX_LOGIN_TEXT = 65536
CHAP_ALGORITHMS = "7,5"  # SHA-256 first, MD5 for targets that know no better (tgt, older arrays)

# §11.13.5 status class/detail → words, for the error a user reads
STATUS_TEXT = {
    (1, 1): "target moved temporarily", (1, 2): "target moved permanently",
    (2, 0): "initiator error", (2, 1): "authentication failed", (2, 2): "authorization failure (not allowed)",
    (2, 3): "target not found", (2, 4): "target removed", (2, 5): "unsupported version",
    (2, 6): "too many connections", (2, 7): "missing parameter", (2, 8): "can't include in session",
    (2, 9): "session type not supported", (2, 10): "session does not exist", (2, 11): "invalid during login",
    (3, 0): "target error", (3, 1): "service unavailable", (3, 2): "out of resources",
}


class LoginError(Exception):
    """The login failed: status (class, detail) from the target, or (0, 0) for a fault we found ourselves."""

    def __init__(self, message: str, status: tuple[int, int] = (0, 0)) -> None:
        super().__init__(message)
        self.status = status

    @property
    def auth_failure(self) -> bool:
        return self.status in ((2, 1), (2, 2))


@dataclass
class LoginConfig:
    initiator_name: str
    target_name: str | None                      # None: a discovery session (§13.21)
    isid: bytes
    tsih: int = 0
    cid: int = 0
    chap: tuple[str, str] | None = None          # (user, secret): our answer to the target's challenge
    mutual_chap: tuple[str, str] | None = None   # (user, secret): what the target must answer ours with
    header_digest: bool = False
    data_digest: bool = False
    max_recv_dsl: int = 262144                   # declared by us: the largest data segment we accept
    max_burst_length: int = 16776192
    first_burst_length: int = 262144
    max_outstanding_r2t: int = 16


@dataclass
class SessionParams:
    """What the login settled, from the initiator's point of view (RFC 7143 §13 defaults)."""

    header_digest: bool = False
    data_digest: bool = False
    initial_r2t: bool = True
    immediate_data: bool = True
    send_mrdsl: int = 8192      # the target's MaxRecvDataSegmentLength: the cap on what we send
    recv_mrdsl: int = 8192      # ours
    max_burst_length: int = 262144
    first_burst_length: int = 65536
    max_outstanding_r2t: int = 1
    default_time2wait: int = 2
    default_time2retain: int = 20
    error_recovery_level: int = 0
    target_keys: dict[str, str] = field(default_factory=dict)

    def apply(self, key: str, value: str) -> None:
        """Record the outcome of one key; values that are not results (NotUnderstood, Reject) keep defaults."""
        if value in ("NotUnderstood", "Irrelevant", "Reject"):
            return
        num = value.isascii() and value.isdigit()
        if key == "HeaderDigest":
            self.header_digest = value == "CRC32C"
        elif key == "DataDigest":
            self.data_digest = value == "CRC32C"
        elif key == "InitialR2T":
            self.initial_r2t = value == "Yes"
        elif key == "ImmediateData":
            self.immediate_data = value == "Yes"
        elif key == "MaxRecvDataSegmentLength" and num:
            self.send_mrdsl = max(512, int(value))
        elif key == "MaxBurstLength" and num:
            self.max_burst_length = int(value)
        elif key == "FirstBurstLength" and num:
            self.first_burst_length = int(value)
        elif key == "MaxOutstandingR2T" and num:
            self.max_outstanding_r2t = int(value)
        elif key == "DefaultTime2Wait" and num:
            self.default_time2wait = int(value)
        elif key == "DefaultTime2Retain" and num:
            self.default_time2retain = int(value)
        elif key == "ErrorRecoveryLevel" and num:
            self.error_recovery_level = int(value)
        else:
            self.target_keys[key] = value


@dataclass
class LoginStep:
    request: list[bytes] | None = None  # BHS and data segment to send next
    done: bool = False                  # full feature phase reached


class InitiatorLogin:
    def __init__(self, cfg: LoginConfig, *, itt: int = 0, cmdsn: int = 0, expstatsn: int = 0) -> None:
        self.cfg = cfg
        self.itt = itt
        self.cmdsn = cmdsn
        self.expstatsn = expstatsn
        self.stage = SECURITY
        self.params = SessionParams(recv_mrdsl=cfg.max_recv_dsl)
        self.tsih = cfg.tsih
        self.expcmdsn = cmdsn
        self.maxcmdsn = cmdsn
        self._text = bytearray()
        self._auth = "method"            # method → chap_a → chap_r → done
        self._chap_alg = 0
        self._my_ident = 0
        self._my_challenge = b""
        self._pending: list[tuple[str, str]] = []  # answers to keys the target offered
        self._offered: set[str] = set()

    # ---------------------------------------------------------------------------------------------
    def start(self) -> list[bytes]:
        keys = [("InitiatorName", self.cfg.initiator_name)]
        if self.cfg.target_name is None:
            keys.append(("SessionType", "Discovery"))
        else:
            keys += [("SessionType", "Normal"), ("TargetName", self.cfg.target_name)]
        if self.cfg.chap is None:
            if self.cfg.mutual_chap is not None:
                raise LoginError("mutual CHAP needs CHAP credentials too")
            # §6.3.1: no authentication: offer None and ask to move on at once
            keys.append(("AuthMethod", "None"))
            return self._request(keys, transit=True, nsg=OPERATIONAL)
        # with credentials, only CHAP: a target that chose None could not prove itself for mutual CHAP,
        # and a user who gave a secret expects it to be used
        keys.append(("AuthMethod", "CHAP"))
        return self._request(keys, transit=False, nsg=SECURITY)

    def receive(self, pdu: Pdu) -> LoginStep:
        if pdu.opcode != Op.LOGIN_RSP:
            raise LoginError(f"opcode 0x{pdu.opcode:02x} during login")
        rsp = LoginResponse.parse(pdu)
        if (rsp.status_class, rsp.status_detail) != (0, 0):
            what = STATUS_TEXT.get((rsp.status_class, rsp.status_detail), "login rejected")
            raise LoginError(f"{what} (status {rsp.status_class:#04x}/{rsp.status_detail:#04x})",
                             (rsp.status_class, rsp.status_detail))
        if rsp.version_active != 0:
            raise LoginError(f"target answered with version {rsp.version_active}")
        self.expstatsn = (rsp.statsn + 1) & 0xFFFFFFFF
        self.expcmdsn, self.maxcmdsn = rsp.expcmdsn, rsp.maxcmdsn
        if rsp.tsih:
            self.tsih = rsp.tsih
        self._text += pdu.data
        if len(self._text) > MAX_LOGIN_TEXT:
            raise LoginError("login response text too long")
        if rsp.cont:
            # §6.3: a partial text: ask for the rest with an empty request of the same stage
            return LoginStep(self._request([], transit=False, nsg=self.stage))
        pairs = parse_text(bytes(self._text))
        self._text.clear()
        keys = dict(pairs)
        if self.stage == SECURITY:
            return self._security(rsp, keys)
        if self.stage == OPERATIONAL:
            return self._operational(rsp, keys)
        raise LoginError("login response after the login finished")

    # ---------------------------------------------------------------------------------------------
    def _security(self, rsp: LoginResponse, keys: dict[str, str]) -> LoginStep:
        self._note_target_keys(keys)
        if self._auth == "method":
            method = keys.get("AuthMethod")
            if method is None and not rsp.transit:
                raise LoginError("target did not answer AuthMethod")
            if method == "CHAP":
                self._auth = "chap_a"
                return LoginStep(self._request([("CHAP_A", CHAP_ALGORITHMS)], transit=False, nsg=SECURITY))
            if method not in (None, "None"):
                raise LoginError(f"target chose AuthMethod={method}", (2, 1))
            if self.cfg.chap is not None:
                raise LoginError("target did not ask for CHAP although credentials were given", (2, 1))
            self._auth = "done"
        elif self._auth == "chap_a":
            return self._chap_answer(keys)
        elif self._auth == "chap_r":
            self._verify_mutual(keys)
            self._auth = "done"
        if rsp.transit and rsp.nsg == OPERATIONAL:
            self.stage = OPERATIONAL
            return LoginStep(self._operational_offer())
        if rsp.transit and rsp.nsg == FULL_FEATURE:
            raise LoginError("target skipped the operational stage")  # we asked for it (§6.3)
        return LoginStep(self._request([], transit=True, nsg=OPERATIONAL))

    def _chap_answer(self, keys: dict[str, str]) -> LoginStep:
        """§12.1.3: CHAP_A/CHAP_I/CHAP_C in, CHAP_N/CHAP_R (and our challenge for mutual CHAP) out."""
        assert self.cfg.chap is not None
        try:
            alg = int(keys["CHAP_A"])
            ident = int(keys["CHAP_I"])
            challenge = C.decode_binary(keys["CHAP_C"])
        except (KeyError, ValueError) as e:
            raise LoginError(f"bad CHAP challenge from target: {e}") from e
        except C.ChapError as e:
            raise LoginError(f"bad CHAP challenge from target: {e}") from e
        if alg not in C.ALGORITHMS or str(alg) not in CHAP_ALGORITHMS.split(","):
            raise LoginError(f"target chose CHAP_A={alg}, which we did not offer")
        if not 0 <= ident <= 255 or not challenge:
            raise LoginError("bad CHAP_I or empty CHAP_C")
        self._chap_alg = alg
        user, secret = self.cfg.chap
        answer = [("CHAP_N", user), ("CHAP_R", "0x" + C.response(alg, ident, secret.encode(), challenge).hex())]
        if self.cfg.mutual_chap is not None:
            self._my_ident = os.urandom(1)[0]
            self._my_challenge = os.urandom(C.CHALLENGE_LEN)
            if self._my_challenge == challenge:  # reflection (§12.1.3); 2^-256, but the rule is the rule
                self._my_challenge = bytes(b ^ 0xFF for b in challenge)
            answer += [("CHAP_I", str(self._my_ident)), ("CHAP_C", "0x" + self._my_challenge.hex())]
        self._auth = "chap_r"
        return LoginStep(self._request(answer, transit=True, nsg=OPERATIONAL))

    def _verify_mutual(self, keys: dict[str, str]) -> None:
        if self.cfg.mutual_chap is None:
            return
        user, secret = self.cfg.mutual_chap
        name, resp = keys.get("CHAP_N"), keys.get("CHAP_R")
        if name is None or resp is None:
            raise LoginError("target did not answer our mutual CHAP challenge", (2, 1))
        try:
            got = C.decode_binary(resp)
        except C.ChapError as e:
            raise LoginError(f"target's CHAP_R: {e}", (2, 1)) from e
        want = C.response(self._chap_alg, self._my_ident, secret.encode(), self._my_challenge)
        if name != user or not hmac.compare_digest(got, want):
            raise LoginError("target failed mutual CHAP: it does not know the secret", (2, 1))

    # ---------------------------------------------------------------------------------------------
    def _operational_offer(self) -> list[bytes]:
        cfg = self.cfg
        offer: list[tuple[str, str]] = [
            ("HeaderDigest", "CRC32C" if cfg.header_digest else "None"),
            ("DataDigest", "CRC32C" if cfg.data_digest else "None"),
            ("MaxRecvDataSegmentLength", str(cfg.max_recv_dsl)),
        ]
        self.params.recv_mrdsl = cfg.max_recv_dsl
        if cfg.target_name is not None:
            offer += [
                ("InitialR2T", "No"),
                ("ImmediateData", "Yes"),
                ("MaxBurstLength", str(cfg.max_burst_length)),
                ("FirstBurstLength", str(cfg.first_burst_length)),
                ("MaxConnections", "1"),
                ("MaxOutstandingR2T", str(cfg.max_outstanding_r2t)),
                ("DataPDUInOrder", "Yes"),
                ("DataSequenceInOrder", "Yes"),
            ]
        offer += [("DefaultTime2Wait", "0"), ("DefaultTime2Retain", "0"), ("ErrorRecoveryLevel", "0")]
        self._offered = {k for k, _ in offer if k != "MaxRecvDataSegmentLength"}
        return self._request(offer + self._pending, transit=True, nsg=FULL_FEATURE)

    def _operational(self, rsp: LoginResponse, keys: dict[str, str]) -> LoginStep:
        self._note_target_keys(keys)
        if rsp.transit and rsp.nsg == FULL_FEATURE:
            if self._pending:
                raise LoginError("target finished the login with keys of its own unanswered")
            self.params.first_burst_length = min(self.params.first_burst_length, self.params.max_burst_length)
            if self.cfg.header_digest and not self.params.header_digest:
                raise LoginError("target refused header digests (HeaderDigest=CRC32C was asked for)")
            if self.cfg.data_digest and not self.params.data_digest:
                raise LoginError("target refused data digests (DataDigest=CRC32C was asked for)")
            self.stage = FULL_FEATURE
            return LoginStep(done=True)
        answers, self._pending = self._pending, []
        return LoginStep(self._request(answers, transit=True, nsg=FULL_FEATURE))

    def _note_target_keys(self, keys: dict[str, str]) -> None:
        """Results of our offers, the target's declarations, and offers of its own that need an answer."""
        discovery = self.cfg.target_name is None
        for k, v in keys.items():
            if k.startswith("CHAP_") or k == "AuthMethod":
                continue
            if k in self._offered or k in ("MaxRecvDataSegmentLength", "TargetAlias", "TargetPortalGroupTag",
                                           "TargetAddress"):
                if v == "Reject" and k in ("HeaderDigest", "DataDigest"):
                    v = "None"
                self.params.apply(k, v)
                continue
            # §6.2: the target's own offer: answer it by the same rules a target uses
            scratch = Params()
            reply = negotiate_key(k, v, discovery=discovery, params=scratch)
            if reply is not None:
                self._pending.append((k, reply))
                self.params.apply(k, reply)

    def _request(self, pairs: list[tuple[str, str]], *, transit: bool, nsg: int) -> list[bytes]:
        data = encode_text(pairs)
        bhs = login_request(self.cfg.isid, self.tsih, self.itt, self.cfg.cid, self.cmdsn, self.expstatsn,
                            csg=self.stage, nsg=nsg, transit=transit, dsl=len(data))
        return [bhs, data]
