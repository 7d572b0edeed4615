"""One access policy per volume: CHAP on iSCSI cannot be walked around through NBD or NVMe/TCP."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from openvsan.node.access import check_access_policy, exports, open_exports
from openvsan.node.config import ConfigError, parse_config
from openvsan.node.specs import HostAuthSpec, NbdTlsSpec

CHAP = {"user": "alice", "secret": "twelve+chars"}
HOST = "nqn.2014-08.org.nvmexpress:uuid:0f0e0d0c-0b0a-0908-0706-050403020100"


def config(*, chap: bool = True, nbd: dict[str, Any] | None = None, nvme: dict[str, Any] | None = None,
           volume: str = "disk0") -> dict[str, Any]:
    target: dict[str, Any] = {"iqn": "iqn.2026-11.org.openvsan:t0", "luns": [{"lun": 0, "volume": "disk0"}]}
    if chap:
        target["chap"] = CHAP
    d: dict[str, Any] = {
        "devices": [{"name": "ram0", "type": "ram", "size": "1MiB"}, {"name": "ram1", "type": "ram", "size": "1MiB"}],
        "volumes": [{"name": "disk0", "device": "ram0"}, {"name": "disk1", "device": "ram1"}],
        "iscsi": {"portals": ["127.0.0.1:3260"], "targets": [target]},
    }
    if nbd is not None:
        d["nbd"] = {"portals": ["127.0.0.1:10809"], "exports": [{"name": "e0", "volume": volume, **nbd}]}
    if nvme is not None:
        d["nvme"] = {"portals": ["127.0.0.1:4420"], "subsystems": [
            {"nqn": "nqn.2026-11.org.openvsan:s0", "namespaces": [{"nsid": 1, "volume": volume}], **nvme}]}
    return d


def refused(d: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_open_nbd_beside_chap_is_refused_and_named() -> None:
    msg = refused(config(nbd={}))
    assert msg.startswith("nbd.exports[0]: volume \"disk0\" needs CHAP on iSCSI target iqn.2026-11.org.openvsan:t0")
    assert "NBD export e0 is open (no TLS)" in msg
    assert "allow_unauthenticated = true" in msg and 'tls = "require"' in msg


def test_open_nvme_beside_chap_is_refused_even_with_a_host_acl() -> None:
    # a host NQN is a name the host claims: an ACL alone is no authentication
    msg = refused(config(nvme={"allowed_hosts": [HOST]}))
    assert msg.startswith("nvme.subsystems[0]: volume \"disk0\" needs CHAP")
    assert f"host {HOST} may connect without DH-HMAC-CHAP" in msg


def test_an_initiator_acl_is_not_authentication_either() -> None:
    d = config(chap=False, nbd={})
    d["iscsi"]["targets"][0]["allowed_initiators"] = ["iqn.1993-08.org.debian:01:a"]
    parse_config(d)  # both open: nothing to walk around
    assert not any(x.authenticated for x in exports(parse_config(d)))


def test_allow_unauthenticated_serves_it_open_and_says_so() -> None:
    cfg = parse_config(config(nbd={"allow_unauthenticated": True}, nvme={"allow_unauthenticated": True}))
    lines = open_exports(cfg)
    assert lines == [
        ("volume disk0: NVMe/TCP subsystem nqn.2026-11.org.openvsan:s0 is open (any host may connect, no "
        "DH-HMAC-CHAP, allow_unauthenticated = true) while iSCSI target iqn.2026-11.org.openvsan:t0 requires CHAP"),
        ("volume disk0: NBD export e0 is open (no TLS, allow_unauthenticated = true) while iSCSI target "
        "iqn.2026-11.org.openvsan:t0 requires CHAP"),
    ]


def test_other_volumes_and_all_open_configs_are_untouched() -> None:
    assert open_exports(parse_config(config(nbd={}, nvme={}, volume="disk1"))) == []
    assert open_exports(parse_config(config(chap=False, nbd={}, nvme={}))) == []


def test_authenticated_everywhere_passes() -> None:
    cfg = parse_config(config(nbd={"allow_unauthenticated": True}, nvme={"allow_unauthenticated": True}))
    sub = dataclasses.replace(cfg.subsystems[0], allowed_hosts=(HOST,), allow_unauthenticated=False,
                              hosts=(HostAuthSpec(HOST, "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"),))
    nbd = dataclasses.replace(cfg.nbd_exports[0], tls="require", allow_unauthenticated=False)
    assert cfg.nvme is not None
    good = dataclasses.replace(cfg, nvme=dataclasses.replace(cfg.nvme, subsystems=(sub,)), nbd_exports=(nbd,),
                               nbd_tls=NbdTlsSpec(Path("c.pem"), Path("k.pem"), Path("ca.pem"), verify_client=True))
    check_access_policy(good)
    assert all(x.authenticated for x in exports(good))
    assert open_exports(good) == []
    # TLS that does not check client certificates encrypts but does not authenticate
    no_client_certs = dataclasses.replace(good, nbd_tls=NbdTlsSpec(Path("c.pem"), Path("k.pem")))
    with pytest.raises(ConfigError, match="TLS without client certificates"):
        check_access_policy(no_client_certs)
    # one host of the ACL without a secret opens the subsystem
    other = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
    leaky = dataclasses.replace(good, nvme=dataclasses.replace(
        cfg.nvme, subsystems=(dataclasses.replace(sub, allowed_hosts=(HOST, other)),)))
    with pytest.raises(ConfigError, match=f"host {other} may connect without DH-HMAC-CHAP"):
        check_access_policy(leaky)
