"""examples/single-node.toml, the file `make run` serves, works as the README says (on a free port here, so a
developer's own `make run` on 3260 does not get in the way)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from vsan_harness import IQN, REPO, TEST_INITIATOR, VsanServer, qemu_io, require_tools, run

pytestmark = pytest.mark.interop

EXAMPLE = REPO / "examples" / "single-node.toml"


def test_example_config_serves_one_gib_lun0(vsan: Callable[..., VsanServer]) -> None:
    require_tools("iscsi-ls", "iscsi-readcapacity16")
    text = EXAMPLE.read_text()
    assert '"127.0.0.1:3260"' in text, "the README's tour assumes the example listens on 127.0.0.1:3260"
    server = vsan(start=False)
    server.write_example(text)  # 3260, 4420 and 10809 moved to free ports
    server.start()
    listed = run(["iscsi-ls", "-i", TEST_INITIATOR, "-s", server.portal_url()]).stdout
    assert f"Target:{IQN} Portal:127.0.0.1:{server.port}" in listed, listed
    assert re.search(r"^Lun:0\s+Type:DIRECT_ACCESS", listed, re.MULTILINE), listed
    cap = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, "-s", server.url()]).stdout
    assert cap.strip() == str(1 << 30), cap
    qemu_io(server.url(), "write -P 0xab 0 1M", "read -P 0xab 0 1M")

