"""DH-HMAC-CHAP over real sockets: our NVMe/TCP host (openvsan.initiator.nvme_tcp, protocol/nvme/auth.py
HostAuth) against `vsan serve` with `hosts` on its subsystem, the config going through the store and its
secrets file. Unidirectional and bidirectional, every queue authenticating, data round trips, wrong secrets
refused (and logged with the host NQN and address, never the secret), a queue that skips authentication
getting Authentication Required, an unlisted host refused at Connect, the throttle's lockout, and a restart.

The Linux kernel host in the guest is tests/interop/test_nvme_auth_guest.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable

import pytest
from vsan_harness import VsanServer

from openvsan.block.errors import DeviceFailed
from openvsan.initiator.nvme_tcp import Association, NvmeCommandError, NvmeOptions, NvmeTcpInitiator

pytestmark = pytest.mark.interop

NQN = "nqn.2026-11.org.openvsan:disk0"
UNI = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001"
BI = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000002"
STRANGER = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000003"
# `nvme gen-dhchap-key` (nvme-cli 2.3) output: 32/48-byte keys, untransformed and SHA-256 transformed
UNI_SECRET = "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"
BI_SECRET = "DHHC-1:01:5vxYBh5q8aC18ZmEQ1U/rZHUSIsXL0hdWYJ43Cx7n7THwj6G:"
CTRL_SECRET = "DHHC-1:02:JSiSVrQ82kgD9rjDYo7yIyEdn7jXeDqnOC/FysEgM/Gjw1d/0X81eQyCbJn27DUQ4t4Mww==:"
WRONG = "DHHC-1:00:yMnKy8zNzs/Q0dLT1NXW19jZ2tvc3d7f4OHi4+Tl5ufo6err7O3u7/Dx8vP09fb3+Pn6+/z9/v8AAQIDBAUGB24FqBs=:"


def serve(vsan: Callable[..., VsanServer], node: str = "", dhgroups: tuple[str, ...] = ("ffdhe2048", "null"),
          ) -> VsanServer:
    # the LUN has CHAP too: one access policy per volume (node/access.py)
    server = vsan(start=False, chap=("tester", "secret-123456"))
    text = server.config.read_text()
    if node:
        text = text.replace('name = "test-node"\n', f'name = "test-node"\n{node}\n')
    hosts = [f'{{ nqn = "{UNI}", dhchap_secret = "{UNI_SECRET}" }}',
             f'{{ nqn = "{BI}", dhchap_secret = "{BI_SECRET}", dhchap_ctrl_secret = "{CTRL_SECRET}" }}']
    text += (f'\n[nvme]\nportals = ["127.0.0.1:{server.nvme_port}"]\n\n[[nvme.subsystems]]\nnqn = "{NQN}"\n'
             f'namespaces = [{{ nsid = 1, volume = "disk0" }}]\nhosts = [{", ".join(hosts)}]\n'
             f"dhchap_dhgroups = {json.dumps(list(dhgroups))}\n")
    server.config.write_text(text)
    server.start()
    return server


def url(server: VsanServer, query: str = "") -> str:
    return f"nvme+tcp://127.0.0.1:{server.nvme_port}/{NQN}/1" + (f"?{query}" if query else "")


async def roundtrip(server: VsanServer, hostnqn: str, secret: str, ctrl_secret: str = "", query: str = "queues=2",
                    ) -> None:
    dev = await NvmeTcpInitiator.open_url(url(server, query), hostnqn=hostnqn, dhchap_secret=secret,
                                          dhchap_ctrl_secret=ctrl_secret)
    try:
        data = os.urandom(64 * 1024)
        await dev.write(128, data)
        assert bytes(await dev.read(128, len(data) // dev.block_size)) == data
    finally:
        await dev.close()


async def refused(server: VsanServer, hostnqn: str, secret: str, ctrl_secret: str = "") -> str:
    with pytest.raises(DeviceFailed) as e:
        await NvmeTcpInitiator.open_url(url(server), hostnqn=hostnqn, dhchap_secret=secret,
                                        dhchap_ctrl_secret=ctrl_secret, reconnect_timeout=1.0)
    return str(e.value)


def test_dhchap_round_trips_and_refusals(vsan: Callable[..., VsanServer]) -> None:
    server = serve(vsan)

    async def main() -> None:
        await roundtrip(server, UNI, UNI_SECRET, query="queues=3")
        await roundtrip(server, BI, BI_SECRET, CTRL_SECRET)
        assert "authentication failed" in await refused(server, UNI, WRONG)
        assert "did not prove" in await refused(server, BI, BI_SECRET, WRONG)   # the host checks the controller
        assert "asks for DH-HMAC-CHAP" in await refused(server, UNI, "")
        assert "status SCT 0x1 SC 0x84" in await refused(server, STRANGER, UNI_SECRET)   # Connect: invalid host

    asyncio.run(main())
    log = server.log_text()
    # every queue authenticated: the admin queue and 3 I/O queues of the first association
    for q in range(4):
        assert f"host {UNI} authenticated queue {q} of {NQN} (DH-HMAC-CHAP sha256, ffdhe2048, unidirectional)" in log
    assert f"host {BI} authenticated queue 0 of {NQN} (DH-HMAC-CHAP sha256, ffdhe2048, bidirectional)" in log
    assert f"host {UNI} failed DH-HMAC-CHAP on queue 0 of {NQN}: authentication failed" in log
    assert "127.0.0.1:" in log.split(f"host {UNI} failed DH-HMAC-CHAP")[0].splitlines()[-1]   # the address
    assert f"host {BI} failed DH-HMAC-CHAP on queue 0 of {NQN}: authentication failed" in log  # its Failure2
    for secret in (UNI_SECRET, BI_SECRET, CTRL_SECRET, WRONG):
        assert secret.split(":")[2] not in log
    # the secrets are kept out of the state store (its write-ahead log included)
    stored = b"".join(p.read_bytes() for p in server.data_dir.glob("state-kv.db*"))
    assert stored and UNI_SECRET.encode() not in stored

    server.restart()                         # the hosts and their secrets come back from the store
    asyncio.run(roundtrip(server, BI, BI_SECRET, CTRL_SECRET, query=""))


def test_unauthenticated_queue_gets_authentication_required(vsan: Callable[..., VsanServer]) -> None:
    server = serve(vsan, dhgroups=("null",))

    class Skipping(Association):
        async def _authenticate(self, *a: object) -> None:
            return None                      # connected with ATR set, and says nothing

    async def main() -> None:
        a = Skipping("127.0.0.1", server.nvme_port, NQN, NvmeOptions(hostnqn=UNI, kato_ms=0), 0)
        try:
            await a.start()
            pytest.fail("Identify answered before authentication")
        except NvmeCommandError as e:
            assert e.status == 0x4191, hex(e.status)   # Authentication Required, DNR
        finally:
            a.close_now()

    asyncio.run(main())


def test_lockout_after_failures(vsan: Callable[..., VsanServer]) -> None:
    server = serve(vsan, node="auth_delay_max = 0.2\nauth_lockout_failures = 2\nauth_lockout_seconds = 60")

    async def main() -> None:
        for _ in range(2):
            assert "authentication failed" in await refused(server, UNI, WRONG)
        # locked out: the right secret is not even looked at, however often it is tried
        for _ in range(3):
            assert "authentication failed" in await refused(server, UNI, UNI_SECRET)
        await roundtrip(server, BI, BI_SECRET, CTRL_SECRET, query="")   # another host is not

    asyncio.run(main())
    assert server.log_text().count(f"host {UNI} is locked out for") == 1   # when it began, not per try
