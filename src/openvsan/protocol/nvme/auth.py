"""NVMe in-band authentication with DH-HMAC-CHAP (NVMe Base 2.0 §8.13; the AUTH_Send / AUTH_Receive fabrics
commands of NVMe-oF, TP 8006): secrets in the DHHC-1 form, the protocol messages, the hash and DH arithmetic,
and the transaction of each role (ControllerAuth for the target's queues, HostAuth for our initiator).

Sans-IO: no socket, no clock, no logging; randomness is passed in. A secret never appears in a repr.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac as hmaclib
import os
import struct
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.command import Sqe

# NVMe-oF fabrics command types (TP 8006 Figure 2) and their fields: CDW10 bytes SPSP0 (15:8), SPSP1 (23:16),
# SECP (31:24); CDW11 TL (AUTH_Send) / AL (AUTH_Receive)
FCTYPE_AUTH_SEND = 0x05
FCTYPE_AUTH_RECEIVE = 0x06
SECP_DHCHAP = 0xE9            # Base 2.0 §8.13.1: the NVMe authentication security protocol
SPSP_DHCHAP = 0x01            # SPSP0 and SPSP1 both 01h for DH-HMAC-CHAP
AUTH_CDW10 = (SPSP_DHCHAP << 8) | (SPSP_DHCHAP << 16) | (SECP_DHCHAP << 24)
AUTH_REQUIRED = S.sf(S.SCT_COMMAND, 0x91)   # NVMe-oF: Authentication Required, to a command before it is done
# Connect response DW0 (NVMe-oF Figure 21 with TP 8006): AUTHREQ in bits 19:16
CONNECT_ATR = 1 << 17         # authentication transaction required
CONNECT_ASCR = 1 << 18        # authentication with secure channel (TLS) required: not offered

# Message types and identifiers (Base 2.0 §8.13.5.1 Figure 531)
AUTH_COMMON = 0x00
AUTH_DHCHAP = 0x01
NEGOTIATE, CHALLENGE, REPLY, SUCCESS1, SUCCESS2 = 0x00, 0x01, 0x02, 0x03, 0x04
FAILURE2, FAILURE1 = 0xF0, 0xF1
AUTHID_DHCHAP = 0x01          # the protocol descriptor's AUTHID
DONE = 0x100                  # our step after the last message of a transaction
# Failure reason code (REASON_FAILED) and explanations (Figure 537)
REASON_FAILED = 0x01
FAILED = 0x01
NOT_USABLE = 0x02
CONCAT_MISMATCH = 0x03
HASH_UNUSABLE = 0x04
DHGROUP_UNUSABLE = 0x05
INCORRECT_PAYLOAD = 0x06
INCORRECT_MESSAGE = 0x07
EXPLANATIONS = {FAILED: "authentication failed", NOT_USABLE: "protocol not usable",
                CONCAT_MISMATCH: "secure channel concatenation mismatch", HASH_UNUSABLE: "hash function not usable",
                DHGROUP_UNUSABLE: "DH group not usable", INCORRECT_PAYLOAD: "incorrect payload",
                INCORRECT_MESSAGE: "incorrect protocol message"}

_HDR = struct.Struct("<BBHH")                 # AUTH-TYPE, AUTH-ID, reserved, T_ID
_CHALLENGE = struct.Struct("<BBHHBBBBHI")     # + HL, rsvd, HASHID, DHGID, DHVLEN, SEQNUM (Figure 533)
_REPLY = struct.Struct("<BBHHBBBBHI")         # + HL, rsvd, CVALID, rsvd, DHVLEN, SEQNUM (Figure 534)
_SUCCESS1 = struct.Struct("<BBHHBBB7x")       # + HL, rsvd, RVALID (Figure 535)
_SUCCESS2 = struct.Struct("<BBHH10x")         # Figure 536
_FAILURE = struct.Struct("<BBHHBB")           # + REASON CODE, REASON CODE EXPLANATION (Figure 537)
_DESCRIPTOR_LEN = 64                          # AUTHID, rsvd, HALEN, DHLEN, 30 hash IDs, 30 DH group IDs
MAX_IDS = 30


class SecretError(ValueError):
    """A DHHC-1 secret that cannot be used; str() says why, never the secret."""


class AuthPayloadError(ValueError):
    def __init__(self, explanation: int, why: str) -> None:
        super().__init__(why)
        self.explanation = explanation


# --- hashes and DH groups (Base 2.0 §8.13.5.2 Figures 532-533) ---------------------------------------------
@dataclass(frozen=True)
class Hash:
    name: str
    hid: int
    size: int

    def digest(self, data: bytes) -> bytes:
        return hashlib.new(self.name, data).digest()

    def hmac(self, key: bytes, *parts: bytes) -> bytes:
        h = hmaclib.new(key, digestmod=self.name)
        for p in parts:
            h.update(p)
        return h.digest()


HASHES = {h.name: h for h in (Hash("sha256", 0x01, 32), Hash("sha384", 0x02, 48), Hash("sha512", 0x03, 64))}
HASH_BY_ID = {h.hid: h for h in HASHES.values()}


@dataclass(frozen=True)
class DhGroup:
    name: str
    gid: int
    bits: int        # 0: the null group (no DH exchange; the challenge is used as it is)
    x: int = 0       # RFC 7919 §A: the X that makes the group's p a safe prime

    @property
    def size(self) -> int:
        """Bytes of a public value or shared secret: that of p."""
        return self.bits // 8

    @property
    def prime(self) -> int:
        return _ffdhe_prime(self.bits, self.x)


@cache
def _ffdhe_prime(bits: int, x: int) -> int:
    """RFC 7919 Appendix A: p = 2^b - 2^{b-64} + {[2^{b-130} e] + X} * 2^64 - 1, e to b-130 bits exactly."""
    n, guard = bits - 130, 64
    term, total, k = 1 << (n + guard), 0, 0
    while term:                 # e = sum 1/k!, in fixed point with guard bits
        total += term
        k += 1
        term //= k
    return (1 << bits) - (1 << (bits - 64)) + ((total >> guard) + x) * (1 << 64) - 1


DH_GROUPS = {g.name: g for g in (DhGroup("null", 0x00, 0), DhGroup("ffdhe2048", 0x01, 2048, 560316),
                                 DhGroup("ffdhe3072", 0x02, 3072, 2625351), DhGroup("ffdhe4096", 0x03, 4096, 5736041),
                                 DhGroup("ffdhe6144", 0x04, 6144, 15705020),
                                 DhGroup("ffdhe8192", 0x05, 8192, 10965728))}
DH_BY_ID = {g.gid: g for g in DH_GROUPS.values()}


@cache
def _parameters(group: DhGroup) -> Any:
    from cryptography.hazmat.primitives.asymmetric import dh
    p = group.prime
    # g = 2 and q = (p-1)/2 (RFC 7919 §3); OpenSSL knows the named group and keeps exponents short (§5.2)
    return dh.DHParameterNumbers(p, 2, (p - 1) // 2).parameters()


class DhKey:
    """One side's ephemeral key of one transaction (Base 2.0 §8.13.5.3: g^x mod p), through OpenSSL."""

    def __init__(self, group: DhGroup) -> None:
        self.group = group
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # FFDH is deprecated in `cryptography`; RFC 7919 is what NVMe names
            self._key = _parameters(group).generate_private_key()
        y = self._key.public_key().public_numbers().y
        self.public = y.to_bytes(group.size, "big")

    def shared(self, peer: bytes) -> bytes:
        """g^xy mod p, as many bytes as p (leading zeros kept); ValueError for a value that is not a member
        of the group (SP 800-56A 5.6.2.3.1: 1 < y < p-1)."""
        from cryptography.hazmat.primitives.asymmetric import dh
        p = self.group.prime
        y = int.from_bytes(peer, "big")
        if len(peer) != self.group.size or not 1 < y < p - 1:
            raise ValueError("DH value out of range")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peer_key = dh.DHPublicNumbers(y, _parameters(self.group).parameter_numbers()).public_key()
            return bytes(self._key.exchange(peer_key)).rjust(self.group.size, b"\0")


# --- secrets (Base 2.0 §8.13.5.7; the DHHC-1 representation of `nvme gen-dhchap-key`) ----------------------
@dataclass(frozen=True)
class Secret:
    key: bytes = field(repr=False)
    transform: int = 0          # 0: used as it is; 1/2/3: HMAC-SHA-256/384/512 with the NQN (§8.13.5.7)

    def __repr__(self) -> str:
        return f"Secret(<{len(self.key)} bytes>, transform={self.transform})"

    def transformed(self, nqn: str) -> bytes:
        """The key the HMACs use: K itself, or HMAC(K, NQN || "NVMe-over-Fabrics") with the hash NN names."""
        if not self.transform:
            return self.key
        return HASH_BY_ID[self.transform].hmac(self.key, nqn.encode(), b"NVMe-over-Fabrics")


def parse_secret(text: str) -> Secret:
    """`DHHC-1:NN:<base64 of key || CRC-32 (little endian)>:`, key 32, 48 or 64 bytes."""
    parts = text.strip().split(":")
    if len(parts) != 4 or parts[0] != "DHHC-1" or parts[3] != "":
        raise SecretError("not a DHHC-1 secret; write it as `nvme gen-dhchap-key` prints it: DHHC-1:00:<base64>:")
    if len(parts[1]) != 2 or not parts[1].isdigit() or int(parts[1]) > 3:
        raise SecretError(f"unknown key transform {parts[1]!r}; use 00 (none), 01, 02 or 03 (SHA-256/384/512)")
    try:
        raw = base64.b64decode(parts[2], validate=True)
    except (binascii.Error, ValueError):
        raise SecretError("the key is not valid base64") from None
    if len(raw) not in (36, 52, 68):
        raise SecretError(f"the key is {max(0, len(raw) - 4)} bytes; use 32, 48 or 64 (nvme gen-dhchap-key -l)")
    key, crc = raw[:-4], int.from_bytes(raw[-4:], "little")
    if zlib.crc32(key) != crc:
        raise SecretError("the key's CRC-32 does not match; copy the whole secret again")
    transform = int(parts[1])
    if transform and len(key) < HASH_BY_ID[transform].size:
        raise SecretError(f"a {len(key)}-byte key is too short for transform {parts[1]}; use "
                          f"{HASH_BY_ID[transform].size} bytes or more")
    return Secret(key, transform)


def format_secret(secret: Secret) -> str:
    raw = secret.key + zlib.crc32(secret.key).to_bytes(4, "little")
    return f"DHHC-1:{secret.transform:02d}:{base64.b64encode(raw).decode()}:"


# --- the responses (Base 2.0 §8.13.5.4-5) ------------------------------------------------------------------
def augmented_challenge(h: Hash, session_key: bytes | None, challenge: bytes) -> bytes:
    """Ca = HMAC(H(g^xy mod p), C) with a DH group; C itself with the null group (§8.13.5.3)."""
    return challenge if session_key is None else h.hmac(h.digest(session_key), challenge)


def host_response(h: Hash, key: bytes, challenge: bytes, seqnum: int, t_id: int, sc_c: int, hostnqn: str,
                  subnqn: str) -> bytes:
    """R1 = HMAC(Kh, Ca1 || S1 || T_ID || SC_C || "HostHost" || NQNh || 00h || NQNc)."""
    return h.hmac(key, challenge, struct.pack("<IHB", seqnum, t_id, sc_c), b"HostHost", hostnqn.encode(), b"\0",
                  subnqn.encode())


def controller_response(h: Hash, key: bytes, challenge: bytes, seqnum: int, t_id: int, sc_c: int, subnqn: str,
                        hostnqn: str) -> bytes:
    """R2 = HMAC(Kc, Ca2 || S2 || T_ID || SC_C || "Controller" || NQNc || 00h || NQNh)."""
    return h.hmac(key, challenge, struct.pack("<IHB", seqnum, t_id, sc_c), b"Controller", subnqn.encode(), b"\0",
                  hostnqn.encode())


# --- messages (Base 2.0 §8.13.5 Figures 531-537) -----------------------------------------------------------
@dataclass
class Negotiate:
    t_id: int
    hashes: tuple[int, ...]
    dhgroups: tuple[int, ...]
    sc_c: int = 0

    def pack(self) -> bytes:
        ids = bytes(self.hashes).ljust(MAX_IDS, b"\0") + bytes(self.dhgroups).ljust(MAX_IDS, b"\0")
        return (_HDR.pack(AUTH_COMMON, NEGOTIATE, 0, self.t_id) + bytes((self.sc_c, 1))
                + bytes((AUTHID_DHCHAP, 0, len(self.hashes), len(self.dhgroups))) + ids)

    @classmethod
    def unpack(cls, b: bytes) -> Negotiate:
        if len(b) < 8 + _DESCRIPTOR_LEN:
            raise AuthPayloadError(INCORRECT_PAYLOAD, f"AUTH_Negotiate of {len(b)} bytes")
        _, _, _, t_id = _HDR.unpack_from(b)
        sc_c, napd = b[6], b[7]
        if napd != 1 or b[8] != AUTHID_DHCHAP:
            raise AuthPayloadError(NOT_USABLE, "no DH-HMAC-CHAP protocol descriptor")
        halen, dhlen = b[10], b[11]
        if halen > MAX_IDS or dhlen > MAX_IDS:
            raise AuthPayloadError(INCORRECT_PAYLOAD, "descriptor lists over 30 identifiers")
        return cls(t_id, tuple(b[12:12 + halen]), tuple(b[42:42 + dhlen]), sc_c)


@dataclass
class Challenge:
    t_id: int
    hash_id: int
    seqnum: int
    cval: bytes
    dhgid: int = 0
    dhv: bytes = b""

    def pack(self) -> bytes:
        return (_CHALLENGE.pack(AUTH_DHCHAP, CHALLENGE, 0, self.t_id, len(self.cval), 0, self.hash_id, self.dhgid,
                                len(self.dhv), self.seqnum) + self.cval + self.dhv)

    @classmethod
    def unpack(cls, b: bytes) -> Challenge:
        if len(b) < _CHALLENGE.size:
            raise AuthPayloadError(INCORRECT_PAYLOAD, "short DH-HMAC-CHAP_Challenge")
        _, _, _, t_id, hl, _, hash_id, dhgid, dhvlen, seqnum = _CHALLENGE.unpack_from(b)
        end = _CHALLENGE.size + hl
        if len(b) < end + dhvlen:
            raise AuthPayloadError(INCORRECT_PAYLOAD, "DH-HMAC-CHAP_Challenge shorter than HL and DHVLEN say")
        return cls(t_id, hash_id, seqnum, bytes(b[_CHALLENGE.size:end]), dhgid, bytes(b[end:end + dhvlen]))


@dataclass
class Reply:
    t_id: int
    rval: bytes
    seqnum: int = 0              # S2; 0 with no C2 (unidirectional)
    c2: bytes | None = None      # the host's challenge to the controller (CVALID)
    dhv: bytes = b""

    def pack(self) -> bytes:
        hl = len(self.rval)
        c2 = self.c2 if self.c2 is not None else bytes(hl)
        return (_REPLY.pack(AUTH_DHCHAP, REPLY, 0, self.t_id, hl, 0, int(self.c2 is not None), 0, len(self.dhv),
                            self.seqnum) + self.rval + c2 + self.dhv)

    @classmethod
    def unpack(cls, b: bytes) -> Reply:
        if len(b) < _REPLY.size:
            raise AuthPayloadError(INCORRECT_PAYLOAD, "short DH-HMAC-CHAP_Reply")
        _, _, _, t_id, hl, _, cvalid, _, dhvlen, seqnum = _REPLY.unpack_from(b)
        o = _REPLY.size
        if len(b) < o + 2 * hl + dhvlen:
            raise AuthPayloadError(INCORRECT_PAYLOAD, "DH-HMAC-CHAP_Reply shorter than HL and DHVLEN say")
        c2 = bytes(b[o + hl:o + 2 * hl]) if cvalid & 1 else None
        return cls(t_id, bytes(b[o:o + hl]), seqnum, c2, bytes(b[o + 2 * hl:o + 2 * hl + dhvlen]))


@dataclass
class Success1:
    t_id: int
    hl: int
    rval: bytes | None = None    # R2, with bidirectional authentication (RVALID)

    def pack(self) -> bytes:
        return (_SUCCESS1.pack(AUTH_DHCHAP, SUCCESS1, 0, self.t_id, self.hl, 0, int(self.rval is not None))
                + (self.rval or b""))

    @classmethod
    def unpack(cls, b: bytes) -> Success1:
        if len(b) < _SUCCESS1.size:
            raise AuthPayloadError(INCORRECT_PAYLOAD, "short DH-HMAC-CHAP_Success1")
        _, _, _, t_id, hl, _, rvalid = _SUCCESS1.unpack_from(b)
        if rvalid & 1 and len(b) < _SUCCESS1.size + hl:
            raise AuthPayloadError(INCORRECT_PAYLOAD, "DH-HMAC-CHAP_Success1 shorter than HL says")
        return cls(t_id, hl, bytes(b[_SUCCESS1.size:_SUCCESS1.size + hl]) if rvalid & 1 else None)


@dataclass
class Success2:
    t_id: int

    def pack(self) -> bytes:
        return _SUCCESS2.pack(AUTH_DHCHAP, SUCCESS2, 0, self.t_id)


@dataclass
class Failure:
    t_id: int
    explanation: int
    first: bool = True           # Failure1 (controller to host) or Failure2 (host to controller)

    def pack(self) -> bytes:
        return _FAILURE.pack(AUTH_COMMON, FAILURE1 if self.first else FAILURE2, 0, self.t_id, REASON_FAILED,
                             self.explanation)

    @classmethod
    def unpack(cls, b: bytes) -> Failure:
        if len(b) < _FAILURE.size:
            raise AuthPayloadError(INCORRECT_PAYLOAD, "short DH-HMAC-CHAP_Failure")
        _, auth_id, _, t_id, _, explanation = _FAILURE.unpack_from(b)
        return cls(t_id, explanation, auth_id == FAILURE1)


Message = Negotiate | Challenge | Reply | Success1 | Success2 | Failure
_KINDS: dict[tuple[int, int], Callable[[bytes], Message]] = {
    (AUTH_COMMON, NEGOTIATE): Negotiate.unpack, (AUTH_DHCHAP, CHALLENGE): Challenge.unpack,
    (AUTH_DHCHAP, REPLY): Reply.unpack, (AUTH_DHCHAP, SUCCESS1): Success1.unpack,
    (AUTH_DHCHAP, SUCCESS2): lambda b: Success2(_HDR.unpack_from(b)[3]),
    (AUTH_COMMON, FAILURE1): Failure.unpack, (AUTH_COMMON, FAILURE2): Failure.unpack,
}


def unpack_message(b: bytes) -> Message:
    if len(b) < _HDR.size:
        raise AuthPayloadError(INCORRECT_PAYLOAD, f"authentication message of {len(b)} bytes")
    kind = _KINDS.get((b[0], b[1]))
    if kind is None:
        raise AuthPayloadError(INCORRECT_MESSAGE, f"unknown message type {b[0]:#x} id {b[1]:#x}")
    return kind(b)


def message_id(b: bytes) -> int:
    return b[1] if len(b) > 1 else -1


# --- the controller's side of one queue --------------------------------------------------------------------
@dataclass(frozen=True)
class HostPolicy:
    """What a subsystem knows of one host: its secrets and the hashes / DH groups it may use, the
    controller's preference first."""

    host_key: Secret
    ctrl_key: Secret | None = None
    hashes: tuple[str, ...] = tuple(HASHES)
    dhgroups: tuple[str, ...] = tuple(DH_GROUPS)


def _seqnum(rng: Callable[[int], bytes]) -> int:
    return int.from_bytes(rng(4), "little") or 1


class ControllerAuth:
    """The DH-HMAC-CHAP transactions of one queue, controller side (§8.13.5). The order of messages is
    Linux nvmet's: AUTH_Send Negotiate, AUTH_Receive Challenge, AUTH_Send Reply, AUTH_Receive Success1 (or
    Failure1), and AUTH_Send Success2 when the host asked for bidirectional authentication. A Negotiate
    restarts a transaction at any step. After Failure1 is sent or Failure2 received, `failed` is set and the
    controller must go (the host may not use it)."""

    def __init__(self, policy: HostPolicy, hostnqn: str, subnqn: str, *,
                 rng: Callable[[int], bytes] = os.urandom, dh: Callable[[DhGroup], DhKey] = DhKey) -> None:
        self.policy = policy
        self.hostnqn = hostnqn
        self.subnqn = subnqn
        self.rng = rng
        self.dh = dh
        self.authenticated = False
        self.failed = False
        self.bidirectional = False
        self.explanation = 0          # why it failed (EXPLANATIONS), for the log
        self.step = NEGOTIATE
        self.t_id = 0
        self.hash: Hash | None = None
        self.group = DH_GROUPS["null"]
        self._key: DhKey | None = None
        self._c1 = b""
        self._s1 = 0
        self._c2: bytes | None = None
        self._s2 = 0
        self._session: bytes | None = None

    @staticmethod
    def _fields(sqe: Sqe) -> int:
        if sqe.cdw10 & 0xFFFFFF00 != AUTH_CDW10:
            return S.INVALID_FIELD      # SECP other than E9h or SPSP0/SPSP1 other than 01h
        if sqe.cdw11 == 0:
            return S.INVALID_FIELD      # TL / AL of 0
        return S.SUCCESS

    def _fail(self, explanation: int) -> None:
        self.step = FAILURE1
        self.explanation = explanation

    def refuse(self) -> int:
        """The host's response is not looked at (its NQN and address are locked out): the transaction fails
        as if it were wrong, and the next AUTH_Receive carries Failure1. Returns the AUTH_Send status."""
        self._fail(FAILED)
        return S.SUCCESS

    def send(self, sqe: Sqe, data: bytes | bytearray | memoryview) -> int:
        """AUTH_Send: a message from the host. Returns the command's status; protocol errors are answered
        by the next AUTH_Receive (Failure1), not by the status."""
        status = self._fields(sqe)
        if status:
            return status
        if sqe.cdw11 != len(data):
            return S.DATA_SGL_LENGTH_INVALID
        b = bytes(data)
        try:
            msg = unpack_message(b)
        except AuthPayloadError as e:
            self._fail(e.explanation)
            return S.SUCCESS
        if isinstance(msg, Negotiate):
            self._negotiate(msg)
        elif isinstance(msg, Failure) and not msg.first:
            self.failed, self.authenticated, self.explanation = True, False, msg.explanation
        elif not (isinstance(msg, Reply) and self.step == REPLY or isinstance(msg, Success2) and self.step == SUCCESS2):
            self._fail(INCORRECT_MESSAGE)         # not the message this step waits for
        elif msg.t_id != self.t_id:
            self._fail(INCORRECT_PAYLOAD)
        elif isinstance(msg, Reply):
            self._reply(msg)
        else:
            self.authenticated, self.step = True, DONE
        return S.SUCCESS

    def _negotiate(self, msg: Negotiate) -> None:
        self.t_id = msg.t_id
        self.step = CHALLENGE
        self._c2 = self._session = None
        if msg.sc_c:
            return self._fail(CONCAT_MISMATCH)    # no secure channel concatenation (TLS) here
        h = next((HASHES[n] for n in self.policy.hashes if HASHES[n].hid in msg.hashes), None)
        if h is None:
            return self._fail(HASH_UNUSABLE)
        g = next((DH_GROUPS[n] for n in self.policy.dhgroups if DH_GROUPS[n].gid in msg.dhgroups), None)
        if g is None:
            return self._fail(DHGROUP_UNUSABLE)
        self.hash, self.group = h, g
        return None

    def _reply(self, msg: Reply) -> None:
        h = self.hash
        assert h is not None
        if len(msg.rval) != h.size:
            return self._fail(INCORRECT_PAYLOAD)
        if self._key is not None:
            if not msg.dhv:
                return self._fail(INCORRECT_PAYLOAD)
            try:
                self._session = self._key.shared(msg.dhv)
            except ValueError:
                return self._fail(DHGROUP_UNUSABLE)
        elif msg.dhv:
            return self._fail(INCORRECT_PAYLOAD)
        key = self.policy.host_key.transformed(self.hostnqn)
        expect = host_response(h, key, augmented_challenge(h, self._session, self._c1), self._s1, self.t_id, 0,
                               self.hostnqn, self.subnqn)
        if not hmaclib.compare_digest(expect, msg.rval):
            return self._fail(FAILED)
        if msg.c2 is not None and msg.seqnum:
            if self.policy.ctrl_key is None:
                return self._fail(FAILED)         # bidirectional asked, but no controller secret is configured
            self._c2, self._s2, self.bidirectional = msg.c2, msg.seqnum, True
        self.step = SUCCESS1
        return None

    def receive(self, sqe: Sqe) -> tuple[int, bytes]:
        """AUTH_Receive: the controller's next message, padded to AL bytes."""
        status = self._fields(sqe)
        if status:
            return status, b""
        al = sqe.cdw11
        if self.step == CHALLENGE:
            assert self.hash is not None
            self._c1, self._s1 = self.rng(self.hash.size), _seqnum(self.rng)
            self._key = self.dh(self.group) if self.group.bits else None
            out = Challenge(self.t_id, self.hash.hid, self._s1, self._c1, self.group.gid,
                            self._key.public if self._key else b"").pack()
            if len(out) > al:
                return S.INVALID_FIELD, b""       # the host's buffer cannot hold the challenge
            self.step = REPLY
        elif self.step == SUCCESS1:
            assert self.hash is not None
            rval = None
            if self._c2 is not None:
                assert self.policy.ctrl_key is not None
                key = self.policy.ctrl_key.transformed(self.subnqn)
                rval = controller_response(self.hash, key, augmented_challenge(self.hash, self._session, self._c2),
                                           self._s2, self.t_id, 0, self.subnqn, self.hostnqn)
            out = Success1(self.t_id, self.hash.size, rval).pack()
            if len(out) > al:
                return S.INVALID_FIELD, b""
            if rval is None:
                self.authenticated, self.step = True, DONE
            else:
                self.step = SUCCESS2
            self._forget()
        else:
            if self.step != FAILURE1:
                self.explanation = INCORRECT_MESSAGE   # an AUTH_Receive where none was due
            out = Failure(self.t_id, self.explanation or FAILED).pack()
            self.failed, self.authenticated = True, False
            self._forget()
        return S.SUCCESS, out[:al].ljust(al, b"\0")

    def _forget(self) -> None:
        self._key = None
        self._session = None


# --- the host's side (our initiator) -----------------------------------------------------------------------
class AuthFailed(Exception):
    """The transaction failed; str() says why (never a secret)."""


class HostAuth:
    """One queue's DH-HMAC-CHAP transaction, host side: negotiate() -> bytes for AUTH_Send;
    challenge(AUTH_Receive data) -> Reply bytes; success1(data) -> Success2 bytes (bidirectional) or None.
    Any failure raises AuthFailed with the message to send (Failure2) in `.failure2` where one is due."""

    def __init__(self, hostnqn: str, subnqn: str, host_key: Secret, ctrl_key: Secret | None = None, *,
                 hashes: Sequence[str] = tuple(HASHES), dhgroups: Sequence[str] = tuple(DH_GROUPS), t_id: int = 1,
                 rng: Callable[[int], bytes] = os.urandom, dh: Callable[[DhGroup], DhKey] = DhKey) -> None:
        self.hostnqn, self.subnqn = hostnqn, subnqn
        self.host_key, self.ctrl_key = host_key, ctrl_key
        self.hashes, self.dhgroups = tuple(hashes), tuple(dhgroups)
        self.t_id, self.rng, self.dh = t_id, rng, dh
        self.failure2: bytes | None = None
        self._hash: Hash | None = None
        self._c2: bytes | None = None
        self._s2 = 0
        self._session: bytes | None = None

    def negotiate(self) -> bytes:
        return Negotiate(self.t_id, tuple(HASHES[n].hid for n in self.hashes),
                         tuple(DH_GROUPS[n].gid for n in self.dhgroups)).pack()

    def _expect(self, b: bytes, kind: type) -> Any:
        try:
            msg = unpack_message(b)
        except AuthPayloadError as e:
            raise AuthFailed(f"controller sent {e}") from None
        if isinstance(msg, Failure):
            raise AuthFailed(f"controller refused: {EXPLANATIONS.get(msg.explanation, hex(msg.explanation))}")
        if not isinstance(msg, kind) or msg.t_id != self.t_id:
            raise AuthFailed(f"controller sent {type(msg).__name__} (T_ID {msg.t_id}) instead of {kind.__name__}")
        return msg

    def challenge(self, b: bytes) -> bytes:
        msg: Challenge = self._expect(b, Challenge)
        h = HASH_BY_ID.get(msg.hash_id)
        g = DH_BY_ID.get(msg.dhgid)
        if h is None or h.name not in self.hashes or len(msg.cval) != h.size:
            raise AuthFailed(f"controller chose hash {msg.hash_id:#x}, not one offered")
        if g is None or g.name not in self.dhgroups or (g.bits and len(msg.dhv) != g.size) or \
                (not g.bits and msg.dhv):
            raise AuthFailed(f"controller chose DH group {msg.dhgid:#x} with a {len(msg.dhv)}-byte value")
        dhv = b""
        if g.bits:
            key = self.dh(g)
            try:
                self._session = key.shared(msg.dhv)
            except ValueError:
                raise AuthFailed("controller's DH value is not in the group") from None
            dhv = key.public
        self._hash = h
        rval = host_response(h, self.host_key.transformed(self.hostnqn),
                             augmented_challenge(h, self._session, msg.cval), msg.seqnum, self.t_id, 0,
                             self.hostnqn, self.subnqn)
        if self.ctrl_key is not None:
            self._c2, self._s2 = self.rng(h.size), _seqnum(self.rng)
        return Reply(self.t_id, rval, self._s2, self._c2, dhv).pack()

    def success1(self, b: bytes) -> bytes | None:
        msg: Success1 = self._expect(b, Success1)
        h = self._hash
        assert h is not None
        if self.ctrl_key is None or self._c2 is None:
            return None
        expect = controller_response(h, self.ctrl_key.transformed(self.subnqn),
                                     augmented_challenge(h, self._session, self._c2), self._s2, self.t_id, 0,
                                     self.subnqn, self.hostnqn)
        if msg.rval is None or not hmaclib.compare_digest(expect, msg.rval):
            self.failure2 = Failure(self.t_id, FAILED, first=False).pack()
            raise AuthFailed("the controller did not prove the controller secret (bidirectional authentication)")
        return Success2(self.t_id).pack()
