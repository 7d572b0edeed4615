"""Text keys (RFC 7143 §6.1, §6.2, §13) and CHAP values (§12.1.3) against random and hostile input.

parse_text may only return pairs or raise TextError; negotiate_key and the CHAP authenticator may only
answer (or raise ChapError), and every answer must obey the key's rule: a MIN key never answers above
what either side offered, a LIST key answers one of the offered values, and so on.
"""

from __future__ import annotations

import random

import budget
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openvsan.protocol.iscsi.chap import ChapAuthenticator, ChapError, decode_binary
from openvsan.protocol.iscsi.keys import KEYS, Kind, Params, TextError, encode_text, negotiate_key, parse_text

# Values that have broken parsers before: non-ASCII digits (str.isdigit() is True for '²' and '١', and
# int('²') raises), signs, spaces, hex and base64 forms, overflows, empty, separators.
NASTY_VALUES = ["", "0", "1", "-1", "+1", " 1", "1 ", "01", "00000000001", "4294967296", "18446744073709551616",
                "9" * 300, "²", "³", "¹²", "١٢٣", "٣", "𝟗", "１２", "0x10", "0X10", "0b1", "1e3", "1.5", "Yes", "No",
                "yes", "Yes,No", "None", "CRC32C", "CRC32C,None", "None,CRC32C", "crc32c", ",", ",,", "CRC32C,",
                "NotUnderstood", "Irrelevant", "Reject", "\u00a0", "\t", "=", "a=b", "x" * 300, "RFC3720",
                "2", "3", "8192", "512", "511", "16777215", "16777216", "65535", "65536", "3600", "3601"]
KEY_NAMES = list(KEYS) + ["MaxRecvDataSegmentLength", "InitiatorName", "TargetName", "SessionType",
                          "SendTargets", "TargetAddress", "TargetAlias", "TargetPortalGroupTag", "AuthMethod",
                          "X-com.example.thing", "X#private", "Unknown", "maxburstlength", "", "CHAP_A"]


def random_value(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.5:
        return rng.choice(NASTY_VALUES)
    if r < 0.75:
        return str(rng.choice((rng.randrange(1 << 32), rng.randrange(1 << 25), rng.randrange(5000))))
    if r < 0.9:
        return ",".join(rng.choice(NASTY_VALUES) for _ in range(rng.randrange(1, 4)))
    return "".join(chr(rng.choice((rng.randrange(32, 127), rng.randrange(0x80, 0x3000)))) for _ in range(8))


def check_answer(key: str, value: str, discovery: bool, answer: str | None, params: Params) -> None:
    """The RFC 7143 §6.2 rules for the target's answer to one offered key."""
    if key.startswith(("X-", "X#")):
        assert answer == "NotUnderstood"
        return
    if value in ("NotUnderstood", "Irrelevant", "Reject"):
        return
    if key == "MaxRecvDataSegmentLength":  # §13.12: declarative, no answer
        assert answer in (None, "Reject")
        if answer is None:
            assert 512 <= params.initiator_mrdsl <= (1 << 24) - 1
        return
    spec = KEYS.get(key)
    if spec is None:
        assert answer == "NotUnderstood"
        return
    assert isinstance(answer, str)
    if spec.normal_only and discovery:
        assert answer == "Irrelevant"
        return
    if spec.kind is Kind.ANSWER:
        assert answer == spec.ours
    elif spec.kind is Kind.LIST:
        assert answer == "Reject" or (answer in spec.choices and answer in [v.strip() for v in value.split(",")])
    elif spec.kind in (Kind.AND, Kind.OR):
        assert answer in ("Yes", "No", "Reject")
        if answer != "Reject":
            assert value in ("Yes", "No")
            if spec.kind is Kind.AND and value == "No":
                assert answer == "No"
            if spec.kind is Kind.OR and value == "Yes":
                assert answer == "Yes"
    else:
        if answer == "Reject":
            return
        assert answer.isascii() and answer.isdigit(), answer
        n = int(answer)
        assert spec.lo <= n <= spec.hi
        offered = int(value)
        if spec.kind is Kind.MIN:
            assert n <= offered and n <= int(spec.ours)
        else:
            assert n >= offered and n >= int(spec.ours)


def check_params(p: Params) -> None:
    """Whatever was negotiated, the parameters the session runs with stay legal (§13)."""
    assert 512 <= p.initiator_mrdsl <= (1 << 24) - 1
    assert 512 <= p.max_burst_length <= (1 << 24) - 1
    assert 512 <= p.first_burst_length <= (1 << 24) - 1
    assert 1 <= p.max_outstanding_r2t <= 65535
    assert 0 <= p.error_recovery_level <= 2


@pytest.mark.parametrize("seed", budget.SEEDS)
def test_negotiate_random_keys(seed: int) -> None:
    rng = random.Random(seed)
    for i in range(5000):
        params = Params()
        discovery = rng.random() < 0.3
        for _ in range(rng.randrange(1, 6)):
            key = rng.choice(KEY_NAMES)
            value = random_value(rng)
            try:
                answer = negotiate_key(key, value, discovery=discovery, params=params)
                check_answer(key, value, discovery, answer, params)
            except Exception as e:
                raise AssertionError(f"seed {seed} input {i}: {key}={value!r}: {e!r}") from e
        check_params(params)
        budget.count()


@pytest.mark.parametrize("value", ["²", "¹²", "٣", "١", "𝟗", "１２"])
@pytest.mark.parametrize("key", ["MaxRecvDataSegmentLength", "MaxBurstLength", "ErrorRecoveryLevel"])
def test_non_ascii_digits_are_rejected_not_crashed(key: str, value: str) -> None:
    """§6.1: numbers are decimal-constants of ASCII digits; anything else gets Reject, never an exception."""
    params = Params()
    answer = negotiate_key(key, value, discovery=False, params=params)
    assert answer in ("Reject", None) if key == "MaxRecvDataSegmentLength" else answer == "Reject"
    assert params == Params()  # nothing applied


@pytest.mark.parametrize("seed", budget.SEEDS)
def test_parse_text_random_bytes(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = b"=\0abcXY-#_.:,0123456789 \xff\xc3\xa9"
    for i in range(3000):
        if rng.random() < 0.5:
            raw = bytes(rng.choice(alphabet) for _ in range(rng.randrange(200)))
        else:
            raw = rng.randbytes(rng.randrange(300))
        try:
            pairs = parse_text(raw)
        except TextError:
            budget.count()
            continue
        except Exception as e:
            raise AssertionError(f"seed {seed} input {i}: {raw!r}: {e!r}") from e
        for k, v in pairs:
            assert k and "=" not in k and "\0" not in k and "\0" not in v
        budget.count()


key_st = st.text(st.characters(blacklist_characters="=\0", blacklist_categories=("Cs",)), min_size=1, max_size=63)
value_st = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=300)


@settings(max_examples=budget.hypothesis_examples(400), deadline=None)
@given(st.lists(st.tuples(key_st, value_st), max_size=10))
def test_hypothesis_text_roundtrip(pairs: list[tuple[str, str]]) -> None:
    """What encode_text writes, parse_text reads back (keys ≤ 63 bytes as §6.1 allows)."""
    try:
        got = parse_text(encode_text(pairs))
    except TextError:
        assert any(len(k.encode()) > 63 for k, _ in pairs)
        budget.count()
        return
    assert got == pairs
    budget.count()


@settings(max_examples=budget.hypothesis_examples(600), deadline=None)
@given(st.sampled_from(KEY_NAMES), st.one_of(st.sampled_from(NASTY_VALUES), st.text(max_size=20),
                                             st.integers(min_value=0, max_value=1 << 40).map(str)),
       st.booleans())
def test_hypothesis_negotiate(key: str, value: str, discovery: bool) -> None:
    params = Params()
    answer = negotiate_key(key, value, discovery=discovery, params=params)
    check_answer(key, value, discovery, answer, params)
    check_params(params)
    budget.count()


# --- CHAP values (§12.1.3) ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", budget.SEEDS)
def test_chap_hostile_values(seed: int) -> None:
    """CHAP_A lists, CHAP_I identifiers, CHAP_R and CHAP_C binary values: an answer or ChapError only."""
    rng = random.Random(seed)
    binaries = ["", "0x", "0X", "0b", "0B", "0xZZ", "0x123", "0b====", "0b!!", "1234", "0x" + "ab" * 16,
                "0b" + "QUJD", "0x" + "00" * 2000, "²", "0x²"]
    for i in range(2000):
        a = ChapAuthenticator("user", "secret-secret", "tgt", "tgt-secret-12")
        chap_a = ",".join(rng.choice(["5", "6", "7", "8", "99", "", "x", "²", "٥", " 5", "-5"])
                          for _ in range(rng.randrange(1, 4)))
        try:
            answer = a.choose(chap_a)
        except ChapError:
            budget.count()
            continue
        except Exception as e:
            raise AssertionError(f"seed {seed} input {i}: CHAP_A={chap_a!r}: {e!r}") from e
        assert answer[0][0] == "CHAP_A" and int(answer[0][1]) in (5, 6, 7, 8)
        keys = {"CHAP_N": rng.choice(["user", "other", ""]), "CHAP_R": rng.choice(binaries)}
        if rng.random() < 0.5:
            keys["CHAP_I"] = rng.choice(["0", "255", "256", "-1", "", "²", "٣", "x"])
            keys["CHAP_C"] = rng.choice(binaries)
        try:
            a.verify(keys)
            raise AssertionError(f"seed {seed} input {i}: a random CHAP_R was accepted: {keys}")
        except ChapError:
            pass
        except Exception as e:
            raise AssertionError(f"seed {seed} input {i}: {keys}: {e!r}") from e
        budget.count()


@pytest.mark.parametrize("value", ["", "abc", "0xZZ", "0b!!", "0x²", "0b²", "0x 1"])
def test_decode_binary_errors(value: str) -> None:
    with pytest.raises(ChapError):
        decode_binary(value)
