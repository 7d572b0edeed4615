"""The web console (issue 15) in a real headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium) against a real `vsan serve` with a RAID 1 pool: log in with the token the node printed, create a
volume and export it (nbdinfo then sees it), watch the live IOPS figures and chart move while `vsan bench`
runs, fail a pool member and see the alert and the rebuild's progress; a read-only token sees no forms.
Screenshots of each page go to $VSAN_TEST_ARTIFACTS/console (CI's artifacts), else the test's tmp dir."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vsan_harness import VSAN, VsanServer, require_tools, run

pytestmark = pytest.mark.interop

MiB = 1 << 20

CONFIG = """\
# written by tests/interop/test_console.py
[node]
name = "console-node"

[[devices]]
name = "m0"
type = "ram"
size = "16MiB"

[[devices]]
name = "m1"
type = "ram"
size = "16MiB"

[[devices]]
name = "s0"
type = "ram"
size = "16MiB"

[[devices]]
name = "dev0"
type = "ram"
size = "64MiB"

[[pools]]
name = "p0"
level = "raid1"
members = ["m0", "m1"]
spares = ["s0"]
rebuild_rate = "2MiB/s"     # a rebuild of 16 MiB lasts about 8 s: long enough to be seen

[[volumes]]
name = "disk0"
device = "dev0"

[[volumes]]
name = "pv"
pool = "p0"

[iscsi]
portals = ["127.0.0.1:{port}"]

[[iscsi.targets]]
iqn = "{iqn}"
luns = [{{ lun = 0, volume = "disk0" }}, {{ lun = 1, volume = "pv" }}]

[nbd]
portals = ["127.0.0.1:{nbd_port}"]

[[nbd.exports]]
name = "disk0"
volume = "disk0"

[api]
listen = "127.0.0.1:{api_port}"
"""


@pytest.fixture
def node(vsan: Callable[..., VsanServer]) -> VsanServer:
    require_tools("chromium", "chromedriver", "nbdinfo")
    server = vsan(start=False)
    server.config.write_text(CONFIG.format(port=server.port, iqn=server.iqn, nbd_port=server.nbd_port,
                                           api_port=server.api_port))
    server.start()
    server.wait_api()
    return server


class Browser:
    def __init__(self, base: str, shots: Path) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
            opts.add_argument(a)
        opts.binary_location = "/usr/bin/chromium"
        self.d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        self.d.set_page_load_timeout(30)
        self.base, self.shots = base, shots
        shots.mkdir(parents=True, exist_ok=True)

    def go(self, path: str) -> None:
        self.d.get(self.base + path)

    def find(self, css: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.d.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return self.d.find_elements(By.CSS_SELECTOR, css)

    def text(self, css: str) -> str:
        return str(self.find(css).text)

    def until(self, what: str, check: Callable[[], bool], timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            last = ""
            try:
                if check():
                    return
            except Exception as e:  # noqa: BLE001 - the page is changing under us: look again
                last = f" (last look: {type(e).__name__})"
            if time.monotonic() > deadline:
                self.shot(f"timeout-{what.replace(' ', '-')}")
                pytest.fail(f"the console did not show {what} within {timeout} s{last}; page:\n"
                            f"{self.d.page_source[:3000]}", pytrace=False)
            time.sleep(0.2)

    def shot(self, name: str) -> None:
        self.d.save_screenshot(str(self.shots / f"{name}.png"))

    def accept(self) -> None:
        self.until("the confirmation", lambda: bool(self.d.switch_to.alert), 5)
        self.d.switch_to.alert.accept()

    def login(self, token: str) -> None:
        self.go("/login")
        self.find("#token").send_keys(token)
        self.find("#login").click()
        self.until("the dashboard", lambda: "Dashboard" in self.d.title)

    def quit(self) -> None:
        self.d.quit()


@pytest.fixture
def browser(node: VsanServer, tmp_path: Path) -> Iterator[Browser]:
    artifacts = os.environ.get("VSAN_TEST_ARTIFACTS")
    b = Browser(f"http://127.0.0.1:{node.api_port}", Path(artifacts) / "console" if artifacts else tmp_path / "shots")
    try:
        yield b
    finally:
        b.quit()


def test_log_in_create_export_watch_and_fail_a_member(node: VsanServer, browser: Browser) -> None:
    b = browser
    b.go("/")
    b.until("the login page", lambda: "Log in" in b.d.title)
    b.find("#token").send_keys("vsan_00000000_" + "x" * 43)
    b.find("#login").click()
    b.until("the refusal", lambda: "not valid" in b.text(".flash.error"))
    b.shot("0-login-refused")
    b.login(node.first_api_token())
    assert b.text("#node-name") == "console-node"
    b.until("a healthy node", lambda: b.text("#health-badge").startswith("healthy"))
    b.shot("1-dashboard")

    # a volume made in the console, exported over NBD, is what an NBD client sees
    b.go("/volumes")
    b.find("#new-name").send_keys("web1")
    b.find("#new-size").send_keys("32MiB")
    b.find("#create").click()
    b.until("the new volume", lambda: bool(b.all('#volumes tr[data-volume="web1"]')))
    b.shot("2-volumes")
    b.find('#volumes tr[data-volume="web1"] a').click()
    b.until("the volume's page", lambda: "web1" in b.d.title)
    from selenium.webdriver.support.ui import Select

    Select(b.find("#export-protocol")).select_by_visible_text("nbd")
    b.find("#export").click()
    b.until("the export", lambda: "nbd web1" in b.text("#exports"))
    b.shot("3-volume")
    size = run(["nbdinfo", "--size", node.nbd_url("web1")]).stdout.strip()
    assert int(size) == 32 * MiB
    # a refusal is the CLI's line, on the page
    b.find("#resize-size").send_keys("12XB")
    b.find("#resize").click()
    b.until("the refusal", lambda: "'12XB' is not a size" in b.text(".flash.error"))

    # the live figures and charts move while vsan bench reads disk0
    b.go("/")
    bench = subprocess.Popen([str(VSAN), "bench", node.nbd_url("disk0"), "--rw", "randread", "--qd", "8",
                              "--duration", "12", "--warmup", "0"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        b.until("disk0's read IOPS", lambda: float(b.text('#live tr[data-volume="disk0"] .r-iops') or 0) > 100)
        assert len(b.all("#chart-iops canvas")) == 1
        time.sleep(2)
        b.shot("4-dashboard-under-load")
        b.go("/sessions")
        b.until("the bench's NBD connection", lambda: "disk0" in b.text("#sessions"))
        b.shot("4b-sessions")
    finally:
        bench.wait(60)

    # a pool member failed in the console: the alert, then the rebuild onto the spare, with its progress
    b.go("/pools")
    b.find('section[data-pool="p0"] tr[data-slot="1"] button').click()
    b.accept()
    b.until("the rebuild", lambda: b.text('section[data-pool="p0"] .pool-state') in ("rebuilding", "degraded"))
    b.until("its progress", lambda: bool(b.all('section[data-pool="p0"] progress')), 15)
    b.shot("5-pool-rebuilding")
    assert not b.text("#health-badge").startswith("healthy")
    b.go("/health")
    assert "pool p0" in b.text("#findings")
    b.shot("6-health")
    b.go("/pools")
    b.until("the rebuilt pool", lambda: b.text('section[data-pool="p0"] .pool-state') == "optimal", 60)
    b.shot("7-pool-rebuilt")
    # the events: the changes made here, the pool's alert raised, then cleared
    b.go("/events")
    b.until("the pool's alert cleared", lambda: bool(b.all('#events tr.cleared[data-code^="pool-"]')), 20)
    assert b.all('#events tr.alert[data-code^="pool-"]')
    assert "volume web1" in b.text("#events") and "pool.fail" in b.text("#events")
    b.shot("8-events")


def test_a_read_only_token_sees_no_forms_and_cannot_change(node: VsanServer, browser: Browser) -> None:
    made = subprocess.run([str(VSAN), "token", "create", "viewer", "--role", "read-only", "--data-dir",
                           str(node.data_dir)], capture_output=True, text=True, timeout=60, check=True)
    b = browser
    b.login(made.stdout.strip())
    b.go("/volumes")
    assert not b.all("#create-volume")
    b.go("/volumes/disk0")
    assert not b.all("#resize-form") and not b.all("#export-form")
    # the change itself is refused, whatever the page shows
    out = b.d.execute_async_script("""
        const done = arguments[arguments.length - 1];
        fetch("/ui/volumes", {method: "POST", headers: {"HX-Request": "true"}, body: new URLSearchParams(
            {name: "sneaky", size: "8MiB"})}).then(r => r.text()).then(done);""")
    assert "read-only" in out
    out = b.d.execute_async_script("""
        const done = arguments[arguments.length - 1];
        fetch("/api/v1/volumes/sneaky", {method: "PUT", body: JSON.stringify({size: "8MiB"})})
            .then(r => done(r.status));""")
    assert out == 403
    assert "sneaky" not in run([str(VSAN), "volume", "list", "--data-dir", str(node.data_dir)]).stdout


def test_the_benchmark_page_runs_vsan_bench_and_keeps_its_report(node: VsanServer, browser: Browser) -> None:
    """A read profile against disk0's export runs from the console; its row shows the IOPS, and its report
    (the console's look) opens; a write profile is refused unless told it may overwrite the data."""
    b = browser
    b.login(node.first_api_token())
    b.go("/bench")
    from selenium.webdriver.support.ui import Select

    Select(b.find("#bench-volume")).select_by_value("disk0")
    Select(b.find("#bench-profile")).select_by_visible_text("4k-randwrite")
    b.find("#bench-seconds").clear()
    b.find("#bench-seconds").send_keys("2")
    b.find("#bench-run").click()
    b.until("the refusal", lambda: "overwrites" in b.text(".flash.error") or "writes over" in b.text(".flash.error"))
    Select(b.find("#bench-profile")).select_by_visible_text("4k-randread")
    b.find("#bench-run").click()
    b.until("the run", lambda: bool(b.all("#runs tr.running, #runs tr.done")))
    b.until("its result", lambda: bool(b.all("#runs tr.done")), 60)
    assert float(b.text("#runs tr.done .iops")) > 100
    b.shot("9-bench")
    b.find("#runs tr.done a").click()
    b.d.switch_to.window(b.d.window_handles[-1])
    b.until("the report", lambda: "4 KiB random reads" in b.d.page_source)
    assert "None" not in b.text("main")
    b.shot("10-bench-report")
