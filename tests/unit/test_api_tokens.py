"""API tokens (api/tokens.py): made, checked, revoked; only their hashes are kept, in a file only the owner
reads; a running node's book sees what the CLI changed."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from openvsan.api.tokens import TOKENS_FILE, TokenBook, TokenError


def test_a_token_is_checked_by_its_hash_and_never_kept(tmp_path: Path) -> None:
    book = TokenBook(tmp_path)
    entry, token = book.create("ops", "admin")
    assert token.startswith(f"vsan_{entry.id}_")
    assert book.verify(token) == entry
    text = (tmp_path / TOKENS_FILE).read_text()
    assert token not in text and token.split("_", 2)[2] not in text   # the secret may hold "_" itself
    assert stat.S_IMODE((tmp_path / TOKENS_FILE).stat().st_mode) == 0o600
    assert json.loads(text)["tokens"][0]["role"] == "admin"


@pytest.mark.parametrize("bad", ["", "vsan_", "Bearer x", "vsan_00000000_" + "A" * 43])
def test_malformed_or_unknown_tokens_prove_nothing(tmp_path: Path, bad: str) -> None:
    book = TokenBook(tmp_path)
    book.create("ops", "read-only")
    assert book.verify(bad) is None


def test_a_changed_secret_with_a_known_id_is_refused(tmp_path: Path) -> None:
    book = TokenBook(tmp_path)
    _, token = book.create("ops", "admin")
    last = token[-1]
    forged = token[:-1] + ("A" if last != "A" else "B")
    assert book.verify(forged) is None
    assert book.verify(token) is not None


def test_revoked_by_name_or_id_and_seen_by_another_book_at_once(tmp_path: Path) -> None:
    node, cli = TokenBook(tmp_path), TokenBook(tmp_path)
    a, ta = cli.create("a", "admin")
    b, tb = cli.create("b", "read-only")
    assert node.verify(ta) == a and node.verify(tb) == b
    assert cli.revoke("a") == a
    assert node.verify(ta) is None and node.verify(tb) == b
    cli.revoke(b.id)
    assert node.verify(tb) is None
    assert node.entries() == []


def test_refusals_are_one_line_and_change_nothing(tmp_path: Path) -> None:
    book = TokenBook(tmp_path)
    book.create("ops", "admin")
    before = (tmp_path / TOKENS_FILE).read_bytes()
    with pytest.raises(TokenError, match="role 'root'"):
        book.create("x", "root")
    with pytest.raises(TokenError, match="a token named ops exists"):
        book.create("ops", "read-only")
    with pytest.raises(TokenError, match="name"):
        book.create("-bad name", "admin")
    with pytest.raises(TokenError, match="no API token named 'nope'"):
        book.revoke("nope")
    assert (tmp_path / TOKENS_FILE).read_bytes() == before
