"""JSON text read from files the user names (a trace, a bench result, a hardware profile), where
every way the text can fail to be usable JSON is one :class:`json.JSONDecodeError`; and values
made fit to write as JSON (:func:`plain`).

:func:`json.loads` lets two such texts escape as other errors: arrays or objects nested deeper
than the interpreter's recursion limit (a RecursionError, which a caller would take for a bug)
and an integer longer than Python converts (a ValueError whose advice, to raise the interpreter's
limit, is not the user's to follow).

A file that starts with two byte order marks keeps one after :data:`ENCODING` skips the first, which
:func:`json.loads` refuses with advice for a programmer; :func:`loads` says what to remove.

It also keeps the last of two values an object gives one key, without a word: a reader that must
not guess which was meant asks for ``unique_keys`` (:class:`DuplicateKeyError`).
"""

from __future__ import annotations

import json
import math
import numbers
import re
from typing import Any

NESTING = 512  # the depth a message points at; the parser itself gives up near the recursion limit
# how such a file is decoded: UTF-8, a byte order mark first (which some editors write) skipped; json.loads
# refuses one as part of the text, with advice for a programmer ("decode using utf-8-sig")
ENCODING = "utf-8-sig"
_BOM = "\ufeff"
_BOM_BYTES = _BOM.encode("utf-8")
_LONG_INT = re.compile(r"-?\d{4000,}")


class DuplicateKeyError(ValueError):
    """An object of the JSON text gives :attr:`key` more than once."""

    def __init__(self, key: str):
        super().__init__(f"the key {key!r} appears more than once in one object")
        self.key = key


def loads(text: "str | bytes", *, unique_keys: bool = False, decoded_file: bool = True) -> Any:
    """``json.loads(text)``, every failure a :class:`json.JSONDecodeError`; with
    ``unique_keys``, an object that gives a key twice is refused (``json.loads`` keeps the last
    value).

    ``text`` is what a file read with :data:`ENCODING` gives (its first byte order mark skipped),
    or the file's bytes; with ``decoded_file`` False, a str is the JSON text itself (no decoding
    skipped a mark), so a message about the marks it starts with counts those of the text.

    Raises:
        json.JSONDecodeError: not JSON, nested too deeply, a number too long to convert, or a
            byte order mark left at the start (the file began with two or more, or a str that is
            the text itself with one or more; the message says how many and to remove them); the
            message and position say which and where.
        DuplicateKeyError: ``unique_keys`` and an object gives a key more than once (the first
            such object the parser finishes; the error names the key).
        UnicodeDecodeError, TypeError: as :func:`json.loads` (bytes that are not text, or
            not a string at all).
    """
    extra = _extra_marks(text)
    if extra:
        # json.loads says "Unexpected UTF-8 BOM (decode using utf-8-sig)": advice for the
        # program that decoded the file, when what the user can do is edit the file
        raise json.JSONDecodeError(_marks_message(extra, itself=isinstance(text, str) and not decoded_file),
                                   _as_text(text), 0)
    try:
        return json.loads(text, parse_int=_integer, object_pairs_hook=_unique if unique_keys else None)
    except RecursionError:
        doc = _as_text(text)
        raise json.JSONDecodeError(f"arrays or objects nested too deeply (more than {NESTING} levels)", doc,
                                   _deep_at(doc)) from None
    except ValueError as exc:
        if isinstance(exc, (json.JSONDecodeError, DuplicateKeyError)):
            raise
        doc = _as_text(text)
        found = _LONG_INT.search(doc)
        if found is None:
            raise
        digits = len(found.group().lstrip("-"))
        raise json.JSONDecodeError(f"a number of {digits} digits, too long to read", doc, found.start()) from None


def plain(value: Any) -> Any:
    """``value`` with every float that is NaN or infinite replaced by None, recursively through
    dicts, lists and tuples (tuples become lists); other floats (numpy's too) as Python floats.

    JSON has no NaN or infinity: ``json.dumps`` writes them as bare words that strict readers
    refuse, and a figure that does not exist (an efficiency of a run that delivered nothing)
    is null.
    """
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        value = float(value)
        return value if math.isfinite(value) else None
    return value


def _integer(digits: str) -> "int | float":
    """A JSON integer, as ``int``; one beyond a float's range (over 308 digits) as an infinity
    of its sign, which every reader's check for a finite number then refuses by name (as an int
    it broke their float arithmetic with an OverflowError)."""
    value = int(digits)
    if len(digits) > 308:
        try:
            float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    return value


def _unique(pairs: list) -> dict:
    """An object's ``(key, value)`` pairs as a dict, or :class:`DuplicateKeyError` for the first
    key given again."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return obj


def _extra_marks(text: "str | bytes") -> int:
    """How many byte order marks start ``text`` beyond the one that a file's decoding skips: all
    those of a text (already decoded), all but the first of bytes (``json.loads`` skips that one)."""
    if isinstance(text, str):
        mark, skipped = _BOM, 0
    elif isinstance(text, (bytes, bytearray)):
        mark, skipped = _BOM_BYTES, 1
    else:
        return 0
    n = 0
    while text.startswith(mark, n * len(mark)):
        n += 1
    return max(0, n - skipped)


def _marks_message(extra: int, *, itself: bool) -> str:
    """What to say of a text that starts with ``extra`` byte order marks more than belong: a str
    that is the JSON text itself (``itself``) takes none, so each is one it holds; a file
    takes one, which its decoding skipped (a str) or ``json.loads`` skips (bytes)."""
    if itself:
        found = "one byte order mark" if extra == 1 else f"{_count(extra)} byte order marks"
        return f"the text starts with {found}, where none belongs; remove {'it' if extra == 1 else 'them'}"
    return (f"the file starts with {_count(extra + 1)} byte order marks, where one at most belongs; "
            f"remove the extra byte order mark{'s' if extra > 1 else ''}")


def _count(n: int) -> str:
    return "two" if n == 2 else str(n)


def _as_text(text: "str | bytes") -> str:
    return text.decode("utf-8", "replace") if isinstance(text, (bytes, bytearray)) else text


def _deep_at(doc: str) -> int:
    """Where the nesting of ``doc``'s arrays and objects first passes :data:`NESTING` levels (0
    if it never does), strings skipped."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(doc):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > NESTING:
                return i
        elif ch in "]}":
            depth -= 1
    return 0
