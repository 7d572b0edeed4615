"""NBD over TLS (proto.md "TLS support"): the sans-IO connection driven with byte strings (there,
`tls_started()` stands for the driver's handshake having succeeded), the credentials, and the [nbd] tls config
with its preflight. The asyncio NbdServer with a real TLS client is in tests/integration/test_nbd_tls_server.py.
"""

from __future__ import annotations

import ssl
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_nbd_codec import go_data, meta_data, option, option_replies, sent
from tls_pki import Pki, make_pki

from openvsan.block import RamDevice
from openvsan.frontend.config import NbdExportConfig
from openvsan.frontend.nbd import NbdServer, TlsCredentialError, tls_context
from openvsan.node.config import ConfigError, parse_config, preflight
from openvsan.protocol.nbd import (
    Close,
    ExportInfo,
    NbdServerConnection,
    Negotiated,
    Phase,
    StartTls,
)
from openvsan.protocol.nbd.handshake import TlsMode
from openvsan.protocol.nbd.wire import Info, Opt, Rep
from openvsan.volume import Volume

MiB = 1 << 20
OPEN = ExportInfo("open", 8 * MiB, min_block=512)
SECRET = ExportInfo("secret", 16 * MiB, min_block=512)
# every option a client can send before TLS, with data that would be valid
OPTIONS = [
    (Opt.LIST, b""),
    (Opt.INFO, go_data("secret")),
    (Opt.GO, go_data("secret")),
    (Opt.STRUCTURED_REPLY, b""),
    (Opt.LIST_META_CONTEXT, meta_data("secret")),
    (Opt.SET_META_CONTEXT, meta_data("secret", "base:allocation")),
    (Opt.EXTENDED_HEADERS, b""),
    (Opt.PEEK_EXPORT, b""),
    (99, b""),
]


def connect(*exports: ExportInfo, tls_only: tuple[str, ...] = (), offered: bool = True,
            flags: int = 3) -> NbdServerConnection:
    c = NbdServerConnection(list(exports), tls_offered=offered, tls_only=tls_only)
    c.greeting()
    assert c.receive_data(struct.pack(">I", flags)) == []
    return c


def reply_types(c: NbdServerConnection, opt: int, data: bytes = b"") -> list[int]:
    return [r[1] for r in option_replies(sent(c.receive_data(option(opt, data))))]


def starttls(c: NbdServerConnection) -> None:
    events = c.receive_data(option(Opt.STARTTLS))
    # the ACK is queued first, then the driver is told to start the handshake; nothing else happens
    assert [type(e).__name__ for e in events] == ["Send", "StartTls"]
    assert option_replies(sent(events)) == [(Opt.STARTTLS, Rep.ACK, b"")]
    assert c.phase is Phase.TLS and not c.tls
    c.tls_started()
    assert c.tls and c.phase is Phase.OPTION_HEADER


def listed(c: NbdServerConnection) -> list[bytes]:
    replies = option_replies(sent(c.receive_data(option(Opt.LIST))))
    assert replies[-1][1] == Rep.ACK
    return [d[4:4 + struct.unpack_from(">I", d)[0]] for _, rep, d in replies if rep == Rep.SERVER]


# --- NOTLS ------------------------------------------------------------------------------------------
def test_no_tls_credentials_starttls_is_policy_and_never_tls_reqd() -> None:
    c = connect(OPEN, offered=False)
    assert c.handshake.mode is TlsMode.NOTLS
    replies = option_replies(sent(c.receive_data(option(Opt.STARTTLS))))
    assert [r[1] for r in replies] == [Rep.ERR_POLICY] and b"does not offer TLS" in replies[0][2]
    for opt, data in OPTIONS:
        assert Rep.ERR_TLS_REQD not in reply_types(c, opt, data), opt
    assert c.phase is Phase.OPTION_HEADER


def test_tls_only_exports_need_credentials() -> None:
    with pytest.raises(ValueError, match="offers TLS"):
        NbdServerConnection([SECRET], tls_only=["secret"])
    with pytest.raises(ValueError, match="not exports"):
        NbdServerConnection([OPEN], tls_offered=True, tls_only=["nope"])


def test_without_fixed_newstyle_tls_only_exports_stay_closed() -> None:
    # proto.md: NOTLS mode unless both ends agreed fixed newstyle; then no TLS_REQD, but no way in either
    c = connect(OPEN, SECRET, tls_only=("secret",), flags=0)
    assert c.handshake.mode is TlsMode.NOTLS
    assert reply_types(c, Opt.STARTTLS) == [Rep.ERR_POLICY]
    assert listed(c) == [b"open"]
    assert reply_types(c, Opt.GO, go_data("secret")) == [Rep.ERR_POLICY]
    (close,) = [e for e in c.receive_data(option(Opt.EXPORT_NAME, b"secret")) if isinstance(e, Close)]
    assert "requires TLS" in close.reason and c.phase is Phase.DONE


# --- FORCEDTLS --------------------------------------------------------------------------------------
def test_forced_tls_every_option_but_starttls_and_abort_is_tls_reqd() -> None:
    c = connect(SECRET, tls_only=("secret",))
    assert c.handshake.mode is TlsMode.FORCEDTLS
    for opt, data in OPTIONS:
        replies = option_replies(sent(c.receive_data(option(opt, data))))
        # no NBD_REP_INFO or NBD_REP_SERVER leaks out first: one error, nothing else
        assert [r[1] for r in replies] == [Rep.ERR_TLS_REQD], opt
        assert b"STARTTLS" in replies[0][2]
    assert c.phase is Phase.OPTION_HEADER and not c.handshake.structured
    starttls(c)
    assert listed(c) == [b"secret"]
    neg = [e for e in c.receive_data(option(Opt.GO, go_data("secret"))) if isinstance(e, Negotiated)]
    assert neg and neg[0].export is SECRET and neg[0].tls


def test_forced_tls_export_name_before_tls_closes() -> None:
    c = connect(SECRET, tls_only=("secret",))
    events = c.receive_data(option(Opt.EXPORT_NAME, b"secret"))
    # proto.md "FORCEDTLS mode": NBD_OPT_EXPORT_NAME cannot error, so the session ends with no reply
    assert sent(events) == b"" and len(events) == 1 and isinstance(events[0], Close)
    assert "requires TLS" in events[0].reason and c.phase is Phase.DONE


def test_forced_tls_abort_is_acked() -> None:
    c = connect(SECRET, tls_only=("secret",))
    assert reply_types(c, Opt.ABORT) == [Rep.ACK] and c.phase is Phase.DONE


def test_export_name_inside_tls() -> None:
    c = connect(SECRET, tls_only=("secret",))
    starttls(c)
    (neg,) = [e for e in c.receive_data(option(Opt.EXPORT_NAME, b"")) if isinstance(e, Negotiated)]
    assert neg.export is SECRET and neg.tls and c.phase is Phase.REQUEST


# --- SELECTIVETLS -----------------------------------------------------------------------------------
def test_selective_tls_hides_and_refuses_tls_only_exports_until_tls() -> None:
    c = connect(OPEN, SECRET, tls_only=("secret",))
    assert c.handshake.mode is TlsMode.SELECTIVETLS
    assert listed(c) == [b"open"]
    for opt in (Opt.INFO, Opt.GO):
        replies = option_replies(sent(c.receive_data(option(opt, go_data("secret", Info.NAME)))))
        assert [r[1] for r in replies] == [Rep.ERR_TLS_REQD] and b"secret" in replies[0][2]
    assert reply_types(c, Opt.STRUCTURED_REPLY) == [Rep.ACK]
    # proto.md: TLS_REQD only for INFO, GO and EXPORT_NAME; a meta context query on it is refused otherwise
    assert reply_types(c, Opt.SET_META_CONTEXT, meta_data("secret", "base:allocation")) == [Rep.ERR_POLICY]
    assert reply_types(c, Opt.LIST_META_CONTEXT, meta_data("open")) == [Rep.META_CONTEXT, Rep.ACK]
    # an unknown export stays unknown, and the open export works in clear text
    assert reply_types(c, Opt.INFO, go_data("nope")) == [Rep.ERR_UNKNOWN]
    assert Rep.ERR_TLS_REQD not in reply_types(c, Opt.INFO, go_data("open"))
    starttls(c)
    assert listed(c) == [b"open", b"secret"]
    assert reply_types(c, Opt.INFO, go_data("secret")) == [Rep.INFO, Rep.INFO, Rep.ACK]


def test_selective_tls_export_name_on_tls_only_export_closes() -> None:
    c = connect(OPEN, SECRET, tls_only=("secret",))
    (close,) = c.receive_data(option(Opt.EXPORT_NAME, b"secret"))
    assert isinstance(close, Close) and "requires TLS" in close.reason


def test_selective_tls_open_export_in_clear_text_then_over_tls() -> None:
    c = connect(OPEN, SECRET, tls_only=("secret",))
    (neg,) = [e for e in c.receive_data(option(Opt.GO, go_data("open"))) if isinstance(e, Negotiated)]
    assert neg.export is OPEN and not neg.tls
    c = connect(OPEN, SECRET, tls_only=("secret",))
    starttls(c)
    (neg,) = [e for e in c.receive_data(option(Opt.GO, go_data("open"))) if isinstance(e, Negotiated)]
    assert neg.export is OPEN and neg.tls


def test_optional_tls_on_every_export_is_selective() -> None:
    c = connect(OPEN, SECRET)
    assert c.handshake.mode is TlsMode.SELECTIVETLS
    assert listed(c) == [b"open", b"secret"]
    starttls(c)
    assert listed(c) == [b"open", b"secret"]


# --- STARTTLS itself --------------------------------------------------------------------------------
def test_starttls_inside_tls_is_invalid_and_never_tls_reqd() -> None:
    c = connect(SECRET, tls_only=("secret",))
    starttls(c)
    replies = option_replies(sent(c.receive_data(option(Opt.STARTTLS))))
    assert [r[1] for r in replies] == [Rep.ERR_INVALID] and b"already" in replies[0][2]
    for opt, data in OPTIONS:
        assert Rep.ERR_TLS_REQD not in reply_types(c, opt, data), opt


def test_starttls_with_data_is_invalid() -> None:
    c = connect(SECRET, tls_only=("secret",))
    events = c.receive_data(option(Opt.STARTTLS, b"x"))
    assert [r[1] for r in option_replies(sent(events))] == [Rep.ERR_INVALID]
    assert not any(isinstance(e, StartTls) for e in events) and c.phase is Phase.OPTION_HEADER


def test_state_from_before_tls_is_forgotten() -> None:
    # proto.md NBD_OPT_STARTTLS: the server MUST NOT preserve negotiation state from before it
    c = connect(OPEN, SECRET)
    assert reply_types(c, Opt.STRUCTURED_REPLY) == [Rep.ACK]
    assert reply_types(c, Opt.SET_META_CONTEXT, meta_data("open", "base:allocation")) == [Rep.META_CONTEXT, Rep.ACK]
    starttls(c)
    assert not c.handshake.structured and c.handshake.meta_export is None
    # meta contexts need structured replies again, and GO gives neither
    assert reply_types(c, Opt.SET_META_CONTEXT, meta_data("open", "base:allocation")) == [Rep.ERR_INVALID]
    (neg,) = [e for e in c.receive_data(option(Opt.GO, go_data("open"))) if isinstance(e, Negotiated)]
    assert not neg.structured and neg.meta_context_id is None


def test_clear_text_after_starttls_is_not_taken_as_tls() -> None:
    # a GO pipelined behind STARTTLS in the same segment would otherwise run as if it came inside TLS
    c = connect(SECRET, tls_only=("secret",))
    events = c.receive_data(option(Opt.STARTTLS) + option(Opt.GO, go_data("secret")))
    assert not any(isinstance(e, (StartTls, Negotiated)) for e in events)
    (close,) = [e for e in events if isinstance(e, Close)]
    assert "clear text after NBD_OPT_STARTTLS" in close.reason and c.phase is Phase.DONE
    # the same bytes in a later segment, before the driver said the handshake succeeded: also refused
    c = connect(SECRET, tls_only=("secret",))
    assert any(isinstance(e, StartTls) for e in c.receive_data(option(Opt.STARTTLS)))
    events = c.receive_data(option(Opt.GO, go_data("secret")))
    assert [type(e) for e in events] == [Close] and c.phase is Phase.DONE


def test_tls_started_only_after_starttls() -> None:
    c = connect(SECRET, tls_only=("secret",))
    with pytest.raises(RuntimeError, match="OPTION_HEADER"):
        c.tls_started()


def test_starttls_while_shutting_down() -> None:
    c = connect(OPEN, SECRET, tls_only=("secret",))
    c.start_shutdown()
    assert reply_types(c, Opt.STARTTLS) == [Rep.ERR_SHUTDOWN]


def test_forced_tls_while_shutting_down_still_says_tls_reqd() -> None:
    # proto.md "FORCEDTLS mode": any option but STARTTLS/ABORT MUST get NBD_REP_ERR_TLS_REQD before TLS
    c = connect(SECRET, tls_only=("secret",))
    c.start_shutdown()
    assert reply_types(c, Opt.LIST) == [Rep.ERR_TLS_REQD]


# --- the TLS credentials (the servers that use them are tests/integration/test_nbd_tls_server.py)
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_server_without_credentials_refuses_tls_exports() -> None:
    with pytest.raises(ValueError, match="disk0: tls = 'require' needs the server's TLS credentials"):
        NbdServer([NbdExportConfig("disk0", Volume(RamDevice(8, 512), name="disk0"), [("127.0.0.1", 1)], tls="require")])


# --- credentials and config ---------------------------------------------------------------------------
def test_tls_context_names_the_file_at_fault(pki: Pki, tmp_path: Path) -> None:
    d = pki.server
    cert, key, ca = d / "server-cert.pem", d / "server-key.pem", d / "ca-cert.pem"

    def fault(*args: Any) -> tuple[str, str]:
        with pytest.raises(TlsCredentialError) as e:
            tls_context(*args)
        return e.value.which, str(e.value)

    assert fault(tmp_path / "nope.pem", key)[0] == "cert"
    missing = tmp_path / "nope.pem"
    assert fault(cert, missing) == ("key", f"cannot read {missing}: No such file or directory")
    assert fault(key, key) == ("cert", f"{key} holds no PEM certificate")
    assert fault(cert, pki.client / "client-key.pem")[1].endswith("is not the private key of the certificate "
                                                                  f"{cert}")
    assert fault(cert, key, None, True)[0] == "ca"
    assert fault(cert, key, key) == ("ca", f"{key} holds no PEM CA certificate")
    # a passphrase would make OpenSSL prompt on the terminal: refused instead
    encrypted = tmp_path / "enc-key.pem"
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:x", "-out", encrypted], check=True)
    assert fault(cert, encrypted) == ("key", f"{encrypted} is encrypted; give the server a key without a passphrase")
    assert tls_context(cert, key, ca).verify_mode == ssl.CERT_OPTIONAL
    assert tls_context(cert, key, ca, True).verify_mode == ssl.CERT_REQUIRED
    assert tls_context(cert, key).minimum_version == ssl.TLSVersion.TLSv1_2


def nbd_config(**nbd: Any) -> dict[str, Any]:
    export = nbd.pop("export", {})
    return {"devices": [{"name": "dev0", "type": "ram", "size": "1MiB"}],
            "volumes": [{"name": "disk0", "device": "dev0"}],
            "nbd": {"portals": ["127.0.0.1:10809"], **nbd,
                    "exports": [{"name": "disk0", "volume": "disk0", **export}]}}


def config_error(data: dict[str, Any], base_dir: Path | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data, base_dir=base_dir)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_config_tls_defaults_and_paths(tmp_path: Path) -> None:
    cfg = parse_config(nbd_config())
    assert cfg.nbd_tls is None and cfg.nbd_exports[0].tls == "off"
    tls = {"cert": "server-cert.pem", "key": "/abs/server-key.pem", "ca": "ca-cert.pem", "verify_client": True}
    cfg = parse_config(nbd_config(tls=tls), base_dir=tmp_path)
    assert cfg.nbd_exports[0].tls == "require"   # the default once the server has credentials
    t = cfg.nbd_tls
    assert t is not None and t.verify_client
    assert (t.cert, t.key, t.ca) == (tmp_path / "server-cert.pem", Path("/abs/server-key.pem"), tmp_path / "ca-cert.pem")
    cfg = parse_config(nbd_config(tls={"cert": "c.pem", "key": "k.pem"}, export={"tls": "optional"}))
    assert cfg.nbd_exports[0].tls == "optional" and cfg.nbd_tls is not None and cfg.nbd_tls.ca is None


def test_config_tls_errors() -> None:
    assert config_error(nbd_config(export={"tls": "require"})).startswith(
        'nbd.exports[0].tls: "require" needs the server\'s TLS credentials; add [nbd] tls = ')
    assert config_error(nbd_config(export={"tls": "optional"})).startswith("nbd.exports[0].tls: \"optional\" needs")
    assert config_error(nbd_config(tls={"cert": "c", "key": "k"}, export={"tls": "yes"})) == (
        'nbd.exports[0].tls: "yes" is not a TLS mode; use one of: off, optional, require')
    assert config_error(nbd_config(tls={"key": "k"})).startswith("nbd.tls.cert: missing; add cert = ")
    assert config_error(nbd_config(tls={"cert": "c"})).startswith("nbd.tls.key: missing; add key = ")
    assert config_error(nbd_config(tls={"cert": "c", "key": "k", "verify_client": True})).startswith(
        "nbd.tls.ca: missing; verify_client = true needs the CA")
    assert config_error(nbd_config(tls="server.pem")).startswith("nbd.tls: expected a table")
    assert config_error(nbd_config(tls={"cert": "c", "key": "k", "verify": True})).startswith(
        'nbd.tls.verify: unknown key; did you mean "verify_client"?')


def test_preflight_loads_the_credentials(pki: Pki, tmp_path: Path) -> None:
    d = pki.server
    good = {"cert": str(d / "server-cert.pem"), "key": str(d / "server-key.pem"), "ca": str(d / "ca-cert.pem"),
            "verify_client": True}
    preflight(parse_config(nbd_config(tls=good)))

    def fails(**bad: str) -> str:
        with pytest.raises(ConfigError) as e:
            preflight(parse_config(nbd_config(tls={**good, **bad})))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert fails(cert=str(tmp_path / "x.pem")) == f"nbd.tls.cert: cannot read {tmp_path / 'x.pem'}: No such file or directory"
    assert fails(key=str(pki.client / "client-key.pem")).startswith("nbd.tls.key: ")
    assert fails(ca=str(d / "server-key.pem")).startswith("nbd.tls.ca: ")
