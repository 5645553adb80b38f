"""The checks a schedule passes before it runs (ScheduleError: one line naming the rank and action).

1. Each chunk is computed on one rank, every chunk 0 .. C - 1 and micro-batch 0 .. m - 1 appear,
   and each rank computes at least one chunk.
2. Each (micro-batch, chunk) has one F and one B, and one W when the schedule splits the backward
   (then every pair has one), on the chunk's rank; F before B before W on that rank.
3. Messages: a chunk whose neighbour lives on another rank sends (after computing) and receives
   (before computing) exactly the messages the boundary needs, none where the neighbour is local;
   between two ranks, in each direction, the sends and the receives come in the same order (MPI
   matches them by order).
4. Each chunk's B (and W) run in micro-batch order 0, 1, 2, ...: the engine then sums the
   micro-batch gradients in the order of an unpipelined run (the same bits).
5. No deadlock: the schedule run on unit costs (timeline.run) finishes.
"""
import itertools
from collections import Counter, defaultdict
from typing import Dict, List, Optional, Tuple

from .actions import COMPUTE, Action, Schedule, ScheduleError
from . import timeline

SHOWN = 20                      # missing chunks named in an error, at most
PAIRS = {"SEND_F": ("RECV_F", +1), "SEND_B": ("RECV_B", -1)}    # a send of chunk c is received by chunk c +- 1


def check(schedule: Schedule, micro_batches: Optional[int] = None, chunks: Optional[int] = None,
          ranks: Optional[int] = None) -> Schedule:
    """``schedule`` when it is valid (and has the given micro-batches, chunks and ranks); else ScheduleError."""
    name = schedule.name
    p, m, c = schedule.ranks, schedule.micro_batches, schedule.chunks
    for what, want, got in (("ranks (pipeline stages)", ranks, p), ("micro-batches", micro_batches, m),
                            ("model chunks", chunks, c)):
        if want is not None and want != got:
            raise ScheduleError(f"schedule {name}: it has {got} {what}, this run has {want}; make the schedule for "
                                f"{want} (or run with {got})")
    where = _placement(schedule)
    _check_compute(schedule, where)
    _check_messages(schedule, where)
    _check_order(schedule, where)
    timeline.run(schedule)          # Deadlock (a ScheduleError) when the ranks wait on each other forever
    return schedule


def _placement(s: Schedule) -> Dict[int, int]:
    where: Dict[int, int] = {}
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind in COMPUTE and where.setdefault(a.chunk, r) != r:
                raise ScheduleError(f"schedule {s.name}: chunk {a.chunk} is computed on ranks {where[a.chunk]} and "
                                    f"{r} ({a}); each chunk lives on one rank")
    missing = _missing_chunks(s, where)
    if missing:
        raise ScheduleError(f"schedule {s.name}: chunks {missing} are never computed; every chunk 0..{s.chunks - 1} "
                            "needs its F and B")
    used = set(where.values())
    idle = [r for r in range(s.ranks) if r not in used]
    if idle:
        raise ScheduleError(f"schedule {s.name}: rank{'s' if len(idle) > 1 else ''} {idle} "
                            f"compute{'s' if len(idle) == 1 else ''} no chunk; "
                            "every rank (pipeline stage) holds at least one")
    return where


def _missing_chunks(s: Schedule, where: Dict[int, int]) -> str:
    """The chunks 0 .. C - 1 that no action computes, written as a list ('' when none): all of them when they are
    few, else the first SHOWN and how many more (C is one more than the largest chunk an action names: never a
    range of it is made, which may be huge)."""
    gone = s.chunks - len(where)
    if gone <= SHOWN:
        return str([c for c in range(s.chunks) if c not in where]) if gone else ""
    first = itertools.islice((c for c in range(s.chunks) if c not in where), SHOWN)
    return f"[{', '.join(map(str, first))}, ... and {gone - SHOWN:,} more]"


def _check_compute(s: Schedule, where: Dict[int, int]) -> None:
    split = s.split_backward
    kinds = ("F", "B") + (("W",) if split else ())
    count = Counter(a for acts in s.actions for a in acts if a.kind in COMPUTE)
    bad = _first_miscounted(count, kinds, s.micro_batches, s.chunks)
    if bad is not None:
        n = count[bad]
        raise ScheduleError(f"schedule {s.name}: {bad} appears {n} times on rank "
                            f"{where[bad.chunk]}; every micro-batch of every chunk needs one F and one B"
                            + (" and one W (the schedule splits the backward)" if split else ""))
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind in COMPUTE and a.mb >= s.micro_batches:
                raise ScheduleError(f"schedule {s.name}: rank {r} has {a}, beyond micro-batch {s.micro_batches - 1}")


def _first_miscounted(count: Counter, kinds, m: int, chunks: int) -> Optional[Action]:
    """The first (micro-batch, chunk, kind) in that order whose compute action does not appear once, or None: a
    repeated one from ``count``, a missing one from the first micro-batch short of its chunks x kinds distinct
    actions (the micro-batches before it are complete): O(actions), not O(m x chunks)."""
    order = {k: i for i, k in enumerate(kinds)}
    key = lambda a: (a.mb, a.chunk, order[a.kind])
    repeated = min((a for a, n in count.items() if n > 1), key=key, default=None)
    per_mb = Counter(a.mb for a in count)
    missing = None
    for mb in range(m):
        if per_mb[mb] < chunks * len(kinds):
            missing = next(Action(k, mb, ch) for ch in range(chunks) for k in kinds if Action(k, mb, ch) not in count)
            break
    found = [a for a in (repeated, missing) if a is not None]
    return min(found, key=key) if found else None


def _expected_messages(s: Schedule, where: Dict[int, int]) -> Counter:
    """Every message action the boundaries between chunks on different ranks need."""
    need = Counter()
    for mb in range(s.micro_batches):
        for ch in range(s.chunks - 1):
            if where[ch] != where[ch + 1]:
                need.update([Action("SEND_F", mb, ch), Action("RECV_F", mb, ch + 1),
                             Action("SEND_B", mb, ch + 1), Action("RECV_B", mb, ch)])
    return need


def _check_messages(s: Schedule, where: Dict[int, int]) -> None:
    need = _expected_messages(s, where)
    have = Counter()
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind in COMPUTE:
                continue
            if a.chunk >= s.chunks or where.get(a.chunk) != r:
                raise ScheduleError(f"schedule {s.name}: rank {r} has {a}, but chunk {a.chunk} is computed on rank "
                                    f"{where.get(a.chunk, 'none')}; a message belongs to its chunk's rank")
            have[a] += 1
    for a in sorted(set(have) | set(need), key=lambda a: (a.mb, a.chunk, a.kind)):
        if have[a] != need[a]:
            why = ("its neighbour chunk is on the same rank: nothing travels" if need[a] == 0 else
                   "the boundary to a chunk on another rank needs it once")
            raise ScheduleError(f"schedule {s.name}: {a} appears {have[a]} times on rank {where.get(a.chunk)}; "
                                f"{why}")
    streams: Dict[Tuple[int, int, str], List[Tuple[int, int]]] = defaultdict(list)   # (src, dst, dir) -> messages
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind in PAIRS:
                streams[(r, where[a.chunk + PAIRS[a.kind][1]], a.kind[-1], "send")].append((a.mb, a.chunk))
            elif a.kind.startswith("RECV"):
                src = where[a.chunk - 1] if a.kind == "RECV_F" else where[a.chunk + 1]
                sender = a.chunk - 1 if a.kind == "RECV_F" else a.chunk + 1
                streams[(src, r, a.kind[-1], "recv")].append((a.mb, sender))
    for (src, dst, d, side), sent in streams.items():
        if side != "send":
            continue
        got = streams.get((src, dst, d, "recv"), [])
        if sent != got:
            i = next(i for i, (x, y) in enumerate(zip(sent + [None], got + [None])) if x != y)
            raise ScheduleError(f"schedule {s.name}: rank {src} sends its {'activations' if d == 'F' else 'gradients'} "
                                f"to rank {dst} in another order than rank {dst} receives them (message {i}: "
                                f"sent {_name(sent, i, d)}, received {_name(got, i, d)}); MPI matches them by order")


def _name(seq, i, d) -> str:
    if i >= len(seq):
        return "nothing"
    mb, ch = seq[i]
    return f"micro-batch {mb} of chunk {ch}"


def _check_order(s: Schedule, where: Dict[int, int]) -> None:
    for r, acts in enumerate(s.actions):
        pos = {a: i for i, a in enumerate(acts)}
        for a in acts:
            before = _must_follow(a, s, where)
            for b in before:
                if b in pos and pos[b] > pos[a]:
                    raise ScheduleError(f"schedule {s.name}: rank {r} runs {a} (action {pos[a]}) before {b} "
                                        f"(action {pos[b]}); {_why(a, b)}")
        for kind in ("B", "W"):
            last: Dict[int, int] = {}
            for a in acts:
                if a.kind == kind:
                    if a.chunk in last and a.mb < last[a.chunk]:
                        raise ScheduleError(f"schedule {s.name}: rank {r} runs {kind} of micro-batch {a.mb} after "
                                            f"micro-batch {last[a.chunk]} on chunk {a.chunk}; each chunk's {kind} must "
                                            "run in micro-batch order (0, 1, 2, ...), so that the gradients are "
                                            "summed in the order of a run without pipelining")
                    last[a.chunk] = a.mb


def _must_follow(a: Action, s: Schedule, where) -> List[Action]:
    """The actions of a's rank that must come before ``a``."""
    out = []
    if a.kind == "B":
        out.append(Action("F", a.mb, a.chunk))
    if a.kind == "W":
        out.append(Action("B", a.mb, a.chunk))
    if a.kind == "SEND_F":
        out.append(Action("F", a.mb, a.chunk))
    if a.kind == "SEND_B":
        out.append(Action("B", a.mb, a.chunk))
    if a.kind == "F" and a.chunk > 0:
        out.append(Action("RECV_F", a.mb, a.chunk) if where[a.chunk - 1] != where[a.chunk]
                   else Action("F", a.mb, a.chunk - 1))
    if a.kind == "B" and a.chunk < s.chunks - 1:
        out.append(Action("RECV_B", a.mb, a.chunk) if where[a.chunk + 1] != where[a.chunk]
                   else Action("B", a.mb, a.chunk + 1))
    return out


def _why(a: Action, b: Action) -> str:
    if b.kind.startswith("RECV"):
        return "a receive is posted before the action that needs its data"
    if a.kind.startswith("SEND"):
        return "a send follows the action that computes what it sends"
    if a.kind == "W":
        return "the weight gradient follows its input gradient (B)"
    if a.kind == "B" and b.kind == "F" and b.chunk == a.chunk:
        return "every forward comes before its backward"
    return "the neighbouring chunk on this rank must run first"
