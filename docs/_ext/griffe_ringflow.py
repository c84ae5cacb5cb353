"""A griffe extension for ringflow's API reference (loaded by mkdocstrings, see mkdocs.yml).

* Parameters whose names start with ``_`` are test or internal hooks: they are dropped from the
  rendered signatures.
* ``Kernel`` keeps its documentation in its module's docstring; while the class has none of its
  own, the reference shows that text up to the paragraph on ``bind`` (which the guide covers).
* The docstrings use Sphinx roles (``:class:`Pipeline```). They are rewritten to Markdown: a
  link where the target is a public object (one of ``ringflow.__all__``, which the reference
  documents, or a member of one), plain code where it is private.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


class RingflowDocs(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        if pkg.name != "ringflow":
            return
        public = {}  # canonical path of each exported object -> its public name
        for name in pkg.exports or ():
            member = pkg.members.get(name)
            if member is not None and not name.startswith("_"):
                public[member.target_path if member.is_alias else member.path] = name
        _document_kernel(pkg)
        for obj in _walk(pkg, set()):
            if obj.is_function:
                _drop_private_parameters(obj)
            if obj.docstring is not None:
                obj.docstring.value = ROLE.sub(lambda m: _markdown(m, pkg, public), obj.docstring.value)


def _walk(obj: griffe.Object, seen: set) -> list:
    out = []
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    out.append(obj)
    for member in obj.members.values():
        if not member.is_alias:
            out.extend(_walk(member, seen))
    return out


def _document_kernel(pkg: griffe.Module) -> None:
    module = pkg.members.get("_kernel")
    kernel = module.members.get("Kernel") if module is not None else None
    if kernel is None or kernel.docstring is not None or module.docstring is None:
        return
    paragraphs = []
    for para in module.docstring.value.split("\n\n"):
        if para.lstrip().startswith("``kernel.bind"):
            break
        paragraphs.append(para[:-2] + ":" if para.endswith("::") else para)  # rst literal block marker
    kernel.docstring = griffe.Docstring("\n\n".join(paragraphs), parent=kernel)


def _drop_private_parameters(fn: griffe.Function) -> None:
    keep = [p for p in fn.parameters if not (p.name.startswith("_") and not p.name.startswith("__"))]
    if len(keep) != len(fn.parameters):
        fn.parameters = griffe.Parameters(*keep)


def _public_path(path: str, pkg: griffe.Module, public: dict) -> str | None:
    """``ringflow.Name[.member]`` for an object reached through any module path, else None."""
    parts = path.split(".")
    if parts[0] in public.values():  # a bare public name, or a member of one
        return "ringflow." + path
    try:
        obj = pkg["ringflow." + path if not path.startswith("ringflow.") else path]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    full = obj.target_path if obj.is_alias else obj.path
    prefix, rest = full, ""
    while prefix:
        if prefix in public:
            return f"ringflow.{public[prefix]}{rest}"
        prefix, _, last = prefix.rpartition(".")
        rest = f".{last}{rest}"
    return None


def _markdown(match: re.Match, pkg: griffe.Module, public: dict) -> str:
    short, target = match.group(1) == "~", match.group(2).strip().lstrip(".")
    path = target[len("ringflow."):] if target.startswith("ringflow.") else target
    shown = path.rsplit(".", 1)[-1] if short else target
    link = _public_path(path, pkg, public)
    return f"[`{shown}`][{link}]" if link else f"`{shown}`"
