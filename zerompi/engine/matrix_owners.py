"""Whole-matrix ownership: which rank orthogonalises which matrix, and the all-to-alls that bring a
matrix's pieces to its owner and the result back.

Muon's Newton-Schulz needs a whole matrix, and ZeRO cuts the buckets into flat slices that split
matrices anywhere. Every matrix gets one owner slot, chosen from the layout alone (the same on every
rank): the matrices, largest NS cost first (rows x cols x min(rows, cols)), each to the slot with the
least cost so far (ties: the lower slot), so the work is balanced and a matrix is never split.
A step is two all-to-all(v)s over the shard group with unequal pieces: each rank sends its slices
of every matrix to that matrix's owner, the owner runs NS once on each of its matrices, and sends
each slice owner its piece of the result. No rank computes another's matrix, and a rank holds its
share plus its own matrices. Stage 0 holds every matrix whole on every rank: each computes them all.

A parameter ``stacked`` names (an MoE's experts, (E, rows, cols)) is a stack over its first axis: each slice is
a matrix of its own (``name[e]``, a contiguous run of the parameter), and a stack of vectors (the experts'
biases, (E, cols)) is no matrix, as a vector is not.
"""
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..errors import AgreedConfigError

F32 = np.float32


@dataclass(frozen=True)
class Piece:
    """A run of one matrix's elements held by one slot."""
    slot: int      # the slot (slice of every bucket) that holds it
    row: int       # where it starts in that slot's rows (its shard; stage 0: the world buffer)
    offset: int    # where it starts in the matrix (row-major)
    numel: int


@dataclass(frozen=True)
class Matrix:
    name: str
    shape: Tuple[int, int]
    owner: int                      # the slot that runs its Newton-Schulz
    pieces: Tuple[Piece, ...]       # in matrix order


def is_stacked(name: str, stacked: Sequence[str]) -> bool:
    """Whether parameter ``name`` is a stack over its first axis (some pattern of ``stacked`` matches it)."""
    return any(fnmatchcase(name, pat) for pat in stacked)


def is_matrix(name: str, shape, stacked: Sequence[str] = ()) -> bool:
    """Whether parameter ``name`` of ``shape`` is a matrix, or a stack of them (its slices, without the first axis,
    2-D): what Muon can update."""
    return len(shape) - (1 if is_stacked(name, stacked) else 0) == 2


def matrix_names(layers, stacked: Sequence[str] = ()) -> List[str]:
    """The parameters of ``layers`` ([(layer, {name: array})], model order) that are matrices or stacks of them."""
    return [n for _, params in layers for n, a in params.items() if is_matrix(n, np.shape(a), stacked)]


def muon_names(shapes: Dict[str, tuple], patterns: Sequence[str], stacked: Sequence[str] = ()) -> List[str]:
    """The parameters (in the order of ``shapes``: name -> shape) some pattern matches that are 2-D, or stacks
    of 2-D matrices (``stacked``'s patterns). AgreedConfigError for a pattern that matches no parameter, and for
    patterns that match no matrix (Muon needs matrices)."""
    names = list(shapes)
    for pat in patterns:
        if not any(fnmatchcase(n, pat) for n in names):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise AgreedConfigError(f"muon_params pattern {pat!r} (--muon-params) matches no parameter "
                                    f"(the parameters are {shown})")
    hit = [n for n in names if any(fnmatchcase(n, pat) for pat in patterns)]
    out = [n for n in hit if is_matrix(n, shapes[n], stacked)]
    if patterns and not out:
        raise AgreedConfigError(f"muon_params {', '.join(map(repr, patterns))} (--muon-params) match no 2-D "
                                f"parameter (matched: {', '.join(hit[:6])}); Muon needs matrices: use "
                                "--optimizer adamw, or patterns that name 2-D weights")
    return out


def ns_cost(shape) -> int:
    """Newton-Schulz's multiply-adds per iteration, up to a constant: rows x cols x min(rows, cols)."""
    return shape[0] * shape[1] * min(shape)


def matrices_of(layout, names: Sequence[str], stacked: Sequence[str] = ()) -> List[Tuple[str, str, int, tuple]]:
    """``(matrix name, parameter, first element in the parameter, shape)`` of the parameters ``names`` (layout
    order): a 2-D parameter is one matrix; a stack's slices are matrices ``name[e]``, in slice order."""
    out = []
    for n in names:
        shape = tuple(layout.params[n].shape)
        if not is_stacked(n, stacked):
            out.append((n, n, 0, shape))
            continue
        size = shape[1] * shape[2]
        out.extend((f"{n}[{e}]", n, e * size, shape[1:]) for e in range(shape[0]))
    return out


def plan(layout, names: Sequence[str], stage: int, slots: int, stacked: Sequence[str] = ()) -> List[Matrix]:
    """The matrices of the parameters ``names`` (layout order; a stack's slices each, :func:`matrices_of`),
    each with its owner and its pieces over ``slots`` slots."""
    mats = matrices_of(layout, names, stacked)
    load, owner = [0] * slots, {}
    for i in sorted(range(len(mats)), key=lambda i: (-ns_cost(mats[i][3]), i)):
        s = min(range(slots), key=lambda k: (load[k], k))
        owner[i] = s
        load[s] += ns_cost(mats[i][3])
    return [Matrix(name, shape, owner[i], _pieces(layout, param, base, shape[0] * shape[1], stage, slots))
            for i, (name, param, base, shape) in enumerate(mats)]


def _pieces(layout, name: str, base: int, numel: int, stage: int, slots: int) -> Tuple[Piece, ...]:
    """The pieces of elements ``[base, base + numel)`` of parameter ``name`` (one matrix of it)."""
    pr = layout.params[name]
    if stage == 0:
        return (Piece(0, pr.start + base, 0, numel),)
    b = layout.buckets[pr.bucket]
    first = pr.bucket_offset + base
    out = []
    for s in range(slots):
        lo, hi = b.slice_bounds(s)
        a, z = max(lo, first), min(hi, first + numel)
        if a < z:
            out.append(Piece(s, b.shard_start + a - lo, a - first, z - a))
    return tuple(out)


def own_runs(matrices: Sequence[Matrix], slot: int) -> List[Tuple[int, int, int]]:
    """``(start, stop, matrix index)`` of this slot's rows that are matrix elements, sorted."""
    return sorted((p.row, p.row + p.numel, i) for i, m in enumerate(matrices) for p in m.pieces if p.slot == slot)


def exchange_bytes(matrices: Sequence[Matrix], slot: int) -> int:
    """Bytes ``slot`` sends per step in :func:`to_owners` and :func:`from_owners` together: its pieces of the
    matrices others own, and the others' pieces of the matrices it owns (float32)."""
    out = sum(p.numel for m in matrices if m.owner != slot for p in m.pieces if p.slot == slot)
    back = sum(p.numel for m in matrices if m.owner == slot for p in m.pieces if p.slot != slot)
    return 4 * (out + back)


def to_owners(group, matrices: Sequence[Matrix], rows: np.ndarray, step: int, tally=None) -> dict:
    """Every matrix this slot owns, whole (float32, its shape), from the slices of ``rows`` (this slot's
    float32 rows, host) of every slot: one all-to-all(v) over the shard ``group``; ``tally``: a list the
    bytes sent to the other slots are appended to."""
    me, order = group.slot, group.slots
    send = [[rows[p.row:p.row + p.numel] for m in matrices if m.owner == order[g] for p in m.pieces if p.slot == me]
            for g in range(len(order))]
    recv_at = [[(m, p) for m in matrices if m.owner == me for p in m.pieces if p.slot == order[g]]
               for g in range(len(order))]
    got = _alltoallv(group, send, [sum(p.numel for _, p in r) for r in recv_at], "to their owners", step, tally)
    mine = {m.name: np.empty(m.shape[0] * m.shape[1], F32) for m in matrices if m.owner == me}
    at = 0
    for r in recv_at:
        for m, p in r:
            mine[m.name][p.offset:p.offset + p.numel] = got[at:at + p.numel]
            at += p.numel
    shapes = {m.name: m.shape for m in matrices}
    return {n: v.reshape(shapes[n]) for n, v in mine.items()}


def from_owners(group, matrices: Sequence[Matrix], results: dict, out: np.ndarray, step: int, tally=None) -> None:
    """The inverse of :func:`to_owners`: each slot's pieces of the owners' ``results`` (name -> matrix)
    written into ``out`` (this slot's float32 rows, host) at its rows."""
    me, order = group.slot, group.slots
    send = [[results[m.name].reshape(-1)[p.offset:p.offset + p.numel] for m in matrices if m.owner == me
             for p in m.pieces if p.slot == order[g]] for g in range(len(order))]
    recv_at = [[p for m in matrices if m.owner == order[g] for p in m.pieces if p.slot == me]
               for g in range(len(order))]
    got = _alltoallv(group, send, [sum(p.numel for p in r) for r in recv_at], "back to the slices", step, tally)
    at = 0
    for r in recv_at:
        for p in r:
            out[p.row:p.row + p.numel] = got[at:at + p.numel]
            at += p.numel


def _alltoallv(group, send: list, recv_counts: list, what: str, step: int, tally=None) -> np.ndarray:
    counts = [sum(a.size for a in pieces) for pieces in send]
    if tally is not None:             # what goes on the wire: every piece but those to this slot itself
        tally.append(4 * sum(c for g, c in zip(group.slots, counts) if g != group.slot))
    flat = np.concatenate([np.asarray(a, F32) for pieces in send for a in pieces]) if sum(counts) else \
        np.zeros(0, F32)
    recv = np.empty(sum(recv_counts), F32)
    sd, rd = np.cumsum([0] + counts[:-1]).tolist(), np.cumsum([0] + recv_counts[:-1]).tolist()
    with group.waiting(f"muon: matrices {what} (all-to-all)", (0, step)):
        group.mpi.Alltoallv([flat, (counts, sd)], [recv, (recv_counts, rd)])
    return recv
