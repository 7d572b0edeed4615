"""NBD over TLS (proto.md "TLS support") through the asyncio NbdServer on loopback, with a real TLS client in
process, on asyncio's loop and uvloop: round trip, refusals, the handshake inside the handshake timeout."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from tls_pki import CLIENT_SUBJECT, Pki, make_pki

from openvsan.block import RamDevice
from openvsan.frontend.config import NbdExportConfig
from openvsan.frontend.nbd import NbdServer, tls_context
from openvsan.protocol.nbd import Cmd
from openvsan.protocol.nbd.wire import IHAVEOPT, Opt, Rep
from openvsan.volume import Volume


def go_data(name: str) -> bytes:
    """NBD_OPT_GO / NBD_OPT_INFO data asking for no information items (doc/proto.md, NBD_OPT_INFO)."""
    n = name.encode()
    return struct.pack(">I", len(n)) + n + struct.pack(">H", 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def fresh_connection_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropped connections are logged at a bounded rate (frontend/ratelog.py): each test starts with a quiet one,
    so the drop it causes is logged whole whatever the tests before it dropped."""
    from openvsan.frontend import portals
    from openvsan.frontend.ratelog import RateLog

    monkeypatch.setattr(portals, "connection_log", RateLog(logging.getLogger("openvsan.frontend")))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def server_context(pki: Pki, verify_client: bool = True) -> ssl.SSLContext:
    d = pki.server
    return tls_context(d / "server-cert.pem", d / "server-key.pem", d / "ca-cert.pem", verify_client)


def client_context(d: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=d / "ca-cert.pem")
    if (d / "client-cert.pem").exists():
        ctx.load_cert_chain(d / "client-cert.pem", d / "client-key.pem")
    return ctx


LOOPS = ["asyncio", "uvloop"]


def run_on(loop: str, coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
    if loop == "uvloop":
        import uvloop  # what `vsan serve` runs on (a dependency of openvsan)

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    else:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.wait_for(coro(), 30))


class Plain:
    """A raw client: greeting, fixed newstyle flags, options and their replies."""

    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.r, self.w = r, w

    @classmethod
    async def connect(cls, port: int) -> Plain:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        await r.readexactly(18)
        w.write(struct.pack(">I", 3))
        return cls(r, w)

    def send_option(self, opt: int, data: bytes = b"") -> None:
        self.w.write(struct.pack(">QII", IHAVEOPT, opt, len(data)) + data)

    async def replies(self) -> list[tuple[int, bytes]]:
        out = []
        while True:
            _, _, rep, n = struct.unpack(">QIII", await self.r.readexactly(20))
            out.append((rep, await self.r.readexactly(n)))
            if rep not in (Rep.INFO, Rep.SERVER, Rep.META_CONTEXT):
                return out

    async def option(self, opt: int, data: bytes = b"") -> list[tuple[int, bytes]]:
        self.send_option(opt, data)
        return await self.replies()

    async def starttls(self, d: Path) -> None:
        assert await self.option(Opt.STARTTLS) == [(Rep.ACK, b"")]
        await self.w.start_tls(client_context(d), server_hostname="localhost")


async def no_connections_left(server: NbdServer) -> None:
    """The server has let go of every connection (within a second)."""
    for _ in range(100):
        if not server.connections:
            return
        await asyncio.sleep(0.01)
    assert not server.connections


async def serving(exports: list[tuple[str, str]], ctx: ssl.SSLContext | None, port_holder: list[int],
                  **kw: Any) -> NbdServer:
    port = free_port()
    port_holder.append(port)
    server = NbdServer([NbdExportConfig(name, Volume(RamDevice(2048, 512), name=name), [("127.0.0.1", port)], tls=mode)
                        for name, mode in exports], ssl_context=ctx, **kw)
    await server.start()
    return server


@pytest.mark.parametrize("loop", LOOPS)
def test_server_tls_round_trip_and_log(pki: Pki, loop: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "openvsan.nbd")

    async def go() -> None:
        ports: list[int] = []
        server = await serving([("disk0", "require")], server_context(pki), ports)
        try:
            c = await Plain.connect(ports[0])
            await c.starttls(pki.client)
            # pipelined at once behind the handshake: asyncio may hand them over before start_tls returns
            c.send_option(Opt.STRUCTURED_REPLY)
            c.send_option(Opt.GO, go_data("disk0"))
            assert (await c.replies())[-1][0] == Rep.ACK
            assert [r for r, _ in await c.replies()] == [Rep.INFO, Rep.INFO, Rep.ACK]
            request = struct.pack(">IHHQQI", 0x25609513, 0, Cmd.WRITE, 1, 4096, 4096) + b"t" * 4096
            request += struct.pack(">IHHQQI", 0x25609513, 0, Cmd.READ, 2, 4096, 4096)
            c.w.write(request)
            # WRITE: a simple reply (proto.md allows it for all but READ), then READ's OFFSET_DATA chunk
            assert struct.unpack(">IIQ", await c.r.readexactly(16)) == (0x67446698, 0, 1)
            head = struct.unpack(">IHHQI", await c.r.readexactly(20))
            assert head[3] == 2 and (await c.r.readexactly(head[4]))[8:] == b"t" * 4096
            c.w.close()
        finally:
            await server.stop()

    run_on(loop, go)
    text = caplog.text
    assert "NBD TLS TLSv1." in text, text
    subject = CLIENT_SUBJECT.strip("/").replace("/", ",")  # O=openvsan test,CN=client1
    assert f"client certificate {subject}" in text, text
    assert "NBD export disk0 (1048576 bytes, structured replies, TLS)" in text


@pytest.mark.parametrize("loop", LOOPS)
def test_server_plain_client_refused_when_tls_required(pki: Pki, loop: str) -> None:
    async def go() -> None:
        ports: list[int] = []
        server = await serving([("disk0", "require")], server_context(pki), ports)
        try:
            c = await Plain.connect(ports[0])
            for opt, data in ((Opt.LIST, b""), (Opt.GO, go_data("disk0")), (Opt.INFO, go_data("disk0"))):
                assert [r for r, _ in await c.option(opt, data)] == [Rep.ERR_TLS_REQD]
            c.send_option(Opt.EXPORT_NAME, b"disk0")
            assert await c.r.read() == b""   # proto.md: EXPORT_NAME cannot error, so the server drops it
        finally:
            await server.stop()

    run_on(loop, go)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("who", ["nocert", "stranger"])
def test_server_refuses_client_certificate(pki: Pki, loop: str, who: str, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        ports: list[int] = []
        server = await serving([("disk0", "require")], server_context(pki), ports)
        try:
            c = await Plain.connect(ports[0])
            with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
                # TLS 1.3: the client hears of the refusal at its first read
                await c.starttls(getattr(pki, who))
                await c.option(Opt.LIST)
            await no_connections_left(server)
        finally:
            await server.stop()

    run_on(loop, go)
    lines = [r.getMessage() for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    reason = "no client certificate: verify_client requires" if who == "nocert" else "client certificate refused: "
    assert lines[0].startswith("127.0.0.1:") and reason in lines[0], lines


@pytest.mark.parametrize("loop", LOOPS)
def test_server_optional_tls_export_either_way_and_only_tls_export_hidden(pki: Pki, loop: str) -> None:
    async def go() -> None:
        ports: list[int] = []
        server = await serving([("open", "optional"), ("secret", "require")], server_context(pki, False), ports)
        try:
            c = await Plain.connect(ports[0])
            listed = await c.option(Opt.LIST)
            assert [d[4:] for r, d in listed if r == Rep.SERVER] == [b"open"]
            assert (await c.option(Opt.INFO, go_data("open")))[-1][0] == Rep.ACK
            assert (await c.option(Opt.INFO, go_data("secret")))[-1][0] == Rep.ERR_TLS_REQD
            await c.starttls(pki.nocert)   # no client certificate needed without verify_client
            assert (await c.option(Opt.INFO, go_data("secret")))[-1][0] == Rep.ACK
            assert (await c.option(Opt.STARTTLS))[-1][0] == Rep.ERR_INVALID
            c.w.close()
        finally:
            await server.stop()

    run_on(loop, go)


def test_server_clear_text_after_starttls_closes(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        ports: list[int] = []
        server = await serving([("disk0", "require")], server_context(pki), ports)
        try:
            c = await Plain.connect(ports[0])
            c.w.write(struct.pack(">QII", IHAVEOPT, Opt.STARTTLS, 0) + struct.pack(">QII", IHAVEOPT, Opt.LIST, 0))
            assert await c.r.read() == b""   # closed, and the LIST was never answered
        finally:
            await server.stop()

    run_on("asyncio", go)
    assert "clear text after NBD_OPT_STARTTLS" in caplog.text


@pytest.mark.parametrize("loop", LOOPS)
def test_server_tls_handshake_counts_against_the_handshake_timeout(pki: Pki, loop: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        ports: list[int] = []
        server = await serving([("disk0", "require")], server_context(pki), ports, handshake_timeout=0.3)
        try:
            c = await Plain.connect(ports[0])
            assert await c.option(Opt.STARTTLS) == [(Rep.ACK, b"")]
            # ... and no ClientHello: the connection is dropped once, by the handshake timer
            assert await asyncio.wait_for(c.r.read(), 5) == b""
            await no_connections_left(server)
        finally:
            await server.stop()

    run_on(loop, go)
    drops = [r.getMessage() for r in caplog.records if "closing the connection" in r.getMessage()]
    assert len(drops) == 1 and "handshake not finished in 0 s" in drops[0], drops
