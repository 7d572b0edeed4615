"""API tokens: `vsan token create|list|revoke`, and who a request's bearer token is (api/app.py).

A token is `vsan_<id>_<secret>`: `id` (8 hex digits) finds its entry, `secret` (32 random bytes, base64url)
is what proves it. Only the SHA-256 of the whole token is kept, in `<data_dir>/api-tokens.json` (mode 0600,
replaced atomically, changes serialized by a lock file), so neither the file nor a backup of it lets anyone
in. A token has 256 random bits: a plain hash is enough, a password hash (slow on purpose) would only slow
every request. The running node reads the file again when it changes, so a token created or revoked by the
CLI counts at the next request.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

TOKENS_FILE = "api-tokens.json"
LOCK_FILE = "api-tokens.lock"
ROLES = ("admin", "read-only")
_TOKEN = re.compile(r"vsan_([0-9a-f]{8})_[A-Za-z0-9_-]{43}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


class TokenError(ValueError):
    """A token request that cannot be done (unknown role, name taken, no such token); str() is the line."""


@dataclass(frozen=True)
class TokenEntry:
    id: str
    name: str
    role: str
    digest: str        # sha256 of the whole token, hex
    created: float     # unix time

    def public(self) -> dict[str, object]:
        """What `vsan token list` and the API show: everything but the digest."""
        return {"id": self.id, "name": self.name, "role": self.role,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))}


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenBook:
    """The tokens of one data dir."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / TOKENS_FILE
        self._lock = data_dir / LOCK_FILE
        self._seen: tuple[int, int] | None = None    # (mtime_ns, inode) of what _entries holds
        self._entries: dict[str, TokenEntry] = {}
        self._local: dict[str, TokenEntry] = {}       # held in memory only: the local CLI's (local_token)

    # ---- reading

    def entries(self) -> list[TokenEntry]:
        self._refresh()
        return sorted(self._entries.values(), key=lambda e: (e.created, e.id))

    def verify(self, token: str) -> TokenEntry | None:
        """The entry `token` proves, or None (malformed, unknown, revoked or wrong)."""
        m = _TOKEN.fullmatch(token)
        if m is None:
            return None
        self._refresh()
        entry = self._entries.get(m.group(1)) or self._local.get(m.group(1))
        if entry is None or not hmac.compare_digest(entry.digest, _digest(token)):
            return None
        return entry

    def _refresh(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._seen, self._entries = None, {}
            return
        if self._seen == (st.st_mtime_ns, st.st_ino):
            return
        self._entries = {e.id: e for e in self._load()}
        self._seen = (st.st_mtime_ns, st.st_ino)

    def _load(self) -> list[TokenEntry]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            raise TokenError(f"{self.path}: cannot read the API tokens: {e}") from None
        return [TokenEntry(**t) for t in doc.get("tokens", [])]

    # ---- changing (the CLI, and a node's first start)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[list[TokenEntry]]:
        fd = os.open(self._lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            entries = self._load()
            yield entries
            self._save(entries)
        finally:
            os.close(fd)

    def _save(self, entries: list[TokenEntry]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = json.dumps({"version": 1, "tokens": [asdict(e) for e in entries]}, indent=1).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._seen = None

    def create(self, name: str, role: str) -> tuple[TokenEntry, str]:
        """A new token: its entry, and the token itself (shown once, kept nowhere)."""
        if role not in ROLES:
            raise TokenError(f"role {role!r}: use one of {', '.join(ROLES)}")
        if _NAME.fullmatch(name) is None:
            raise TokenError(f"name {name!r}: use 1 to 64 letters, digits, '.', '_', '@' or '-' (not first)")
        with self._locked() as entries:
            if any(e.name == name for e in entries):
                raise TokenError(f"a token named {name} exists; pick another name, or `vsan token revoke {name}`")
            while True:
                tid = secrets.token_hex(4)
                if all(e.id != tid for e in entries):
                    break
            token = f"vsan_{tid}_{secrets.token_urlsafe(32)}"
            entry = TokenEntry(tid, name, role, _digest(token), time.time())
            entries.append(entry)
        return entry, token

    def local_token(self, name: str = "local-cli") -> str:
        """An admin token that lives as long as this process and is in no file but the one the running node
        gives its local CLI (api/server.py LOCAL_API, mode 0600: whoever may use the control socket)."""
        while True:
            tid = secrets.token_hex(4)
            if tid not in self._local and all(e.id != tid for e in self._load()):
                break
        token = f"vsan_{tid}_{secrets.token_urlsafe(32)}"
        self._local[tid] = TokenEntry(tid, name, "admin", _digest(token), time.time())
        return token

    def revoke(self, which: str) -> TokenEntry:
        """Revoke the token named or numbered `which`."""
        with self._locked() as entries:
            found = next((e for e in entries if which in (e.name, e.id)), None)
            if found is None:
                raise TokenError(f"no API token named {which!r}; `vsan token list` shows them")
            entries.remove(found)
        return found
