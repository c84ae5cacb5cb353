"""JSON text from files the user names: every way it fails is one error a reader can name."""

from __future__ import annotations

import json

import pytest

from ringflow import _jsontext as jsontext


@pytest.mark.parametrize("text, key", [
    ('{"a": 1, "a": 2}', "a"),
    ('{"outer": {"b": 1, "c": 2, "b": 3}}', "b"),
    ('[{"x": 1}, {"y": [1, {"z": 0, "z": 0}]}]', "z"),
    ('{"k\\u00e9": 1, "k\\u00e9": 1}', "k\u00e9"),  # the same key escaped: one key
])
def test_a_key_given_twice_in_one_object_is_refused_naming_it(text, key):
    with pytest.raises(jsontext.DuplicateKeyError) as info:
        jsontext.loads(text, unique_keys=True)
    assert info.value.key == key and repr(key) in str(info.value)
    assert isinstance(info.value, ValueError)
    assert jsontext.loads(text) == json.loads(text)  # unasked, the last value is kept, as json.loads does


def test_the_same_key_in_two_objects_is_no_duplicate():
    text = '{"a": {"k": 1}, "b": {"k": 2}, "k": [{"k": 3}, {"k": 4}]}'
    assert jsontext.loads(text, unique_keys=True) == json.loads(text)


def test_a_duplicate_key_is_not_taken_for_a_number_too_long_to_read():
    """The text also holds a number of thousands of digits, after the object that gives a key
    twice: the duplicate, met first, is what is reported."""
    text = '[{"a": 1, "a": 2}, ' + "1" * 5000 + ']'
    with pytest.raises(jsontext.DuplicateKeyError, match="'a'"):
        jsontext.loads(text, unique_keys=True)
