"""Command-line flags made from dataclass fields: a field's flag, help and default live in one place.

A config's field says its flag in its metadata::

    stage: int = field(default=2, metadata=flag("ZeRO stage 0, 1, 2 or 3"))

and :func:`add_flags` puts one argparse option per such field on a parser (``--stage``, an int, as
the field's type says); :func:`given` reads back the fields whose flag was given, so that the
dataclass itself supplies every default and checks every value. A help text may name the field's
default as ``{default}``.
"""
from dataclasses import MISSING, fields
from typing import Optional, Union, get_args, get_origin


def flag(help: Optional[str] = None, *, name: Optional[str] = None, metavar: Optional[str] = None,
         const=None, append: bool = False) -> dict:
    """A field's metadata: its flag. ``name``: the flag (default ``--`` and the field's name with dashes);
    ``const``: a switch, which sets the field to this value; ``append``: repeatable, the values a tuple."""
    return {"flag": {"help": help, "name": name, "metavar": metavar, "const": const, "append": append}}


def flag_name(cls, name: str) -> str:
    """The flag of ``cls``'s field ``name`` (``--`` and the name with dashes where its metadata names none)."""
    meta = next((f.metadata.get("flag") for f in fields(cls) if f.name == name), None) or {}
    return meta.get("name") or "--" + name.replace("_", "-")


def _kind(tp):
    """The argparse type of a field's declared type: int or float (also inside Optional), else text."""
    if get_origin(tp) is Union:
        tp = next(a for a in get_args(tp) if a is not type(None))
    return tp if tp in (int, float) else None


def _default(f):
    return f.default if f.default is not MISSING else f.default_factory()


def flagged(cls):
    """The fields of ``cls`` that have a flag, in order."""
    return [f for f in fields(cls) if "flag" in f.metadata]


def add_flags(parser, cls) -> None:
    """One option per flagged field of ``cls``, each defaulting to None (not given), its value stored as
    ``ClassName.field``; its type the field's (int, float, else text), a switch where it has a ``const``."""
    for f in flagged(cls):
        meta = f.metadata["flag"]
        text = meta["help"] and meta["help"].format(default=_default(f))
        name = flag_name(cls, f.name)
        opts = dict(dest=f"{cls.__name__}.{f.name}", default=None, help=text)
        if meta["const"] is not None:
            opts.update(action="store_const", const=meta["const"])
        else:
            opts.update(metavar=meta["metavar"] or name.lstrip("-").replace("-", "_").upper(),
                        action="append" if meta["append"] else "store", type=_kind(f.type))
        parser.add_argument(name, **opts)


def given(ns, cls) -> dict:
    """{field: value} of ``cls``'s flags given in the parsed ``ns`` (repeated flags as a tuple)."""
    out = {}
    for f in flagged(cls):
        value = getattr(ns, f"{cls.__name__}.{f.name}", None)
        if value is not None:
            out[f.name] = tuple(value) if isinstance(value, list) else value
    return out
