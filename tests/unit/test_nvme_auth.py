"""DH-HMAC-CHAP (NVMe Base 2.0 §8.13, protocol/nvme/auth.py): DHHC-1 secrets against vectors `nvme gen-dhchap-key`
(nvme-cli 2.3) wrote, the RFC 7919 groups against OpenSSL's, the message codec, and whole transactions driven
with bytes: the controller's machine against the host's, and each against the spec's formulas written out
here once more, by hand."""

from __future__ import annotations

import base64
import hashlib
import hmac
import shutil
import struct
import subprocess
import warnings
import zlib
from typing import Any

import pytest

from openvsan.node.config import ConfigError, parse_config
from openvsan.protocol.nvme import auth as A
from openvsan.protocol.nvme import host_commands as HC
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.command import Sqe
from openvsan.protocol.nvme.fabrics import Fabric
from openvsan.protocol.nvme.subsystem import Subsystem

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0c9a1d3e-1234-4567-89ab-0123456789ab"
SUBNQN = "nqn.2026-11.org.openvsan:disk0"

# `nvme gen-dhchap-key -s <hex> -m M -l L -n HOSTNQN` (nvme-cli 2.3): with -m 1..3 it writes the key already
# transformed, HMAC(secret, HOSTNQN || "NVMe-over-Fabrics"), so these are vectors for Secret.transformed too
S32 = bytes(range(32))
S48 = bytes(range(100, 148))
S64 = bytes(range(200, 256)) + bytes(range(8))
NVME_CLI = {
    (S32, 0): "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
    (S32, 1): "DHHC-1:01:5vxYBh5q8aC18ZmEQ1U/rZHUSIsXL0hdWYJ43Cx7n7THwj6G:",
    (S48, 2): "DHHC-1:02:JSiSVrQ82kgD9rjDYo7yIyEdn7jXeDqnOC/FysEgM/Gjw1d/0X81eQyCbJn27DUQ4t4Mww==:",
    (S64, 3): "DHHC-1:03:1Jn+U+Zw5266s9ic9oUNQ5IA6oJV3dNmK9DVF1bDZe7Wl4Clf0aqHTyb793MR+GBmV/9iOJe+PO7peVqStlZUZqnZ/w=:",
    (S64, 0): "DHHC-1:00:yMnKy8zNzs/Q0dLT1NXW19jZ2tvc3d7f4OHi4+Tl5ufo6err7O3u7/Dx8vP09fb3+Pn6+/z9/v8AAQIDBAUGB24FqBs=:",
}
HOST_SECRET = NVME_CLI[(S32, 0)]
CTRL_SECRET = NVME_CLI[(S64, 0)]


# --- secrets ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "transform"), list(NVME_CLI))
def test_nvme_cli_secrets(raw: bytes, transform: int) -> None:
    s = A.parse_secret(NVME_CLI[(raw, transform)])
    assert s.transform == transform
    if transform == 0:
        assert s.key == raw
    else:
        # what nvme-cli stored is our transform of the secret it was given, with the host NQN
        assert A.Secret(raw, transform).transformed(HOSTNQN) == s.key
    assert A.format_secret(s) == NVME_CLI[(raw, transform)]
    assert s.transformed(SUBNQN) == (raw if transform == 0 else hmac.new(
        s.key, SUBNQN.encode() + b"NVMe-over-Fabrics", ("sha256", "sha384", "sha512")[transform - 1]).digest())


def _dhhc(key: bytes, nn: str = "00", crc: int | None = None) -> str:
    c = zlib.crc32(key) if crc is None else crc
    return f"DHHC-1:{nn}:{base64.b64encode(key + c.to_bytes(4, 'little')).decode()}:"


@pytest.mark.parametrize(("text", "why"), [
    ("", "not a DHHC-1 secret"),
    ("DHHC-2:00:AAAA:", "not a DHHC-1 secret"),
    (NVME_CLI[(S32, 0)][:-1], "not a DHHC-1 secret"),                 # the trailing colon
    (_dhhc(S32, "04"), "unknown key transform '04'"),
    (_dhhc(S32, "1"), "unknown key transform '1'"),
    ("DHHC-1:00:not*base64!:", "not valid base64"),
    (_dhhc(bytes(16)), "the key is 16 bytes; use 32, 48 or 64"),
    (_dhhc(bytes(40)), "the key is 40 bytes; use 32, 48 or 64"),
    (_dhhc(S32, crc=zlib.crc32(S32) ^ 1), "CRC-32 does not match"),
    (_dhhc(S32, "02"), "too short for transform 02"),
])
def test_bad_secrets(text: str, why: str) -> None:
    with pytest.raises(A.SecretError) as e:
        A.parse_secret(text)
    assert why in str(e.value)
    if len(text) > 20:
        assert text.split(":")[2] not in str(e.value)       # never the secret itself


def test_secret_repr_hides_the_key() -> None:
    s = A.parse_secret(HOST_SECRET)
    assert S32.hex() not in repr(s) and repr(S32) not in repr(s) and "32 bytes" in repr(s)
    policy = A.HostPolicy(s)
    assert S32.hex() not in repr(policy) and repr(S32) not in repr(policy)


# --- RFC 7919 groups -------------------------------------------------------------------------------------
def test_ffdhe_primes_are_openssls() -> None:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is missing: apt-get install openssl", pytrace=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # `cryptography` deprecates FFDH; NVMe names RFC 7919
        from cryptography.hazmat.primitives.serialization import load_pem_parameters
    for g in A.DH_GROUPS.values():
        if not g.bits:
            continue
        pem = subprocess.run(["openssl", "genpkey", "-genparam", "-algorithm", "DH", "-pkeyopt",
                              f"group:{g.name}"], capture_output=True, check=True).stdout
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # `cryptography` deprecates FFDH; NVMe names RFC 7919
            numbers = load_pem_parameters(pem).parameter_numbers()
        assert (numbers.p, numbers.g) == (g.prime, 2), g.name
        assert g.prime.bit_length() == g.bits == g.size * 8


def test_ffdhe2048_is_a_safe_prime() -> None:
    p = A.DH_GROUPS["ffdhe2048"].prime
    assert hex(p).startswith("0xffffffffffffffffadf85458a2bb4a9a") and hex(p).endswith("ffffffffffffffff")
    for n in (p, (p - 1) // 2):          # Fermat to a few bases: a composite this size fails at once
        assert all(pow(b, n - 1, n) == 1 for b in (2, 3, 5, 7))


def test_dh_exchange_is_gxy_mod_p() -> None:
    g = A.DH_GROUPS["ffdhe3072"]
    a, b = A.DhKey(g), A.DhKey(g)
    assert len(a.public) == g.size == 384
    sa, sb = a.shared(b.public), b.shared(a.public)
    assert sa == sb and len(sa) == g.size
    x = a._key.private_numbers().x
    assert int.from_bytes(sa, "big") == pow(int.from_bytes(b.public, "big"), x, g.prime)
    assert int.from_bytes(a.public, "big") == pow(2, x, g.prime)
    for bad in (bytes(g.size), (1).to_bytes(g.size, "big"), (g.prime - 1).to_bytes(g.size, "big"), b.public[1:]):
        with pytest.raises(ValueError):
            a.shared(bad)


# --- messages --------------------------------------------------------------------------------------------
def test_negotiate_layout() -> None:
    # Base 2.0 Figure 532 / Linux struct nvmf_auth_dhchap_negotiate_data: 8-byte header, one 64-byte descriptor
    b = A.Negotiate(0x1234, (1, 2, 3), (0, 1, 2, 3, 4, 5)).pack()
    assert len(b) == 72
    assert b[:8] == bytes([0x00, 0x00, 0, 0, 0x34, 0x12, 0x00, 0x01])
    assert b[8:12] == bytes([0x01, 0, 3, 6])
    assert b[12:15] == bytes([1, 2, 3]) and b[15:42] == bytes(27)
    assert b[42:48] == bytes([0, 1, 2, 3, 4, 5]) and b[48:72] == bytes(24)
    assert A.unpack_message(b) == A.Negotiate(0x1234, (1, 2, 3), (0, 1, 2, 3, 4, 5))


@pytest.mark.parametrize("msg", [
    A.Challenge(7, 2, 0xDEADBEEF, bytes(range(48)), 1, bytes(256)),
    A.Challenge(7, 1, 1, bytes(32)),
    A.Reply(7, bytes(range(32)), 0, None, b""),
    A.Reply(7, bytes(range(64)), 99, bytes(64), bytes(range(256))),
    A.Success1(7, 32, None),
    A.Success1(7, 48, bytes(range(48))),
    A.Success2(7),
    A.Failure(7, A.FAILED),
    A.Failure(7, A.INCORRECT_MESSAGE, first=False),
])
def test_message_roundtrip(msg: A.Message) -> None:
    b = msg.pack()
    assert A.unpack_message(b) == msg
    assert A.unpack_message(b + bytes(40)) == msg          # AUTH_Receive data is padded to AL


def test_message_sizes_and_fields() -> None:
    c = A.Challenge(0x0102, 3, 0x0A0B0C0D, b"\xcc" * 64, 5, b"\xdd" * 1024).pack()
    assert len(c) == 16 + 64 + 1024
    assert c[:16] == bytes([0x01, 0x01, 0, 0, 0x02, 0x01, 64, 0, 3, 5]) + struct.pack("<HI", 1024, 0x0A0B0C0D)
    r = A.Reply(0x0102, b"\xaa" * 32, 5, b"\xbb" * 32, b"\xee" * 256).pack()
    assert r[:16] == bytes([0x01, 0x02, 0, 0, 0x02, 0x01, 32, 0, 1, 0]) + struct.pack("<HI", 256, 5)
    assert r[16:48] == b"\xaa" * 32 and r[48:80] == b"\xbb" * 32 and r[80:] == b"\xee" * 256
    assert A.Reply(1, b"\xaa" * 32).pack()[48:80] == bytes(32)   # no C2: zeros where it would be, CVALID 0
    assert len(A.Success1(1, 32).pack()) == 16 and len(A.Success1(1, 32, bytes(32)).pack()) == 48
    assert A.Success2(9).pack() == bytes([0x01, 0x04, 0, 0, 9, 0]) + bytes(10)
    assert A.Failure(9, 6).pack() == bytes([0x00, 0xF1, 0, 0, 9, 0, 0x01, 0x06])


@pytest.mark.parametrize(("b", "explanation"), [
    (b"\x00", A.INCORRECT_PAYLOAD),
    (bytes([0x02, 0x00]) + bytes(6), A.INCORRECT_MESSAGE),
    (bytes([0x01, 0x09]) + bytes(6), A.INCORRECT_MESSAGE),
    (A.Negotiate(1, (1,), (0,)).pack()[:40], A.INCORRECT_PAYLOAD),
    (A.Negotiate(1, (1,), (0,)).pack()[:7] + b"\x02" + A.Negotiate(1, (1,), (0,)).pack()[8:], A.NOT_USABLE),
    (A.Reply(1, bytes(32)).pack()[:60], A.INCORRECT_PAYLOAD),
    (A.Reply(1, bytes(32), dhv=bytes(256)).pack()[:-1], A.INCORRECT_PAYLOAD),
    (A.Challenge(1, 1, 1, bytes(32)).pack()[:20], A.INCORRECT_PAYLOAD),
])
def test_bad_messages(b: bytes, explanation: int) -> None:
    with pytest.raises(A.AuthPayloadError) as e:
        A.unpack_message(b)
    assert e.value.explanation == explanation


# --- transactions ----------------------------------------------------------------------------------------
def send_sqe(data: bytes, *, secp: int = A.SECP_DHCHAP, spsp: int = 0x0101, tl: int | None = None) -> Sqe:
    cdw10 = (spsp << 8) | (secp << 24)
    return Sqe(HC.fabrics(A.FCTYPE_AUTH_SEND, 1, cdw10=cdw10, cdw11=len(data) if tl is None else tl,
                          data_len=len(data), in_capsule=True))


def recv_sqe(al: int = 4096, *, secp: int = A.SECP_DHCHAP) -> Sqe:
    return Sqe(HC.fabrics(A.FCTYPE_AUTH_RECEIVE, 2, cdw10=(0x0101 << 8) | (secp << 24), cdw11=al, data_len=al))


def send(ctrl: A.ControllerAuth, data: bytes) -> None:
    assert ctrl.send(send_sqe(data), data) == S.SUCCESS


def receive(ctrl: A.ControllerAuth, al: int = 4096) -> bytes:
    status, out = ctrl.receive(recv_sqe(al))
    assert status == S.SUCCESS and len(out) == al
    return out


def pair(host_secret: str = HOST_SECRET, ctrl_secret: str | None = None, *, host_ctrl_secret: str | None = None,
         hashes: tuple[str, ...] = tuple(A.HASHES), dhgroups: tuple[str, ...] = tuple(A.DH_GROUPS),
         host_hashes: tuple[str, ...] = tuple(A.HASHES),
         host_dhgroups: tuple[str, ...] = tuple(A.DH_GROUPS)) -> tuple[A.ControllerAuth, A.HostAuth]:
    policy = A.HostPolicy(A.parse_secret(HOST_SECRET), A.parse_secret(ctrl_secret) if ctrl_secret else None,
                          hashes, dhgroups)
    ctrl = A.ControllerAuth(policy, HOSTNQN, SUBNQN)
    hk = host_ctrl_secret if host_ctrl_secret is not None else ctrl_secret
    host = A.HostAuth(HOSTNQN, SUBNQN, A.parse_secret(host_secret), A.parse_secret(hk) if hk else None,
                      hashes=host_hashes, dhgroups=host_dhgroups, t_id=0x2A)
    return ctrl, host


def run(ctrl: A.ControllerAuth, host: A.HostAuth) -> None:
    """The message order of the Linux host (drivers/nvme/host/auth.c)."""
    send(ctrl, host.negotiate())
    send(ctrl, host.challenge(receive(ctrl)))
    s2 = host.success1(receive(ctrl))
    if s2 is not None:
        send(ctrl, s2)


@pytest.mark.parametrize("dhgroup", list(A.DH_GROUPS))
@pytest.mark.parametrize("hash_name", list(A.HASHES))
def test_unidirectional(hash_name: str, dhgroup: str) -> None:
    ctrl, host = pair(hashes=(hash_name,), dhgroups=(dhgroup,))
    run(ctrl, host)
    assert ctrl.authenticated and not ctrl.failed and not ctrl.bidirectional
    assert ctrl.hash is not None and ctrl.hash.name == hash_name and ctrl.group.name == dhgroup


@pytest.mark.parametrize(("hash_name", "dhgroup"), [("sha256", "null"), ("sha384", "ffdhe2048"),
                                                    ("sha512", "ffdhe8192")])
def test_bidirectional(hash_name: str, dhgroup: str) -> None:
    ctrl, host = pair(ctrl_secret=CTRL_SECRET, hashes=(hash_name,), dhgroups=(dhgroup,))
    send(ctrl, host.negotiate())
    send(ctrl, host.challenge(receive(ctrl)))
    s1 = receive(ctrl)
    assert not ctrl.authenticated                     # not before the host has checked the controller
    s2 = host.success1(s1)
    assert s2 is not None
    send(ctrl, s2)
    assert ctrl.authenticated and ctrl.bidirectional


@pytest.mark.parametrize("raw_transform", [(S32, 1), (S48, 2), (S64, 3)])
def test_transformed_secrets(raw_transform: tuple[bytes, int]) -> None:
    secret = NVME_CLI[raw_transform]
    policy = A.HostPolicy(A.parse_secret(secret), A.parse_secret(NVME_CLI[(S32, 0)]))
    ctrl = A.ControllerAuth(policy, HOSTNQN, SUBNQN)
    run(ctrl, A.HostAuth(HOSTNQN, SUBNQN, A.parse_secret(secret), A.parse_secret(NVME_CLI[(S32, 0)])))
    assert ctrl.authenticated
    # the same key bytes with no transform are another secret
    ctrl = A.ControllerAuth(policy, HOSTNQN, SUBNQN)
    with pytest.raises(A.AuthFailed, match="authentication failed"):
        run(ctrl, A.HostAuth(HOSTNQN, SUBNQN, A.Secret(A.parse_secret(secret).key, 0)))
    assert ctrl.failed and not ctrl.authenticated


def test_responses_follow_the_spec_formulas() -> None:
    """R1 and R2 computed here from §8.13.5.4-5 with hmac/hashlib alone, on the bytes that crossed."""
    ctrl, host = pair(ctrl_secret=CTRL_SECRET, hashes=("sha256",), dhgroups=("ffdhe2048",))
    send(ctrl, host.negotiate())
    ch = receive(ctrl)
    c1, s1, dh_ctrl = ch[16:48], struct.unpack_from("<I", ch, 12)[0], ch[48:48 + 256]
    rep = host.challenge(ch)
    r1, c2, s2, dh_host = rep[16:48], rep[48:80], struct.unpack_from("<I", rep, 12)[0], rep[80:80 + 256]
    p = A.DH_GROUPS["ffdhe2048"].prime
    x = ctrl._key._key.private_numbers().x if ctrl._key else 0
    ks = pow(int.from_bytes(dh_host, "big"), x, p).to_bytes(256, "big")
    assert pow(2, x, p).to_bytes(256, "big") == dh_ctrl
    hk = hashlib.sha256(ks).digest()
    ca1 = hmac.new(hk, c1, "sha256").digest()
    tid = struct.pack("<H", 0x2A)
    want_r1 = hmac.new(S32, ca1 + struct.pack("<I", s1) + tid + b"\0" + b"HostHost" + HOSTNQN.encode() + b"\0"
                       + SUBNQN.encode(), "sha256").digest()
    assert r1 == want_r1
    send(ctrl, rep)
    s1msg = receive(ctrl)
    assert s1msg[8] == 1                               # RVALID
    ca2 = hmac.new(hk, c2, "sha256").digest()
    want_r2 = hmac.new(S64, ca2 + struct.pack("<I", s2) + tid + b"\0" + b"Controller" + SUBNQN.encode() + b"\0"
                       + HOSTNQN.encode(), "sha256").digest()
    assert s1msg[16:48] == want_r2


def test_wrong_host_secret_gets_failure1() -> None:
    ctrl, host = pair(host_secret=NVME_CLI[(S64, 0)])
    send(ctrl, host.negotiate())
    send(ctrl, host.challenge(receive(ctrl)))
    assert not ctrl.failed and ctrl.step == A.FAILURE1
    out = receive(ctrl, 64)
    assert out[:8] == bytes([0x00, 0xF1, 0, 0, 0x2A, 0, A.REASON_FAILED, A.FAILED]) and out[8:] == bytes(56)
    assert ctrl.failed and not ctrl.authenticated
    with pytest.raises(A.AuthFailed, match="authentication failed"):
        host.success1(out)


def test_wrong_controller_secret_seen_by_the_host() -> None:
    ctrl, host = pair(ctrl_secret=CTRL_SECRET, host_ctrl_secret=NVME_CLI[(S32, 1)])
    send(ctrl, host.negotiate())
    send(ctrl, host.challenge(receive(ctrl)))
    with pytest.raises(A.AuthFailed, match="did not prove"):
        host.success1(receive(ctrl))
    assert host.failure2 is not None
    send(ctrl, host.failure2)
    assert ctrl.failed and not ctrl.authenticated


def test_bidirectional_without_a_controller_secret_fails() -> None:
    ctrl, host = pair(host_ctrl_secret=CTRL_SECRET)
    send(ctrl, host.negotiate())
    send(ctrl, host.challenge(receive(ctrl)))
    assert ctrl.step == A.FAILURE1 and ctrl.explanation == A.FAILED


@pytest.mark.parametrize(("kw", "explanation"), [
    ({"hashes": ("sha512",), "host_hashes": ("sha256", "sha384")}, A.HASH_UNUSABLE),
    ({"dhgroups": ("ffdhe4096",), "host_dhgroups": ("null", "ffdhe2048")}, A.DHGROUP_UNUSABLE),
])
def test_nothing_in_common(kw: dict[str, Any], explanation: int) -> None:
    ctrl, host = pair(**kw)
    send(ctrl, host.negotiate())
    out = receive(ctrl)
    assert out[1] == A.FAILURE1 and out[7] == explanation and ctrl.failed


def test_controller_preference_wins() -> None:
    ctrl, host = pair(hashes=("sha384", "sha256"), dhgroups=("ffdhe3072", "null"))
    send(ctrl, host.negotiate())
    ch = A.unpack_message(receive(ctrl))
    assert isinstance(ch, A.Challenge) and (ch.hash_id, ch.dhgid, len(ch.dhv)) == (2, 2, 384)


def test_secure_channel_concatenation_is_refused() -> None:
    ctrl, _ = pair()
    send(ctrl, A.Negotiate(1, (1,), (0,), sc_c=1).pack())
    out = receive(ctrl)
    assert out[1] == A.FAILURE1 and out[7] == A.CONCAT_MISMATCH


def test_out_of_order_and_wrong_transaction() -> None:
    ctrl, host = pair()
    send(ctrl, A.Reply(0x2A, bytes(32)).pack())                     # a Reply before any Negotiate
    assert ctrl.step == A.FAILURE1 and ctrl.explanation == A.INCORRECT_MESSAGE
    send(ctrl, host.negotiate())                                   # a Negotiate starts afresh
    reply = host.challenge(receive(ctrl))
    send(ctrl, reply[:4] + b"\x2b\x00" + reply[6:])             # T_ID 2Bh, not the Negotiate's 2Ah
    assert ctrl.step == A.FAILURE1 and ctrl.explanation == A.INCORRECT_PAYLOAD
    ctrl, host = pair()
    send(ctrl, host.negotiate())
    assert ctrl.receive(recv_sqe())[0] == S.SUCCESS
    status, out = ctrl.receive(recv_sqe())                         # a second AUTH_Receive, no Reply between
    assert status == S.SUCCESS and out[1] == A.FAILURE1 and out[7] == A.INCORRECT_MESSAGE and ctrl.failed


def test_replayed_reply_after_success_is_refused() -> None:
    ctrl, host = pair()
    send(ctrl, host.negotiate())
    reply = host.challenge(receive(ctrl))
    send(ctrl, reply)
    receive(ctrl)
    assert ctrl.authenticated
    send(ctrl, reply)
    assert ctrl.step == A.FAILURE1


def test_bad_dh_values() -> None:
    g = A.DH_GROUPS["ffdhe2048"]
    for bad in (bytes(g.size), (g.prime - 1).to_bytes(g.size, "big"), bytes(8)):
        ctrl, host = pair(dhgroups=("ffdhe2048",))
        send(ctrl, host.negotiate())
        rep = A.Reply.unpack(host.challenge(receive(ctrl)))
        rep.dhv = bad
        send(ctrl, rep.pack())
        assert ctrl.step == A.FAILURE1 and ctrl.explanation == A.DHGROUP_UNUSABLE
    ctrl, host = pair(dhgroups=("ffdhe2048",))
    send(ctrl, host.negotiate())
    rep = A.Reply.unpack(host.challenge(receive(ctrl)))
    rep.dhv = b""
    send(ctrl, rep.pack())
    assert ctrl.explanation == A.INCORRECT_PAYLOAD


def test_command_fields() -> None:
    ctrl, host = pair()
    neg = host.negotiate()
    assert ctrl.send(send_sqe(neg, secp=0xEA), neg) == S.INVALID_FIELD
    assert ctrl.send(send_sqe(neg, spsp=0x0201), neg) == S.INVALID_FIELD
    assert ctrl.send(send_sqe(neg, tl=0), neg) == S.INVALID_FIELD
    assert ctrl.send(send_sqe(neg, tl=len(neg) + 1), neg) == S.DATA_SGL_LENGTH_INVALID
    assert ctrl.receive(recv_sqe(secp=0)) == (S.INVALID_FIELD, b"")
    assert ctrl.receive(recv_sqe(0)) == (S.INVALID_FIELD, b"")
    assert ctrl.step == A.NEGOTIATE and not ctrl.failed      # none of these touched the transaction
    send(ctrl, neg)
    assert ctrl.receive(recv_sqe(20))[0] == S.INVALID_FIELD  # AL too small for the challenge
    assert ctrl.step == A.CHALLENGE
    assert len(receive(ctrl, 200)) == 200


# --- the fabric: who must authenticate ---------------------------------------------------------------------
def _fabric(**kw: Any) -> Fabric:
    sub = Subsystem(SUBNQN, [], **kw)
    return Fabric([sub], {}, clock=lambda: 0.0)


def _connect(fabric: Fabric, hostnqn: str, qid: int = 0, cntlid: int = 0xFFFF) -> Any:
    sqe = Sqe(HC.connect(1, qid, 32, 0))
    return fabric.connect(sqe, HC.connect_data(b"h" * 16, cntlid, SUBNQN, hostnqn))


def test_connect_asks_listed_hosts_to_authenticate() -> None:
    other = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
    policy = A.HostPolicy(A.parse_secret(HOST_SECRET))
    fabric = _fabric(dhchap_hosts={HOSTNQN: policy})
    r = _connect(fabric, HOSTNQN)
    assert r.completion.status == S.SUCCESS and r.completion.dw0 & A.CONNECT_ATR and r.auth is not None
    assert r.completion.dw0 & 0xFFFF == r.controller.cntlid
    r.controller.csts = 1                                           # enabled: I/O queues may join
    io = _connect(fabric, HOSTNQN, 1, r.controller.cntlid)
    assert io.completion.dw0 & A.CONNECT_ATR and io.auth is not None and io.auth is not r.auth
    # with secrets configured and no allowed_hosts, a host without one is refused
    assert _connect(fabric, other).completion.status == S.CONNECT_INVALID_HOST
    # allowed_hosts names it: it connects, without authentication
    fabric = _fabric(dhchap_hosts={HOSTNQN: policy}, allowed_hosts=[other])
    r = _connect(fabric, other)
    assert r.completion.status == S.SUCCESS and not r.completion.dw0 & A.CONNECT_ATR and r.auth is None
    assert _connect(fabric, HOSTNQN).auth is not None
    assert _connect(_fabric(), other).auth is None                 # no secrets anywhere: as before


# --- config ------------------------------------------------------------------------------------------------
def nvme_cfg(**patch: Any) -> dict[str, Any]:
    sub = {"nqn": SUBNQN, "namespaces": [{"nsid": 1, "volume": "disk0"}],
           "hosts": [{"nqn": HOSTNQN, "dhchap_secret": HOST_SECRET, "dhchap_ctrl_secret": CTRL_SECRET}]}
    sub.update(patch)
    return {"devices": [{"name": "ram0", "type": "ram", "size": "1MiB"}],
            "volumes": [{"name": "disk0", "device": "ram0"}],
            "nvme": {"portals": ["127.0.0.1:4420"], "subsystems": [sub]}}


def test_config_hosts() -> None:
    c = parse_config(nvme_cfg(dhchap_hashes=["sha512", "sha256"], dhchap_dhgroups=["ffdhe4096"]))
    assert c.nvme is not None
    (sub,) = c.nvme.subsystems
    (h,) = sub.hosts
    assert (h.nqn, h.dhchap_secret, h.dhchap_ctrl_secret) == (HOSTNQN, HOST_SECRET, CTRL_SECRET)
    assert sub.dhchap_hashes == ("sha512", "sha256") and sub.dhchap_dhgroups == ("ffdhe4096",)
    c = parse_config(nvme_cfg(hosts=[{"nqn": HOSTNQN, "dhchap_secret": HOST_SECRET}]))
    assert c.nvme is not None
    assert c.nvme.subsystems[0].hosts[0].dhchap_ctrl_secret is None
    assert c.nvme.subsystems[0].dhchap_hashes == ("sha256", "sha384", "sha512")


def config_error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


P = "nvme.subsystems[0]"


@pytest.mark.parametrize(("patch", "want"), [
    ({"hosts": [{"nqn": HOSTNQN, "dhchap_secret": _dhhc(S32, crc=1)}]},
     f"{P}.hosts[0].dhchap_secret: the key's CRC-32 does not match"),
    ({"hosts": [{"nqn": HOSTNQN, "dhchap_secret": "secret"}]}, f"{P}.hosts[0].dhchap_secret: not a DHHC-1 secret"),
    ({"hosts": [{"nqn": HOSTNQN, "dhchap_secret": 12345}]}, f"{P}.hosts[0].dhchap_secret: expected a string"),
    ({"hosts": [{"nqn": HOSTNQN}]}, f"{P}.hosts[0].dhchap_secret: missing; add dhchap_secret"),
    ({"hosts": [{"dhchap_secret": HOST_SECRET}]}, f"{P}.hosts[0].nqn: missing"),
    ({"hosts": [{"nqn": "host1", "dhchap_secret": HOST_SECRET}]}, f"{P}.hosts[0].nqn: 'host1' is not an NQN"),
    ({"hosts": [{"nqn": HOSTNQN, "dhchap_secret": HOST_SECRET, "dhchap_ctrl_secret": _dhhc(bytes(20))}]},
     f"{P}.hosts[0].dhchap_ctrl_secret: the key is 20 bytes"),
    ({"hosts": [{"nqn": HOSTNQN, "dhchap_secret": HOST_SECRET, "dhchap_ctrl_secret": HOST_SECRET}]},
     f"{P}.hosts[0].dhchap_ctrl_secret: the same key as dhchap_secret"),
    ({"hosts": [{"nqn": HOSTNQN, "dhchap_secret": HOST_SECRET, "dhchap_secert": "x"}]},
     f'{P}.hosts[0].dhchap_secert: unknown key; did you mean "dhchap_secret"'),
    ({"hosts": [{"nqn": HOSTNQN, "dhchap_secret": HOST_SECRET}] * 2}, f"{P}.hosts[1].nqn: host"),
    ({"hosts": ["x"]}, f"{P}.hosts[0]: expected a table"),
    ({"dhchap_hashes": ["md5"]}, f'{P}.dhchap_hashes[0]: "md5" is not one of the hash functions: sha256'),
    ({"dhchap_hashes": []}, f"{P}.dhchap_hashes: empty"),
    ({"dhchap_dhgroups": ["null", "null"]}, f'{P}.dhchap_dhgroups[1]: "null" is listed twice'),
    ({"dhchap_dhgroups": ["modp2048"]}, f'{P}.dhchap_dhgroups[0]: "modp2048" is not one of the DH groups'),
])
def test_config_errors(patch: dict[str, Any], want: str) -> None:
    msg = config_error(nvme_cfg(**patch))
    assert want in msg, msg
    for secret in (HOST_SECRET, CTRL_SECRET):
        assert secret.split(":")[2] not in msg
