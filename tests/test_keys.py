from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmstore.errors import InvalidKey
from fmstore.keys import MAX_KEY_BYTES, join, validate_key, validate_prefix

ROOT = "/srv/tier"


@given(st.text(min_size=0, max_size=300))
@settings(max_examples=2000, deadline=None)
def test_no_valid_key_escapes_the_root(key):
    try:
        validate_key(key)
    except InvalidKey:
        return
    path = os.path.normpath(os.path.join(ROOT, key))
    assert path.startswith(ROOT + "/")
    assert "\x00" not in key and not key.startswith("/")
    assert ".." not in key.split("/")


@given(
    st.lists(
        st.sampled_from(["..", ".", "", "a", "b", "/", "\\", "\x00", "é"]), min_size=1, max_size=12
    )
)
@settings(max_examples=2000, deadline=None)
def test_adversarial_segments(parts):
    key = "/".join(parts)
    try:
        validate_key(key)
    except InvalidKey:
        return
    assert os.path.normpath(os.path.join(ROOT, key)).startswith(ROOT + "/")


@pytest.mark.parametrize(
    "bad,why",
    [
        ("", "empty"),
        ("/etc/passwd", "relative"),
        ("a/../b", "'..'"),
        ("a/./b", "'.'"),
        ("a//b", "empty segment"),
        ("a/", "empty segment"),
        ("a\x00b", "NUL"),
        ("a\nb", "control"),
        ("x" * (MAX_KEY_BYTES + 1), "longer than"),
        ("a\\b", "backslash"),
    ],
)
def test_bad_keys_say_why(bad, why):
    with pytest.raises(InvalidKey, match=why):
        validate_key(bad)


def test_good_keys_pass():
    for k in ["a", "a/b.c", "ckpt/step-00001/manifest.json", "é/ü", "..a", "a..", ".hidden"]:
        assert validate_key(k) == k


def test_prefix_normalisation():
    assert validate_prefix("") == ""
    assert validate_prefix("a/b") == "a/b/"
    assert validate_prefix("a/b/") == "a/b/"
    with pytest.raises(InvalidKey):
        validate_prefix("../a")


def test_join():
    assert join("a/", "/b", "", "c") == "a/b/c"
    with pytest.raises(InvalidKey):
        join("a", "..", "b")
