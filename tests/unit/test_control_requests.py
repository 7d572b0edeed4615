"""The control commands' typed bodies (node/requests.py): a request is checked before its command runs, with
the one-line errors a config gets; what passes reaches the command typed (no "false" read as true)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from openvsan.node import live
from openvsan.node import requests as R
from openvsan.node.control import RequestError


@pytest.mark.parametrize("cmd, args, line", [
    ("volume.create", {"name": 5}, "name: expected a string, found 5"),
    ("volume.create", {}, "name: missing; name the volume"),
    ("volume.create", {"name": "no/slash"}, "name: 'no/slash' is not a usable name"),
    ("volume.create", {"name": "v", "size": "1 parsec"}, "size: '1 parsec' is not a size"),
    ("volume.create", {"name": "v", "size": True}, "size: expected an integer or a string, found True"),
    ("volume.create", {"name": "v", "read_only": "false"}, 'read_only: expected true or false, found "false"'),
    ("volume.create", {"name": "v", "backing": "tape"}, 'backing: "tape" is not a backing; use one of: ram, file'),
    ("volume.create", {"name": "v", "block_size": 520}, "block_size: 520 is not supported; use 512 or 4096"),
    ("volume.create", {"name": "v", "szie": 1}, 'szie: unknown key; did you mean "size"?'),
    ("volume.resize", {"name": "v"}, "size: missing; give the new size, e.g. 512MiB"),
    ("volume.delete", {"name": "v", "force": 1}, "force: expected true or false, found 1"),
    ("export.add", {"protocol": "fc", "name": "x", "volume": "v"}, '"fc" is not a protocol; use one of: iscsi'),
    ("export.add", {"protocol": "nbd", "name": "x", "volume": "v", "portals": ["here"]},
     "portals[0]: 'here' is not a portal"),
    ("export.add", {"protocol": "iscsi", "name": "x", "volume": "v", "lun": "1"}, 'lun: expected an integer'),
    ("export.remove", {"protocol": "nvme", "name": "x", "nsid": 1.5}, "nsid: expected an integer, found 1.5"),
    ("qos.set", {"volume": "v", "limits": "fast"}, 'limits: expected a table, found "fast"'),
    ("config.apply", {}, "path: missing; name the config file"),
    ("volume.list", {"all": True}, "all: unknown key; remove it"),
])
def test_a_bad_request_gets_one_line_before_the_command_runs(cmd: str, args: dict[str, Any], line: str) -> None:
    node: Any = None   # never reached: the body is refused first
    with pytest.raises(RequestError) as e:
        asyncio.run(live.COMMANDS[cmd](node, args))
    assert line in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_good_request_arrives_typed() -> None:
    seen: list[Any] = []

    @live.command("test.echo", R.VolumeCreate)
    async def echo(node: Any, args: R.VolumeCreate) -> Any:
        seen.append(args)
        return args.size

    try:
        assert asyncio.run(live.COMMANDS["test.echo"](None, {"name": "v", "size": "1MiB", "read_only": True})) == 1 << 20
    finally:
        del live.COMMANDS["test.echo"]
    assert seen[0].read_only is True and seen[0].backing == "ram" and seen[0].block_size == 512

