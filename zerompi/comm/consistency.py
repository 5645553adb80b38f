"""Start-up consistency check: every rank must run the same configuration and model.

Ranks started with different flags (an MPMD launch, a stale node, a different model
file) build different layouts and then wait in collectives that never match. So before
the first collective that depends on them, every rank hashes its settings and the ranks
compare the digests with one small all-gather (16 bytes per rank). Only when they differ
do the ranks exchange the field values, to name the differing fields and the ranks;
then every rank raises the same MismatchError (a ConfigError: exit status 2).
"""
import hashlib
import json
from dataclasses import asdict
from typing import Any, Dict, List, Mapping

from ..errors import MismatchError
from .watchdog import watched

MAX_FIELDS_SHOWN = 5    # differing fields named in the message; the rest are counted
MAX_VALUE_CHARS = 40    # longer values are cut and shown with their digest


def flatten(values: Mapping[str, Any], prefix: str = "") -> Dict[str, str]:
    """Nested mapping -> {"dotted.key": canonical JSON text}; lists stay whole (one field)."""
    out: Dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value, sort_keys=True, default=repr)
    return out


def digest(fields: Mapping[str, str]) -> bytes:
    """16-byte SHA-256 digest of flattened fields (order-independent)."""
    text = json.dumps(sorted(fields.items()))
    return hashlib.sha256(text.encode()).digest()[:16]


def check_consistent(comm, what: str, values: Mapping[str, Any]) -> None:
    """Raise MismatchError on every rank unless every rank of ``comm`` passed equal ``values``.

    ``comm``: a zerompi Communicator (its wait is timed by the watchdog, when one runs) or an
    mpi4py communicator (not timed). ``what`` names the settings in the message ("train", "engine").
    A collective: every rank must call it at the same point.
    """
    mpi = getattr(comm, "mpi", comm)
    if mpi.Get_size() == 1:
        return
    mine = flatten(values)
    with watched(comm, f"start-up consistency check ({what})"):
        digests = mpi.allgather(digest(mine))
        if all(d == digests[0] for d in digests):
            return
        tables = mpi.allgather(mine)          # only on a mismatch: every rank is here too
    raise MismatchError(mismatch_message(what, tables))


def mismatch_message(what: str, tables: List[Mapping[str, str]]) -> str:
    """One line naming each differing field and which ranks hold which value."""
    names = sorted(set().union(*tables))
    parts = []
    for name in names:
        seen: Dict[str, List[int]] = {}
        for rank, table in enumerate(tables):
            seen.setdefault(table.get(name, "<missing>"), []).append(rank)
        if len(seen) > 1:
            parts.append(f"{name} = " + ", ".join(f"{_short(v)} on {rank_set(rs)}" for v, rs in seen.items()))
    more = f"; and {len(parts) - MAX_FIELDS_SHOWN} more fields" if len(parts) > MAX_FIELDS_SHOWN else ""
    return (f"{what} configuration mismatch between ranks: {'; '.join(parts[:MAX_FIELDS_SHOWN])}{more}; "
            "start every rank with the same flags and model")


def _short(value: str) -> str:
    if len(value) <= MAX_VALUE_CHARS:
        return value
    return f"{value[:MAX_VALUE_CHARS]}... (sha256 {hashlib.sha256(value.encode()).hexdigest()[:8]})"


def rank_set(ranks: List[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    runs = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is None or r != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = r
        prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


RANK_LOCAL_FIELDS = ("metrics_json", "log_every")   # read by rank 0 only: they may differ


def job_fields(cfg) -> dict:
    """A training config (a dataclass, nested ones included) as a dict, without the
    fields only rank 0 reads: what :func:`check_consistent` compares at start."""
    values = asdict(cfg)
    for name in RANK_LOCAL_FIELDS:
        values.pop(name, None)
    return values
