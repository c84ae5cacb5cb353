"""JSON text from files the user names: every way it fails is one error a reader can name."""

from __future__ import annotations

import json
import re

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


BOM = "\ufeff"


@pytest.mark.parametrize("text, marks", [
    (BOM + '{"a": 1}', "two"),  # what a file of two marks reads as: the first is skipped
    (BOM * 2 + "[]", "3"),
    ((BOM * 2 + "[]").encode("utf-8"), "two"),  # bytes: json.loads skips the first mark itself
])
def test_a_text_left_with_a_byte_order_mark_says_to_remove_the_extra_one(text, marks):
    """json.loads refused it as "Unexpected UTF-8 BOM (decode using utf-8-sig)", advice for the
    program that read the file, not for the user who can edit it."""
    with pytest.raises(json.JSONDecodeError) as info:
        jsontext.loads(text)
    assert info.value.msg.startswith(f"the file starts with {marks} byte order marks"), info.value.msg
    assert "remove the extra byte order mark" in info.value.msg
    assert "utf-8-sig" not in info.value.msg
    assert (info.value.lineno, info.value.colno) == (1, 1)


@pytest.mark.parametrize("marks, found", [(1, "one byte order mark, where none belongs; remove it"),
                                           (2, "two byte order marks, where none belongs; remove them"),
                                           (3, "3 byte order marks")])
def test_a_str_that_is_the_text_itself_counts_the_marks_it_holds(marks, found):
    """No decoding skipped a mark of such a str: one mark is one found, not "two"."""
    with pytest.raises(json.JSONDecodeError) as info:
        jsontext.loads(BOM * marks + "[]", decoded_file=False)
    assert info.value.msg.startswith(f"the text starts with {found}"), info.value.msg
    assert (info.value.lineno, info.value.colno) == (1, 1)
    # bytes are a file's, whatever decoded_file says: json.loads skips their first mark
    with pytest.raises(json.JSONDecodeError, match="the file starts with two byte order marks"):
        jsontext.loads((BOM * 2 + "[]").encode("utf-8"), decoded_file=False)


def test_bytes_with_one_byte_order_mark_and_marks_inside_the_json_are_read_as_before():
    assert jsontext.loads((BOM + '{"a": 1}').encode("utf-8")) == {"a": 1}
    assert jsontext.loads('["' + BOM + '"]') == [BOM]
    with pytest.raises(json.JSONDecodeError, match="Expecting value"):  # a mark after a space is not at the start
        jsontext.loads(" " + BOM + "[]")


def test_a_trace_read_back_as_spans_says_to_remove_the_extra_byte_order_mark(tmp_path):
    from ringflow._trace import load_spans

    path = tmp_path / "twice.json"
    path.write_bytes(b"\xef\xbb\xbf" * 2 + b'[{"ph": "X", "ts": 0, "dur": 5, "cat": "h2d", "tid": 1}]')
    # a ValueError naming the file, as for any file that is not a usable trace (ringflow trace's reader)
    with pytest.raises(ValueError, match=re.escape(str(path)) + " .*two byte order marks.*remove the extra byte "
                       "order mark"):
        load_spans(str(path))


def _bench_json() -> str:
    return ('{"workloads": {"seed": {"rows": [{"name": "ringflow", "chunk_bytes": 1048576, "predicted_ms": 1, '
            '"ms_median": 2}]}}}')


@pytest.mark.parametrize("command", ["trace", "plan --compare", "plan --profile"])
def test_a_file_with_two_byte_order_marks_is_named_on_one_line_with_what_to_remove(command, tmp_path, capsys):
    """Every command that reads a JSON file the user names: one error line that names the file
    and says to remove the extra mark, no traceback, and exit 1, as for any other file the
    command cannot use (docs/cli.md keeps 2 for a mistake on the command line itself)."""
    from ringflow._cli import main
    from ringflow._device.hardware import H200_PCIE5

    text = {"trace": '[{"ph": "X", "ts": 0, "dur": 5, "cat": "h2d"}]', "plan --compare": _bench_json(),
            "plan --profile": H200_PCIE5.to_json()}[command]
    path = tmp_path / "twice.json"
    path.write_bytes(b"\xef\xbb\xbf" * 2 + text.encode("utf-8"))
    argv = {"trace": ["trace", str(path)], "plan --compare": ["plan", "--bytes", "64MiB", "--compare", str(path)],
            "plan --profile": ["plan", "--bytes", "64MiB", "--profile", str(path)]}[command]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"ringflow {command.split()[0]}: error: "), err
    assert str(path) in err and "two byte order marks" in err and "remove the extra byte order mark" in err, err
    assert "utf-8-sig" not in err and "BOM" not in err, err
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # one mark: read as without it
    assert main(argv) == 0, capsys.readouterr().err
