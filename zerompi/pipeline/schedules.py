"""The functions that make schedules: GPipe, 1F1B, interleaved 1F1B and ZB-H1.

Each first orders every rank's compute actions (F, B, W), then :func:`with_messages` adds the
point-to-point actions: a SEND right after the action that produced its data, a RECV one compute
action ahead of the one that needs it (so the message can arrive while that one runs). Every
schedule here runs each chunk's backwards (and weight gradients) in micro-batch order 0, 1, 2, ...:
the engine then sums the micro-batch gradients in the order an unpipelined run does.

With P ranks, m micro-batches and v chunks per rank (C = P v chunks, chunk c on rank c mod P):

- ``gpipe``: every forward, then every backward (activations of all m micro-batches held);
- ``1f1b``: P - 1 - r forwards on rank r, then one forward and one backward in turn, then the
  remaining backwards (at most P micro-batches held, on rank 0);
- ``interleaved``: Megatron's interleaved 1F1B, v chunks per rank, the forwards and backwards of
  P micro-batches at a time per chunk: a bubble v times smaller, m a multiple of P;
- ``zb-h1``: 1F1B whose backward is split into B (the input gradient, on the critical path) and W
  (the weight gradient); rank r keeps r weight gradients pending, which fill its bubble in the
  cool-down (Qi et al., "Zero Bubble Pipeline Parallelism", 2023; ZB-H1: the same peak
  activations as 1F1B, a third of its bubble when F, B and W cost the same).
"""
from typing import Dict, List, Optional

from .actions import Action, Schedule, ScheduleError

NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def minimum_micro_batches(name: str, ranks: int, chunks: int = 1) -> str:
    """What ``name`` needs of m, as a phrase for an error (and checked by :func:`make`)."""
    return {"gpipe": "at least 1", "1f1b": f"at least {ranks} (the ranks)", "zb-h1": f"at least {ranks} (the ranks)",
            "interleaved": f"a multiple of {ranks} (the ranks)"}[name]


def check_args(name: str, ranks: int, micro_batches: int, chunks: int = 1) -> None:
    """ScheduleError (one line naming the value and what is allowed) unless ``name`` can be made so."""
    if name not in NAMES:
        raise ScheduleError(f"schedule={name!r} is not allowed; use one of {', '.join(NAMES)} (or a schedule file)")
    for what, value in (("ranks", ranks), ("micro_batches", micro_batches), ("chunks", chunks)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ScheduleError(f"{what}={value!r} must be a whole number >= 1")
    if name == "interleaved" and chunks < 2:
        raise ScheduleError(f"chunks={chunks}: the interleaved schedule needs at least 2 chunks per rank (--chunks)")
    if name != "interleaved" and chunks != 1:
        raise ScheduleError(f"chunks={chunks} applies to the interleaved schedule only; drop it or use "
                            "--schedule interleaved")
    m, p = micro_batches, ranks
    ok = m >= 1 if name == "gpipe" else m % p == 0 if name == "interleaved" else m >= p
    if not ok:
        raise ScheduleError(f"micro_batches={m} is too few for the {name} schedule on {p} stages; it needs "
                            f"{minimum_micro_batches(name, p, chunks)} micro-batches")


def make(name: str, ranks: int, micro_batches: int, chunks: int = 1) -> Schedule:
    """The schedule ``name`` for ``ranks`` stages, ``micro_batches`` and ``chunks`` per rank, with its
    messages (not yet validated: validate.check does that)."""
    check_args(name, ranks, micro_batches, chunks)
    order = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1}[name]
    compute = [order(ranks, micro_batches, r, chunks) for r in range(ranks)]
    return with_messages(compute, {c: c % ranks for c in range(ranks * chunks)}, name)


# ---- the compute orders ---------------------------------------------------------------------
def gpipe(p: int, m: int, rank: int, v: int = 1) -> List[Action]:
    return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in range(m)]


def one_f_one_b(p: int, m: int, rank: int, v: int = 1) -> List[Action]:
    warmup = min(p - 1 - rank, m)
    out = [Action("F", i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", warmup + i, rank), Action("B", i, rank)]
    return out + [Action("B", i, rank) for i in range(m - warmup, m)]


def interleaved(p: int, m: int, rank: int, v: int = 2) -> List[Action]:
    """Megatron-LM's interleaved order: virtual micro-batch k is micro-batch (k // pv) p + k mod p of local
    chunk (k // p) mod v (reversed for the backwards); (p - 1 - rank) 2 + (v - 1) p warm-up forwards."""
    total = m * v

    def at(k: int, backward: bool) -> Action:
        group, rem = divmod(k, p * v)
        local = rem // p
        chunk = (v - 1 - local if backward else local) * p + rank
        return Action("B" if backward else "F", group * p + rem % p, chunk)

    warmup = min((p - 1 - rank) * 2 + (v - 1) * p, total)
    out = [at(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        out += [at(warmup + k, False), at(k, True)]
    return out + [at(k, True) for k in range(total - warmup, total)]


def zb_h1(p: int, m: int, rank: int, v: int = 1) -> List[Action]:
    """1F1B's F and B; after each B, the oldest pending W runs once more than ``rank`` are pending."""
    out: List[Action] = []
    pending: List[int] = []
    for a in one_f_one_b(p, m, rank):
        out.append(a)
        if a.kind == "B":
            pending.append(a.mb)
            if len(pending) > rank:
                out.append(Action("W", pending.pop(0), rank))
    return out + [Action("W", i, rank) for i in pending]


# ---- the messages ---------------------------------------------------------------------------
def with_messages(compute: List[List[Action]], placement: Dict[int, int], name: str = "custom") -> Schedule:
    """The schedule of these compute orders, with a SEND after each F / B whose data goes to another
    rank and a RECV one compute action ahead of each F / B whose data comes from another rank."""
    chunks = len(placement)
    rows = []
    for rank, acts in enumerate(compute):
        recv_before: List[List[Action]] = [[] for _ in range(len(acts) + 1)]
        for i, a in enumerate(acts):
            need = _incoming(a, placement, chunks)
            if need is not None:
                recv_before[max(0, i - 1)].append(need)
        row: List[Action] = []
        for i, a in enumerate(acts):
            row += recv_before[i]
            row.append(a)
            out = _outgoing(a, placement, chunks)
            if out is not None:
                row.append(out)
        rows.append(tuple(row))
    return Schedule(tuple(rows), name)


def _incoming(a: Action, placement, chunks: int) -> Optional[Action]:
    """The RECV action ``a`` needs (None: its data is local)."""
    if a.kind == "F" and a.chunk > 0 and placement[a.chunk - 1] != placement[a.chunk]:
        return Action("RECV_F", a.mb, a.chunk)
    if a.kind == "B" and a.chunk < chunks - 1 and placement[a.chunk + 1] != placement[a.chunk]:
        return Action("RECV_B", a.mb, a.chunk)
    return None


def _outgoing(a: Action, placement, chunks: int) -> Optional[Action]:
    if a.kind == "F" and a.chunk < chunks - 1 and placement[a.chunk + 1] != placement[a.chunk]:
        return Action("SEND_F", a.mb, a.chunk)
    if a.kind == "B" and a.chunk > 0 and placement[a.chunk - 1] != placement[a.chunk]:
        return Action("SEND_B", a.mb, a.chunk)
    return None


