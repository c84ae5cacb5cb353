"""A kernel's C parameter list, read from its source, so that the simulated GPU refuses the
arguments a GPU launch would misread: an array whose dtype is not the pointer's type, a scalar
of another width than its parameter, an array where a value is taken or the other way round,
or a count that does not match. On a GPU nothing checks these: a launch passes raw bytes, and a
``float*`` handed a float64 array reads garbage without an error.

Only what can be read for certain is checked. A source the reader cannot place (a template
instantiation, a name defined by a macro or an ``#include``, overloads, a preprocessor line
among the parameters, a parameter of a type it does not know: a struct, a vector type such as
``float2``, a macro's or a typedef's name) checks nothing there, rather than refuse a kernel
that compiles.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, Optional

import numpy as np

# C type names (qualifiers removed, as _type_key writes them) -> the numpy dtypes whose bytes they read
_C_TYPES: dict[str, frozenset] = {}
# the words of C's built-in types, which C++ takes in any order ("long unsigned int"), and none
# of which names a parameter
_TYPE_KEYWORDS = {"signed", "unsigned", "short", "long", "int", "char", "float", "double", "bool", "void"}


def _type_key(words: list[str]) -> str:
    return " ".join(sorted(words) if all(w in _TYPE_KEYWORDS for w in words) else words)


def _types(dtypes: str, *names: str) -> None:
    for name in names:
        _C_TYPES[_type_key(name.split())] = frozenset(np.dtype(d) for d in dtypes.split())


_types("float32", "float")
_types("float64", "double")
_types("float16", "__half", "half")
_types("bool", "bool")
_types("int8 uint8", "char")
_types("int8", "signed char", "int8_t")
_types("uint8", "unsigned char", "uint8_t")
_types("int16", "short", "short int", "signed short", "signed short int", "int16_t")
_types("uint16", "unsigned short", "unsigned short int", "uint16_t")
_types("int32", "int", "signed", "signed int", "int32_t")
_types("uint32", "unsigned", "unsigned int", "uint32_t")
# (long is 64 bits on Linux, the one platform of the CUDA backend)
_types("int64", "long", "long int", "signed long", "long long", "long long int", "signed long long", "int64_t",
       "ptrdiff_t", "intptr_t")
_types("uint64", "unsigned long", "unsigned long int", "unsigned long long", "unsigned long long int", "uint64_t",
       "size_t", "uintptr_t")
_types("complex64", "cuComplex", "cuFloatComplex")
_types("complex128", "cuDoubleComplex")

_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict", "__grid_constant__"}
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


class Param(NamedTuple):
    """One parameter: its text in the source, whether it is a pointer (None: not known, for a
    type this module does not know written without a ``*``, which a macro or a typedef may make
    a pointer), the numpy dtypes its (pointee) type reads (None: a type this module does not
    know, left unchecked), and whether it is a pointer to memory the kernel may write (not to
    ``const``; False too for a pointee type it does not know, whose typedef or macro may hold
    the ``const``)."""

    text: str
    pointer: Optional[bool]
    dtypes: Optional[frozenset]
    writes: bool = False


def read_params(source: str, name: str) -> Optional[tuple[Param, ...]]:
    """The parameters of the ``__global__`` function ``name`` in ``source``; None where they
    cannot be read for certain (see the module's doc)."""
    if not re.fullmatch(r"[A-Za-z_]\w*", name):  # a template instantiation, a qualified name
        return None
    # a backslash ending a line joins the next to it before comments are read (a "//" comment
    # so ended goes on over the next line)
    text = _COMMENTS.sub(" ", re.sub(r"\\\r?\n", "", source))
    found = re.findall(r"__global__\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?void\s+"
                       r"(?:__launch_bounds__\s*\([^()]*\)\s*)?" + re.escape(name) + r"\s*\(([^()]*)\)\s*\{", text)
    if len(found) != 1:  # absent (a macro's, an include's) or overloaded
        return None
    # every definition of a __global__ function of this name, the ones the pattern above does not
    # read too (parentheses in an attribute or a parameter): of two, the one read may be the one
    # an #if leaves out
    if len(re.findall(r"__global__\b[^;{}]*\b" + re.escape(name) + r"\s*\([^;{}]*\)\s*\{", text)) != 1:
        return None
    body = found[0].strip()
    if "#" in body:  # an #if among the parameters: which of them are compiled depends on macros
        return None
    if body in ("", "void"):
        return ()
    params = []
    for part in body.split(","):
        param = _param(" ".join(part.split()))  # (its text on one line in messages)
        if param is None:
            return None
        params.append(param)
    return tuple(params)


def absent_name(source: str, name: str) -> Optional[list[str]]:
    """Where ``source`` certainly holds no function ``name`` (a name expression: its identifier,
    before any template arguments, appears nowhere in the source outside comments, and no
    ``#include`` or ``##`` token pasting may make it): the names of the ``__global__`` functions
    the source does define, for a message. None where the name is there or may be made."""
    words = re.findall(r"[A-Za-z_]\w*", name.split("<")[0])
    if not words:
        return None
    text = _COMMENTS.sub(" ", re.sub(r"\\\r?\n", "", source))
    if "#include" in text.replace(" ", "") or "##" in text or re.search(r"\b" + re.escape(words[-1]) + r"\b", text):
        return None
    text = re.sub(r"__launch_bounds__\s*\([^()]*\)", " ", text)
    return sorted(set(re.findall(r"__global__\b[^;{}()]*?\b([A-Za-z_]\w*)\s*\(", text)))


def read_launch_bound(source: str, name: str) -> Optional[int]:
    """The most threads per block that the ``__launch_bounds__`` of the ``__global__`` function
    ``name`` in ``source`` allows (its first argument); None where there is none, or where it
    cannot be read for certain (a macro's value, an expression, a name :func:`read_params`
    cannot place). A GPU refuses a launch of more threads per block than that."""
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        return None
    text = _COMMENTS.sub(" ", re.sub(r"\\\r?\n", "", source))
    found = re.findall(r"__global__\s+(?:__launch_bounds__\s*\(([^()]*)\)\s*)?void\s+"
                       r"(?:__launch_bounds__\s*\(([^()]*)\)\s*)?" + re.escape(name) + r"\s*\([^()]*\)\s*\{", text)
    if len(found) != 1 or len(re.findall(r"__global__\b[^;{}]*\b" + re.escape(name) + r"\s*\([^;{}]*\)\s*\{",
                                          text)) != 1:
        return None
    bounds = found[0][0] or found[0][1]
    literal = re.fullmatch(r"\s*(0[xX][0-9a-fA-F]+|[1-9]\d*)[uUlL]*\s*(?:,.*)?", bounds, re.S)
    return int(literal.group(1), 0) if literal else None


def _param(text: str) -> Optional[Param]:
    if "[" in text or "&" in text or "<" in text or "=" in text:
        return None  # an array parameter, a reference, a template argument, a default: not read here
    stars = text.count("*")
    if stars > 1:
        return Param(text, True, None)  # a pointer to pointers: no array of ours is one
    # "const float* x" and "float const* x" point to memory the kernel only reads ("float* const
    # x" is a constant pointer to memory it may write)
    const = "const" in text.split("*")[0].split()
    words = [w for w in text.replace("*", " ").split() if w not in _QUALIFIERS]
    words = [w[5:] if w.startswith("std::") else w for w in words]
    if not words:
        return None
    # the last word is the parameter's name unless the type alone is written (an unnamed parameter)
    type_words = words if words[-1] in _TYPE_KEYWORDS or _type_key(words) in _C_TYPES else words[:-1]
    if not type_words:
        return None
    dtypes = _C_TYPES.get(_type_key(type_words))
    # a name it does not know may be a macro's or a typedef's for a pointer type ("#define PTR
    # float*", "typedef float* floatp"): whether such a parameter takes an array is not known
    pointer = True if stars == 1 else (False if dtypes is not None else None)
    # only a type it knows is known not to be const ("typedef const float cfloat" is)
    writes = stars == 1 and not const and (dtypes is not None or type_words == ["void"])
    return Param(text, pointer, dtypes, writes)


def check_arguments(kernel: str, params: tuple[Param, ...], args: tuple[Any, ...], bound: int = 0) -> None:
    """Refuse ``args`` (numpy arrays and numpy scalars, as the simulated GPU passes them) that a
    launch of ``kernel``, whose parameters are ``params`` (the trailing ``n`` among them), would
    misread. The last ``bound`` of ``args`` are the scalars a ``bind`` fixed, which a wrong
    count's message counts apart from those the bound kernel was given.

    Raises:
        TypeError: naming the argument, its dtype, the parameter's text, and what to pass.
    """
    if len(params) != len(args) + 1:
        takes = f"kernel {kernel!r} takes {len(params)} parameters ({', '.join(p.text for p in params) or 'none'})"
        if bound:
            given, want = len(args) - bound, len(params) - 1 - bound
            advice = (f"pass {want} array{'s' * (want != 1)} to the bound kernel" if want >= 1
                      else f"bind {max(0, len(params) - 2)} scalars at most (the bound kernel takes an array)")
            raise TypeError(f"{takes}: one for each of the {given} argument{'s' * (given != 1)} given and the "
                            f"{bound} scalar{'s' * (bound != 1)} bound by bind(...), then size_t n (passed by the "
                            f"launch); {advice}, or change the kernel's parameters")
        raise TypeError(f"{takes}: one for each of the {len(args)} arguments given, then size_t n (passed by the "
                        f"launch); pass {max(0, len(params) - 1)} arguments, or change the kernel's parameters")
    last = params[-1]
    if last.pointer:
        raise TypeError(f"kernel {kernel!r}: its last parameter ({last.text}) is a pointer, but a launch passes the "
                        f"element count n there; add size_t n as the kernel's last parameter")
    if last.dtypes is not None and any(d.kind not in "iu" for d in last.dtypes):
        raise TypeError(f"kernel {kernel!r}: its last parameter ({last.text}) is not an integer, but a launch passes "
                        f"the element count n there as a size_t, which it would misread; declare it size_t n")
    for i, (param, a) in enumerate(zip(params, args)):
        array = isinstance(a, np.ndarray)
        if param.pointer and not array:
            raise TypeError(f"kernel {kernel!r}: argument {i} is a {np.asarray(a).dtype} scalar, but parameter {i} "
                            f"({param.text}) is a pointer; pass an array there")
        if param.pointer is False and array:
            raise TypeError(f"kernel {kernel!r}: argument {i} is an array, but parameter {i} ({param.text}) takes a "
                            f"value; pass a numpy scalar there (e.g. np.float32(2.0))")
        if param.writes and array and not a.flags.writeable:
            raise TypeError(f"kernel {kernel!r}: argument {i} is a read-only array, but parameter {i} ({param.text}) "
                            f"points to memory the kernel may write; pass a writable array (or declare it const)")
        dtype = a.dtype if array else np.asarray(a).dtype
        if param.dtypes is not None and dtype not in param.dtypes:
            want = " or ".join(sorted(str(d) for d in param.dtypes))
            what = "array" if array else "scalar"
            raise TypeError(f"kernel {kernel!r}: argument {i} is a {dtype} {what}, but parameter {i} ({param.text}) "
                            f"reads {want}, so a launch would misread its bytes; pass a {want} {what} (or change the "
                            f"kernel)")
