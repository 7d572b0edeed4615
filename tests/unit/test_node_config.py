"""Config parsing and validation: every mistake is one line naming the key and the mend."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from openvsan.node.config import ConfigError, load_config, parse_config, preflight
from openvsan.node.values import Portal, check_iscsi_name, format_size, parse_portal, parse_size

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "single-node.toml"

BASE: dict[str, Any] = {
    "node": {"name": "n1"},
    "devices": [{"name": "ram0", "type": "ram", "size": "1MiB"},
                {"name": "ram1", "type": "ram", "size": 1 << 20, "block_size": 4096}],
    "volumes": [{"name": "disk0", "device": "ram0"}, {"name": "disk1", "device": "ram1", "read_only": True}],
    "iscsi": {"portals": ["127.0.0.1:3260"],
              "targets": [{"iqn": "iqn.2026-11.org.openvsan:t0",
                           "luns": [{"lun": 0, "volume": "disk0"}, {"lun": 1, "volume": "disk1"}]}]},
}


def cfg(**patch: Any) -> dict[str, Any]:
    d = copy.deepcopy(BASE)
    d.update(patch)
    return d


def target(**patch: Any) -> dict[str, Any]:
    d = cfg()
    d["iscsi"]["targets"][0].update(patch)
    return d


def error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_example_config() -> None:
    c = load_config(EXAMPLE)
    assert c.node.name == "node1"
    (dev,) = c.devices
    assert (dev.name, dev.type, dev.size, dev.block_size) == ("ram0", "ram", 1 << 30, 512)
    (t,) = c.targets
    assert t.iqn == "iqn.2026-11.org.openvsan:disk0"
    assert t.portals == (Portal("127.0.0.1", 3260),)
    assert [(x.lun, x.volume) for x in t.luns] == [(0, "disk0")]
    assert t.allowed_initiators is None and t.chap is None


def test_full_featured_target() -> None:
    c = parse_config(target(
        allowed_initiators=["iqn.1993-08.org.debian:01:abcdef", "eui.02004567A425678D"],
        chap={"user": "alice", "secret": "twelve+chars"},
        mutual_chap={"user": "target", "secret": "twelve+chars2"},
        advertised_portals=["192.0.2.10:3260", "[2001:db8::1]:3260"],
        alias="Disk zero", portal_group_tag=2))
    t = c.targets[0]
    assert t.allowed_initiators == ("iqn.1993-08.org.debian:01:abcdef", "eui.02004567A425678D")
    assert t.chap is not None and t.chap.secret == "twelve+chars"
    assert [str(p) for p in t.advertised_portals] == ["192.0.2.10:3260", "[2001:db8::1]:3260"]
    assert c.volume("disk1").read_only and c.device("ram1").block_size == 4096


@pytest.mark.parametrize("data, expect", [
    (cfg(flavour="blue"), 'flavour: unknown key; remove it'),
    (cfg(node={"nmae": "x"}), 'node.nmae: unknown key; did you mean "name"?'),
    (cfg(devices=[{"name": "a", "type": "ram", "size": "1MiB", "szie": 1}]), 'devices[0].szie: unknown key; did you'),
    (cfg(devices=[{"name": "a", "type": "ram", "size": "1MiB", "path": "/x"}]),
     'devices[0].path: not a key of a ram device'),
    (cfg(devices=[{"name": "a", "type": "tape", "size": 1}]), 'devices[0].type: unknown device type "tape"'),
    (cfg(devices=[{"name": "a", "type": "ram"}]), "devices[0].size: missing; a ram device needs a size"),
    (cfg(devices=[{"name": "a", "type": "ram", "size": "1 parsec"}]), "devices[0].size: '1 parsec' is not a size"),
    (cfg(devices=[{"name": "a", "type": "ram", "size": 1000}]),
     "devices[0].size: 1000 bytes is not a whole number of 512-byte blocks"),
    (cfg(devices=[{"name": "a", "type": "ram", "size": "1M", "block_size": 520}]),
     "devices[0].block_size: 520 is not supported; use 512 or 4096"),
    (cfg(devices=[{"name": "a", "type": "ram", "size": True}]), "devices[0].size: expected an integer or a string"),
    (cfg(devices=[{"name": "a b", "type": "ram", "size": 512}]), "devices[0].name: 'a b' is not a usable name"),
    (cfg(devices=[{"name": "a", "type": "file"}]), "devices[0].path: missing"),
    (cfg(devices=[{"name": "a", "type": "file", "path": "/x"}, {"name": "b", "type": "file", "path": "/x"}]),
     'devices[1].path: "/x" is already used by device "a"'),
    (cfg(devices=BASE["devices"] + [{"name": "ram0", "type": "null", "size": 512}]),
     'devices[2].name: a device named "ram0" is already defined'),
    (cfg(devices="ram0"), 'devices: expected a list, found "ram0"'),
    (cfg(devices=["ram0"]), 'devices[0]: expected a [[devices]] table, found "ram0"'),
    (cfg(volumes=[{"name": "v", "device": "ram9"}]),
     'volumes[0].device: unknown device "ram9"; define it under [[devices]] or use one of: ram0, ram1'),
    (cfg(volumes=[{"name": "v", "device": "ram0"}, {"name": "w", "device": "ram0"}]),
     'volumes[1].device: device "ram0" is already used by volume "v"; give each volume its own device'),
    (cfg(volumes=[{"name": "v", "device": "ram0"}, {"name": "v", "device": "ram1"}]),
     'volumes[1].name: a volume named "v" is already defined'),
    (cfg(volumes=[{"name": "v", "device": "ram0", "read_only": "yes"}]),
     'volumes[0].read_only: expected true or false, found "yes"'),
    (target(luns=[{"lun": 0, "volume": "disk0"}, {"lun": 1, "volume": "disk9"}]),
     'iscsi.targets[0].luns[1].volume: unknown volume "disk9"; define it under [[volumes]] or use one of: disk0'),
    (target(luns=[{"lun": 0, "volume": "disk0"}, {"lun": 0, "volume": "disk1"}]),
     "iscsi.targets[0].luns[1].lun: LUN 0 is already used in this target"),
    (target(luns=[{"lun": 16384, "volume": "disk0"}]),
     "iscsi.targets[0].luns[0].lun: 16384 is out of range; use 0 to 16383"),
    (target(luns=[{"lun": -1, "volume": "disk0"}]), "iscsi.targets[0].luns[0].lun: -1 is out of range"),
    (target(luns=[{"lun": 0, "volume": "disk0"}, {"lun": 1, "volume": "disk0"}]),
     'iscsi.targets[0].luns[1].volume: volume "disk0" is already a LUN of this target'),
    (target(luns=[]), "iscsi.targets[0].luns: missing or empty"),
    (target(iqn="iqn.2026-13.org.x:y"), "iscsi.targets[0].iqn: 'iqn.2026-13.org.x:y' is not an iqn name"),
    (target(iqn="iqn.2026-11.Org.X:y"), ("iscsi.targets[0].iqn: 'iqn.2026-11.Org.X:y' has upper case letters; "
                                         "iSCSI names compare in lower case, write 'iqn.2026-11.org.x:y'")),
    (target(iqn="disk0"), "iscsi.targets[0].iqn: 'disk0' is not an iSCSI name"),
    (target(iqn="eui.0123"), "iscsi.targets[0].iqn: 'eui.0123' is not an eui name"),
    (target(allowed_initiators=["iqn.2026-11.org.x", "nope"]), "iscsi.targets[0].allowed_initiators[1]: 'nope'"),
    (target(chap={"user": "alice", "secret": "short"}),
     "iscsi.targets[0].chap.secret: the secret is 5 bytes; use 12 to 16 bytes"),
    (target(chap={"user": "alice", "secret": "x" * 17}), "iscsi.targets[0].chap.secret: the secret is 17 bytes"),
    (target(chap={"user": "alice"}), "iscsi.targets[0].chap.secret: missing"),
    (target(chap={"user": "alice", "secret": "twelve+chars", "sercet": 1}), "iscsi.targets[0].chap.sercet: unknown"),
    (target(mutual_chap={"user": "t", "secret": "twelve+chars"}), "iscsi.targets[0].mutual_chap: needs chap too"),
    (target(chap={"user": "a", "secret": "twelve+chars"}, mutual_chap={"user": "t", "secret": "twelve+chars"}),
     "iscsi.targets[0].mutual_chap.secret: must differ from chap.secret"),
    (target(portal_group_tag=0), "iscsi.targets[0].portal_group_tag: 0 is out of range"),
    (target(advertised_portals=["10.0.0.1"]), "iscsi.targets[0].advertised_portals[0]: '10.0.0.1' is not a portal"),
    (cfg(iscsi={"portals": ["127.0.0.1:0"], "targets": []}),
     "iscsi.portals[0]: '127.0.0.1:0': the port must be a number from 1 to 65535"),
    (cfg(iscsi={"portals": ["127.0.0.1:3260", "127.0.0.1:3260"]}), "iscsi.portals[1]: 127.0.0.1:3260 is listed twice"),
    (cfg(iscsi={"targets": BASE["iscsi"]["targets"]}), 'iscsi.portals: missing; add portals = ["127.0.0.1:3260"]'),
    (cfg(iscsi={"portals": ["127.0.0.1:3260"], "targets": BASE["iscsi"]["targets"] * 2}),
     'iscsi.targets[1].iqn: target "iqn.2026-11.org.openvsan:t0" is already defined'),
])
def test_bad_config(data: dict[str, Any], expect: str) -> None:
    assert expect in error(data)


def test_poll_window() -> None:
    assert parse_config(cfg()).node.poll_us == 50          # adaptive polling is on unless turned off
    assert parse_config(cfg(node={"name": "n", "poll_us": 0})).node.poll_us == 0
    assert parse_config(cfg(node={"name": "n", "poll_us": 200})).node.poll_us == 200
    assert error(cfg(node={"poll_us": -1})) == ("node.poll_us: -1 is out of range; use 0 (no polling) to 10000 "
                                                "microseconds (default 50)")
    assert "node.poll_us: 10001 is out of range" in error(cfg(node={"poll_us": 10001}))
    assert error(cfg(node={"poll_us": "50us"})) == 'node.poll_us: expected an integer, found "50us"'
    assert error(cfg(node={"poll_us": True})) == "node.poll_us: expected an integer, found True"
    # the longest a window grows to, learned from the gaps between commands (frontend/busypoll.py)
    assert parse_config(cfg()).node.poll_max_us == 500
    assert parse_config(cfg(node={"name": "n", "poll_max_us": 0})).node.poll_max_us == 0
    assert error(cfg(node={"poll_max_us": 10001})) == ("node.poll_max_us: 10001 is out of range; use 0 (windows of "
                                                       "poll_us only) to 10000 microseconds (default 500)")


def test_target_portals_override_global() -> None:
    d = cfg(iscsi={"targets": [{"iqn": "iqn.2026-11.org.x:a", "luns": [{"lun": 0, "volume": "disk0"}],
                                "portals": ["[::1]:3261"]}]})
    assert parse_config(d).targets[0].portals == (Portal("::1", 3261),)


def test_empty_config_is_valid() -> None:
    c = parse_config({})
    assert c.devices == () and c.targets == () and c.node.name


def test_luns_sorted() -> None:
    c = parse_config(target(luns=[{"lun": 5, "volume": "disk1"}, {"lun": 2, "volume": "disk0"}]))
    assert [x.lun for x in c.targets[0].luns] == [2, 5]


def test_relative_paths_resolve_against_config_file(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[node]\ndata_dir = "state"\n[[devices]]\nname = "f"\ntype = "file"\n'
                                     'path = "img/f.img"\nsize = "1M"\n')
    c = load_config(tmp_path / "c.toml")
    assert c.node.data_dir == tmp_path / "state"
    assert c.devices[0].path == tmp_path / "img" / "f.img"
    with pytest.raises(ConfigError, match=r"devices\[0\].path: the directory .* does not exist"):
        preflight(c)
    (tmp_path / "img").mkdir()
    preflight(c)


def test_preflight_file_without_size(tmp_path: Path) -> None:
    c = parse_config({"devices": [{"name": "f", "type": "file", "path": str(tmp_path / "f")}]})
    with pytest.raises(ConfigError, match=r"devices\[0\].size: .* does not exist; add a size"):
        preflight(c)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[node\n")
    with pytest.raises(ConfigError, match="not valid TOML") as e:
        load_config(tmp_path / "bad.toml")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, n", [
    ("1GiB", 1 << 30), ("512MiB", 512 << 20), ("100G", 100 << 30), ("10GB", 10 * 10**9), ("4k", 4096),
    ("1.5GiB", 3 << 29), (" 2 TiB ", 2 << 40), (4096, 4096), ("4096", 4096), ("1m", 1 << 20),
])
def test_parse_size(text: object, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "1XB", "-1", 0, "0", 1.5, "1.0000000001K", None])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(1 << 30) == "1.0 GiB"
    assert format_size(1536 << 20) == "1.5 GiB"
    assert format_size(100) == "100 B"


@pytest.mark.parametrize("name", [
    "iqn.2026-11.org.openvsan:disk0", "iqn.1993-08.org.debian:01:abcdef", "iqn.1991-05.com.microsoft:host-1",
    "iqn.2001-04.com.example", "eui.02004567A425678D", "naa.52004567BA64678D",
    "naa.62004567BA64678D0123456789ABCDEF",
])
def test_iscsi_names_ok(name: str) -> None:
    assert check_iscsi_name(name) == name


@pytest.mark.parametrize("name", [
    "iqn.2026-00.org.x", "iqn.26-11.org.x", "iqn.2026-11", "iqn.2026-11.-org", "iqn.2026-11.org x",
    "iqn.2026-11.org.x:a" + "b" * 220, "naa.1234", "eui.0123456789ABCDEFG", "foo.bar", "",
])
def test_iscsi_names_bad(name: str) -> None:
    with pytest.raises(ValueError):
        check_iscsi_name(name)


@pytest.mark.parametrize("text, host, port", [
    ("127.0.0.1:3260", "127.0.0.1", 3260), ("[::1]:3261", "::1", 3261), ("0.0.0.0:1", "0.0.0.0", 1),
    ("san.example.org:65535", "san.example.org", 65535),
])
def test_portals(text: str, host: str, port: int) -> None:
    p = parse_portal(text)
    assert (p.host, p.port) == (host, port) and str(p) == text


@pytest.mark.parametrize("text", ["127.0.0.1", "::1:3260", "[::1]3260", "[1.2.3.4]:3260", "h:65536", ":3260",
                                  "a_b:3260", 3260])
def test_portals_bad(text: object) -> None:
    with pytest.raises(ValueError):
        parse_portal(text)


# --- NVMe/TCP and NBD sections ----------------------------------------------------------------------
NVME = {"portals": ["127.0.0.1:4420"],
        "subsystems": [{"nqn": "nqn.2026-11.org.openvsan:t0",
                        "namespaces": [{"nsid": 2, "volume": "disk1"}, {"nsid": 1, "volume": "disk0"}]}]}
NBD = {"portals": ["127.0.0.1:10809"], "exports": [{"name": "disk0", "volume": "disk0"}]}


def nvme(**patch: Any) -> dict[str, Any]:
    d = cfg(nvme=copy.deepcopy(NVME))
    d["nvme"]["subsystems"][0].update(patch)
    return d


def nbd(**patch: Any) -> dict[str, Any]:
    d = cfg(nbd=copy.deepcopy(NBD))
    d["nbd"]["exports"][0].update(patch)
    return d


def test_example_config_serves_all_three_protocols() -> None:
    c = load_config(EXAMPLE)
    assert c.nvme is not None and c.nvme.portals == (Portal("127.0.0.1", 4420),)
    (sub,) = c.subsystems
    assert sub.nqn == "nqn.2026-11.org.openvsan:disk0" and sub.portals == (Portal("127.0.0.1", 4420),)
    assert [(n.nsid, n.volume) for n in sub.namespaces] == [(1, "disk0")] and sub.allowed_hosts is None
    (e,) = c.nbd_exports
    assert (e.name, e.volume, e.portals, e.read_only) == ("disk0", "disk0", (Portal("127.0.0.1", 10809),), False)


def test_nvme_and_nbd_sections() -> None:
    c = parse_config(nvme(allowed_hosts=["nqn.2014-08.org.nvmexpress:uuid:0c9a1d3e-1234-4567-89ab-0123456789ab"],
                          advertised_portals=["192.0.2.10:4420"], serial="SN1", portals=["127.0.0.1:4421"]))
    (sub,) = c.subsystems
    assert [n.nsid for n in sub.namespaces] == [1, 2]  # sorted
    assert sub.portals == (Portal("127.0.0.1", 4421),) and c.nvme is not None
    assert c.nvme.portals == (Portal("127.0.0.1", 4420),)  # the discovery service stays on the section's portals
    assert sub.advertised_portals == (Portal("192.0.2.10", 4420),) and sub.serial == "SN1"
    assert sub.allowed_hosts == ("nqn.2014-08.org.nvmexpress:uuid:0c9a1d3e-1234-4567-89ab-0123456789ab",)
    c = parse_config(nbd(read_only=True, description="the first disk", portals=["[::1]:10810"]))
    (e,) = c.nbd_exports
    assert e.read_only and e.description == "the first disk" and e.portals == (Portal("::1", 10810),)
    assert parse_config(cfg()).nvme is None and parse_config(cfg()).nbd_exports == ()
    # one volume on every protocol at once
    both = cfg(nvme=copy.deepcopy(NVME), nbd=copy.deepcopy(NBD))
    assert parse_config(both).exports_anything()


@pytest.mark.parametrize("data, expect", [
    (cfg(nvme={}), 'nvme.portals: missing; add portals = ["127.0.0.1:4420"]'),
    (cfg(nvme={"portals": ["127.0.0.1:4420"], "subsytems": []}), 'nvme.subsytems: unknown key; did you mean'),
    (cfg(nvme={"subsystems": NVME["subsystems"]}), 'nvme.portals: missing; add portals = ["127.0.0.1:4420"]'),
    (nvme(nqn="disk0"), "nvme.subsystems[0].nqn: 'disk0' is not an NQN"),
    (nvme(nqn="nqn.2014-08.org.nvmexpress.discovery"), "is the discovery subsystem's NQN"),
    (nvme(nqn="nqn.2026-11.org.x:" + "a" * 220), "is longer than 223 bytes"),
    (nvme(namespaces=[]), "nvme.subsystems[0].namespaces: missing or empty"),
    (nvme(namespaces=[{"nsid": 0, "volume": "disk0"}]), "nvme.subsystems[0].namespaces[0].nsid: 0 is out of range"),
    (nvme(namespaces=[{"nsid": 1, "volume": "disk0"}, {"nsid": 1, "volume": "disk1"}]),
     "nvme.subsystems[0].namespaces[1].nsid: namespace 1 is already used"),
    (nvme(namespaces=[{"nsid": 1, "volume": "disk0"}, {"nsid": 2, "volume": "disk0"}]),
     'nvme.subsystems[0].namespaces[1].volume: volume "disk0" is already a namespace of this subsystem'),
    (nvme(namespaces=[{"nsid": 1, "volume": "disk9"}]),
     'nvme.subsystems[0].namespaces[0].volume: unknown volume "disk9"; define it under [[volumes]] or use one of'),
    (nvme(namespaces=[{"nsid": 1, "volume": "disk0", "lun": 0}]), "namespaces[0].lun: unknown key"),
    (nvme(allowed_hosts=["host1"]), "nvme.subsystems[0].allowed_hosts[0]: 'host1' is not an NQN"),
    (nvme(serial="x" * 21), "nvme.subsystems[0].serial: use up to 20 printable ASCII characters"),
    (nvme(portals=["127.0.0.1:3260"]),
     "nvme.subsystems[0].portals: 127.0.0.1:3260 is already an iSCSI portal (iscsi.targets[0].portals)"),
    (cfg(nvme={"portals": ["127.0.0.1:4420"], "subsystems": NVME["subsystems"] * 2}),
     'nvme.subsystems[1].nqn: subsystem "nqn.2026-11.org.openvsan:t0" is already defined'),
    (cfg(nbd={"exports": NBD["exports"]}), 'nbd.portals: missing; add portals = ["127.0.0.1:10809"]'),
    (nbd(name=""), "nbd.exports[0].name: an NBD export name is a non-empty string"),
    (nbd(name="a\nb"), "nbd.exports[0].name: 'a\\nb': use up to 256 bytes of printable text"),
    (nbd(volume="disk9"), 'nbd.exports[0].volume: unknown volume "disk9"'),
    (nbd(read_only="no"), 'nbd.exports[0].read_only: expected true or false, found "no"'),
    (nbd(volme="disk0"), 'nbd.exports[0].volme: unknown key; did you mean "volume"?'),
    (nbd(portals=["0.0.0.0:3260"]), "nbd.exports[0].portals: 0.0.0.0:3260 is already an iSCSI portal"),
    (cfg(nbd={"portals": ["127.0.0.1:10809"], "exports": NBD["exports"] * 2}),
     'nbd.exports[1].name: an NBD export named "disk0" is already defined'),
    (cfg(nvme=copy.deepcopy(NVME), nbd={"portals": ["127.0.0.1:4420"], "exports": NBD["exports"]}),
     "nbd.exports[0].portals: 127.0.0.1:4420 is already an NVMe/TCP portal (nvme.portals)"),
])
def test_bad_nvme_and_nbd_config(data: dict[str, Any], expect: str) -> None:
    assert expect in error(data)


def test_connection_limits() -> None:
    n = parse_config(cfg()).node
    # defaults a 1,000-connection flood from one address cannot use up: it is held to 32 of 512 of 4096
    assert (n.max_connections, n.max_unauthenticated, n.max_unauthenticated_per_source) == (4096, 512, 32)
    n = parse_config(cfg(node={"name": "n", "max_connections": 100, "max_unauthenticated": 100,
                               "max_unauthenticated_per_source": 1})).node
    assert (n.max_connections, n.max_unauthenticated, n.max_unauthenticated_per_source) == (100, 100, 1)
    assert error(cfg(node={"max_connections": 0})) == (
        "node.max_connections: 0 is out of range; use 1 to 1048576 connections of all protocols together "
        "(default 4096)")
    assert error(cfg(node={"max_connections": 2_000_000})).startswith("node.max_connections: 2000000 is out of range")
    assert error(cfg(node={"max_connections": 100, "max_unauthenticated": 512})) == (
        "node.max_unauthenticated: 512 is out of range (it cannot be above max_connections = 100); use 1 to 100 "
        "connections that have not logged in (default 512)")
    n = parse_config(cfg(node={"name": "n", "max_connections": 20})).node   # the caps below follow it down
    assert (n.max_connections, n.max_unauthenticated, n.max_unauthenticated_per_source) == (20, 20, 20)
    assert error(cfg(node={"max_unauthenticated": 10, "max_unauthenticated_per_source": 11})) == (
        "node.max_unauthenticated_per_source: 11 is out of range (it cannot be above max_unauthenticated = 10); "
        "use 1 to 10 connections not logged in from one address (default 32)")
    assert error(cfg(node={"max_unauthenticated_per_source": 0})).startswith(
        "node.max_unauthenticated_per_source: 0 is out of range")
    assert error(cfg(node={"max_connections": "many"})) == 'node.max_connections: expected an integer, found "many"'
    assert error(cfg(node={"max_unauthenticated": True})) == "node.max_unauthenticated: expected an integer, found True"
    assert 'did you mean "max_connections"' in error(cfg(node={"max_connection": 5}))
