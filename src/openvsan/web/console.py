"""The web console: server-rendered pages (Jinja2) over the node's control commands, the same ones the REST
API and the CLI use, with htmx for forms and partial refreshes and uPlot for the live charts (both vendored
from their npm packages under static/vendor/, versions and checksums in static/vendor/README.md).

Login is by API token (a read-only token shows, an admin token also changes); the session is the token in
an HttpOnly, SameSite=Strict cookie, and every change is an htmx request (the API refuses a cookie change
without its header: api/app.py caller). A refusal is the CLI's one line, shown on the page.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Form, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from openvsan.api.tokens import TokenBook, TokenEntry
from openvsan.web.benchruns import BENCH_PROFILES, BenchRuns, bench_targets

Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]
HERE = Path(__file__).parent


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class LoginNeeded(Exception):
    """A console page asked for without a valid session: the answer is the login page."""


def viewer(request: Request) -> TokenEntry:
    """The console user of this request (its session cookie's token), or LoginNeeded."""
    from openvsan.api.app import COOKIE

    token = request.cookies.get(COOKIE)
    tokens: TokenBook = request.app.state.tokens
    entry = tokens.verify(token) if token else None
    if entry is None:
        raise LoginNeeded
    return entry


Viewer = Annotated[TokenEntry, Depends(viewer)]


def data_dir_of(app: FastAPI) -> Path:
    tokens: TokenBook = app.state.tokens
    return tokens.path.parent


def mount_console(app: FastAPI, handler: Handler) -> None:
    from openvsan.api.app import COOKIE

    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters["size"] = _size
    templates.env.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")

    def who(request: Request) -> TokenEntry | None:
        try:
            return viewer(request)
        except LoginNeeded:
            return None

    @app.exception_handler(LoginNeeded)
    async def _login(request: Request, e: LoginNeeded) -> Response:
        if request.url.path.startswith("/ui/"):
            return HTMLResponse("", status_code=401)       # a fragment: htmx leaves the page as it is
        return RedirectResponse("/login", status_code=303)

    async def page(request: Request, name: str, user: TokenEntry, **context: Any) -> Response:
        info = await handler("node.info", {})
        health = await handler("node.health", {})
        return templates.TemplateResponse(request, name, {"user": user, "node": info, "health": health,
                                                          "page": name.removesuffix(".html"), **context})

    async def attempt(cmd: str, args: dict[str, Any]) -> tuple[Any, str | None]:
        """Run a change for a form: (result, None), or (None, the one-line refusal)."""
        try:
            return await handler(cmd, args), None
        except Exception as e:  # noqa: BLE001 - shown to the administrator as the CLI would print it
            return None, " ".join(str(e).split()) or type(e).__name__

    def flash(request: Request, ok: str | None, error: str | None, *, refresh: bool = True) -> Response:
        """The answer to an htmx form: a message, and the page reloaded when something changed."""
        resp = templates.TemplateResponse(request, "_flash.html", {"ok": ok, "error": error})
        if ok and refresh:
            resp.headers["HX-Refresh"] = "true"
        return resp

    async def change(request: Request, cmd: str, args: dict[str, Any], done: str) -> Response:
        """A form's change: refused for a read-only user or a request not from the console's page, else the
        command's own refusal, or `done`."""
        refused = admin_or_refusal(request)
        if refused:
            return flash(request, None, refused)
        _, error = await attempt(cmd, args)
        return flash(request, None if error else done, error)

    def admin_or_refusal(request: Request) -> str | None:
        user = who(request)
        if user is None:
            return "your session ended: log in again"
        if user.role != "admin":
            return f"token {user.name} is {user.role}: changes need an admin token"
        if not request.headers.get("hx-request"):
            return "a change must come from the console's own page"
        return None

    # ---- login

    @app.get("/login", response_class=HTMLResponse, include_in_schema=False)
    async def login_form(request: Request) -> Response:
        return templates.TemplateResponse(request, "login.html", {"error": None})

    @app.post("/login", include_in_schema=False)
    async def login(request: Request, token: str = Form("")) -> Response:
        from openvsan.api.app import FailedAuth

        failures: FailedAuth = request.app.state.failures
        client = request.client.host if request.client is not None else "?"
        entry = request.app.state.tokens.verify(token.strip())
        if entry is None:
            wait = failures.blocked(client)
            if not wait:
                failures.failed(client, "console login with an unknown token")
            error = (f"too many failed logins from {client}; retry in {wait:.0f} s" if wait
                     else "that token is not valid (unknown, revoked or mistyped)")
            return templates.TemplateResponse(request, "login.html", {"error": error}, status_code=401)
        resp = RedirectResponse("/", status_code=303)
        resp.set_cookie(COOKIE, token.strip(), httponly=True, samesite="strict", secure=request.url.scheme == "https")
        return resp

    @app.post("/logout", include_in_schema=False)
    async def logout() -> Response:
        resp = RedirectResponse("/login", status_code=303)
        resp.delete_cookie(COOKIE)
        return resp

    # ---- pages

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard(request: Request, user: Viewer) -> Response:
        volumes = await handler("volume.list", {})
        pools = await handler("pool.list", {})
        groups: dict[str, Any] = {}
        for v in volumes:
            if v.get("volume_group"):
                groups.setdefault(f"pool {v['pool']}" if v.get("pool") else f"device {v['device']}", v["volume_group"])
        capacity = {"volumes": sum(v.get("size", 0) for v in volumes),
                    "group_capacity": sum(g["capacity"] for g in groups.values()),
                    "group_used": sum(g["used"] for g in groups.values()),
                    "pools": sum(p["size"] for p in pools)}
        exports = await handler("export.list", {})
        return await page(request, "dashboard.html", user, volumes=volumes, pools=pools, groups=groups,
                          capacity=capacity, exports=exports)

    @app.get("/volumes", response_class=HTMLResponse, include_in_schema=False)
    async def volumes_page(request: Request, user: Viewer) -> Response:
        return await page(request, "volumes.html", user, volumes=await handler("volume.list", {}),
                          exports=await handler("export.list", {}), pools=await handler("pool.list", {}))

    @app.get("/volumes/{name}", response_class=HTMLResponse, include_in_schema=False)
    async def volume_page(request: Request, user: Viewer, name: str) -> Response:
        volume, error = await attempt("volume.show", {"name": name})
        if volume is None:
            return await page(request, "missing.html", user, what=error)
        snaps, _ = await attempt("snapshot.list", {"volume": name}) if volume.get("volume_group") else ([], None)
        status, _ = await attempt("volume.status", {"name": name})
        exports = [e for e in await handler("export.list", {}) if e["volume"] == name]
        return await page(request, "volume.html", user, v=volume, snapshots=snaps or [], replication=status,
                          exports=exports)

    @app.get("/pools", response_class=HTMLResponse, include_in_schema=False)
    async def pools_page(request: Request, user: Viewer) -> Response:
        pools = [await handler("pool.status", {"name": p["name"]}) for p in await handler("pool.list", {})]
        return await page(request, "pools.html", user, pools=pools)

    @app.get("/ui/pools", response_class=HTMLResponse, include_in_schema=False)
    async def pools_fragment(request: Request, user: Viewer) -> Response:
        """The pools' state, members and progress (the pools page refreshes it every 2 s)."""
        pools = [await handler("pool.status", {"name": p["name"]}) for p in await handler("pool.list", {})]
        return templates.TemplateResponse(request, "_pools.html", {"pools": pools})

    @app.get("/cluster", response_class=HTMLResponse, include_in_schema=False)
    async def cluster_page(request: Request, user: Viewer) -> Response:
        """The cluster's members (up, address, each one's health, asked through api/peers.py with this
        user's role) and its replicated volumes (primary, epoch, replicas in and out of sync)."""
        import json

        from openvsan.api.peers import Forwarded

        peers = request.app.state.peers
        if peers is None or not peers.clustered:
            return await page(request, "cluster.html", user, members=None, status=None)
        status, error = await attempt("cluster.status", {})
        try:
            members = await peers.members()
        except Exception as e:  # noqa: BLE001 - the store not answering is what the page must say
            return await page(request, "cluster.html", user, members=[], status=None,
                              error=f"the cluster's store does not answer: {e}")
        for m in members:
            m["health"], m["findings"], m["error"] = None, 0, None
            try:
                if m["this"]:
                    report = await handler("node.health", {})
                elif m["up"]:
                    code, body, _ = await peers.forward(m["name"], "GET", "/api/v1/health", b"", {},
                                                        Forwarded(peers.me, user.role, user.name, time.time()))
                    report = json.loads(body) if code == 200 else {"status": None, "detail": json.loads(body)}
                    if code != 200:
                        m["error"] = f"HTTP {code}: {report['detail'].get('detail', '')}"
                else:
                    continue
                m["health"], m["findings"] = report.get("status"), len(report.get("findings", ()))
            except (OSError, ValueError, LookupError, TimeoutError) as e:
                m["error"] = " ".join(str(e).split())
        return await page(request, "cluster.html", user, members=members, status=status, error=error)

    @app.get("/sessions", response_class=HTMLResponse, include_in_schema=False)
    async def sessions_page(request: Request, user: Viewer) -> Response:
        return await page(request, "sessions.html", user, sessions=await handler("node.sessions", {}))

    @app.get("/events", response_class=HTMLResponse, include_in_schema=False)
    async def events_page(request: Request, user: Viewer) -> Response:
        return await page(request, "events.html", user, events=list(reversed(await handler("node.events", {"limit": 200}))))

    @app.get("/health", response_class=HTMLResponse, include_in_schema=False)
    async def health_page(request: Request, user: Viewer) -> Response:
        return await page(request, "health.html", user)

    # ---- benchmarks: `vsan bench` against a volume's export, as a process of its own (web/benchruns.py)

    runs = BenchRuns(data_dir_of(app))

    @app.get("/bench/runs/{run}/report/{name}", include_in_schema=False)
    async def bench_report(request: Request, user: Viewer, run: str, name: str) -> Response:
        """A run's report (its index.html, plots, console.css, results.json), for a logged-in user."""
        path = runs.report_file(run, name)
        if path is None:
            return HTMLResponse("no such report", status_code=404)
        return FileResponse(path)

    @app.get("/bench", response_class=HTMLResponse, include_in_schema=False)
    async def bench_page(request: Request, user: Viewer) -> Response:
        exports = await handler("export.list", {})
        return await page(request, "bench.html", user, targets=bench_targets(exports), profiles=BENCH_PROFILES,
                          runs=runs.list())

    @app.get("/ui/bench/runs", response_class=HTMLResponse, include_in_schema=False)
    async def bench_runs_fragment(request: Request, user: Viewer) -> Response:
        return templates.TemplateResponse(request, "_bench_runs.html", {"runs": runs.list()})

    @app.post("/ui/bench", include_in_schema=False)
    async def bench_start(request: Request, target: str = Form(""), profile: str = Form(""),
                          seconds: str = Form("10"), overwrite: str = Form("")) -> Response:
        refused = admin_or_refusal(request)
        if refused:
            return flash(request, None, refused)
        exports = await handler("export.list", {})
        try:
            run = runs.start(bench_targets(exports), target, profile, seconds, overwrite == "on")
        except ValueError as e:
            return flash(request, None, str(e))
        return flash(request, f"benchmark {run} started: {profile} on {target} for {seconds} s", None)

    # ---- changes (htmx forms)

    @app.post("/ui/volumes", include_in_schema=False)
    async def create_volume(request: Request, name: str = Form(""), size: str = Form(""), backing: str = Form("ram"),
                            where: str = Form("")) -> Response:
        refused = admin_or_refusal(request)
        if refused:
            return flash(request, None, refused)
        args: dict[str, Any] = {"name": name.strip(), "size": size.strip() or None}
        kind, _, place = where.partition(":")
        if kind in ("pool", "device") and place:
            args[kind] = place
        else:
            args["backing"] = backing
        _, error = await attempt("volume.create", args)
        return flash(request, None if error else f"volume {name} created", error)

    @app.post("/ui/volumes/{name}/resize", include_in_schema=False)
    async def resize_volume(request: Request, name: str, size: str = Form("")) -> Response:
        return await change(request, "volume.resize", {"name": name, "size": size.strip()}, f"volume {name} resized to {size}")

    @app.post("/ui/volumes/{name}/delete", include_in_schema=False)
    async def delete_volume(request: Request, name: str, force: str = Form("")) -> Response:
        refused = admin_or_refusal(request)
        if refused:
            return flash(request, None, refused)
        _, error = await attempt("volume.delete", {"name": name, "force": force == "on"})
        resp = flash(request, None if error else f"volume {name} deleted", error, refresh=False)
        if not error:
            resp.headers["HX-Redirect"] = "/volumes"
        return resp

    @app.post("/ui/volumes/{name}/qos", include_in_schema=False)
    async def set_qos(request: Request, name: str) -> Response:
        refused = admin_or_refusal(request)
        if refused:
            return flash(request, None, refused)
        form = await request.form()
        limits: dict[str, Any] = {}
        for key, value in form.items():
            text = str(value).strip()
            if text:
                limits[key] = int(text) if text.isdigit() else text
        _, error = await attempt("qos.set", {"volume": name, "limits": limits, "clear": True})
        return flash(request, None if error else f"volume {name}: QoS set", error)

    @app.post("/ui/volumes/{name}/export", include_in_schema=False)
    async def export_volume(request: Request, name: str, protocol: str = Form(""), target: str = Form("")) -> Response:
        return await change(request, "export.add", {"protocol": protocol, "name": target.strip() or name, "volume": name}, f"volume {name} exported over {protocol}")

    @app.post("/ui/volumes/{name}/snapshots", include_in_schema=False)
    async def snapshot(request: Request, name: str, snapshot: str = Form("")) -> Response:
        return await change(request, "snapshot.create", {"volume": name, "name": snapshot.strip()}, f"snapshot {snapshot} of {name} taken")

    @app.post("/ui/volumes/{name}/snapshots/{snap}/delete", include_in_schema=False)
    async def snapshot_delete(request: Request, name: str, snap: str) -> Response:
        return await change(request, "snapshot.delete", {"volume": name, "name": snap}, f"snapshot {snap} deleted")

    @app.post("/ui/pools/{name}/fail", include_in_schema=False)
    async def fail_member(request: Request, name: str, member: str = Form("")) -> Response:
        return await change(request, "pool.fail", {"name": name, "member": member}, f"pool {name}: member {member} marked failed")

    @app.post("/ui/pools/{name}/replace", include_in_schema=False)
    async def replace_member(request: Request, name: str, index: str = Form(""), device: str = Form("")) -> Response:
        refused = admin_or_refusal(request)
        if refused:
            return flash(request, None, refused)
        _, error = await attempt("pool.replace", {"name": name, "index": int(index) if index.isdigit() else index,
                                                  "device": device.strip()})
        return flash(request, None if error else f"pool {name}: slot {index} rebuilds onto {device}", error)
