"""The initial values, into this rank's fp32 master one bucket at a time; lazy ones checked on what was made.

Each parameter is a whole array (the caller built the model whole on every rank, and
contract.agree_initial_values has checked or broadcast it) or a lazy rule (engine/lazy.py), of
which a rank makes only what it keeps: its slice of every bucket (stage 0 keeps every bucket
whole), one bucket at a time, written into the master as it is made. Nothing model-sized is
held beside the master.

Agreement on lazy values (the contract's "same initial values", engine/contract.py) is checked on
what the ranks made. No rank holds another's slice, so each rank also makes the slice of the slot
before its own (slot s - 1 of every bucket; slot 0 makes slot S - 1's) and digests both: every
slice is made by its owners (one per shard group) and by the next slot's ranks. The ranks
all-gather their 16-byte digests; a slot made differently stops every rank with one line naming
the slot, the first bucket and parameter where the values differ and which ranks made which
(MismatchError). Stage 0, where every rank makes everything, compares one digest of the model.
"""
import hashlib
from typing import Dict, List

import numpy as np

from ..comm.consistency import rank_set
from ..comm.watchdog import watched
from ..errors import MismatchError
from .lazy import Draws, is_lazy

F32 = np.float32


def load(engine, pairs) -> None:
    """Fill ``engine.optimizer``'s master from ``pairs`` ([(layer, {name: array or Lazy})]), each rank its
    own part, bucket by bucket; then, when some parameter is lazy, check what the ranks made (a collective)."""
    lay, opt, xp = engine.layout, engine.optimizer, engine.xp
    sources = {p: a for _, params in pairs for p, a in params.items()}
    lazy = any(is_lazy(a) for a in sources.values())
    size, slot = engine.topology.shard_size, engine.slot
    stage0 = engine.config.stage == 0
    checked = lazy and engine.comm.size > 1
    made = [slot] if stage0 or size == 1 or not checked else sorted({(slot - 1) % size, slot})
    digests: Dict[int, List[bytes]] = {s: [] for s in made}
    draws = Draws()
    for bucket in lay.buckets:
        for s in made:
            lo, hi = (0, bucket.numel) if stage0 else bucket.slice_bounds(s)
            values = _make(lay, bucket, lo, hi, sources, draws)
            if checked:
                digests[s].append(hashlib.blake2b(values.data, digest_size=16).digest())
            if s == slot:
                sl = slice(bucket.start, bucket.stop) if stage0 else bucket.shard_slice
                opt.rows.write("master", sl, values if opt.rows.place != "device" else xp.asarray(values))
    if checked:
        _check(engine.comm, lay, "all" if stage0 else None, digests)


def _make(lay, bucket, lo: int, hi: int, sources, draws: Draws) -> np.ndarray:
    """Elements lo .. hi-1 of ``bucket``'s initial values (float32, padding 0)."""
    out = np.zeros(hi - lo, F32)
    for layer in bucket.layers:
        for name in lay.layer_params[layer]:
            pr, src = lay.params[name], sources[name]
            a, z = max(lo, pr.bucket_offset), min(hi, pr.bucket_offset + pr.numel)
            if a >= z:
                continue
            if is_lazy(src):
                src.fill(out[a - lo:z - lo], a - pr.bucket_offset, z - pr.bucket_offset, draws)
            else:
                out[a - lo:z - lo] = np.asarray(src, F32).reshape(-1)[a - pr.bucket_offset:z - pr.bucket_offset]
    return out


def _check(comm, lay, whole, digests: Dict[int, List[bytes]]) -> None:
    """MismatchError on every rank unless every slot's values were made alike by every rank that made them."""
    mine = {s: hashlib.blake2b(b"".join(d), digest_size=16).digest() for s, d in digests.items()}
    with watched(comm, "start-up check of the lazily made initial values"):
        everyone = comm.mpi.allgather(mine)
        if all(_agree(everyone)):
            return
        tables = comm.mpi.allgather(digests)    # only on a mismatch: every rank is here too
    raise MismatchError(_message(lay, whole, tables))


def _agree(everyone):
    """For every slot any rank made: True when every rank that made it has the same digest."""
    seen: Dict[int, bytes] = {}
    for report in everyone:
        for s, d in report.items():
            yield seen.setdefault(s, d) == d


def _message(lay, whole, tables) -> str:
    """One line: the first slot and bucket whose values differ, its first parameter there, and the ranks."""
    slots = sorted({s for t in tables for s in t})
    for b, bucket in enumerate(lay.buckets):
        for s in slots:
            groups: Dict[bytes, List[int]] = {}
            for rank, t in enumerate(tables):
                if s in t:
                    groups.setdefault(t[s][b], []).append(rank)
            if len(groups) < 2:
                continue
            lo, hi = (0, bucket.numel) if whole else bucket.slice_bounds(s)
            name = next((n for layer in bucket.layers for n in lay.layer_params[layer]
                         if lay.params[n].bucket_offset < hi
                         and lo < lay.params[n].bucket_offset + lay.params[n].numel),
                        "(padding)")
            where = "the model" if whole else f"slot {s}'s slice"
            made = "; ".join(f"one value by {rank_set(rs)}" for rs in groups.values())
            return (f"lazy initial values differ between ranks: {where} of bucket {b} (parameters from {name!r} on) "
                    f"was made {len(groups)} ways: {made}; every rank must build the model with the same "
                    "initializers and seed (and the same NumPy random generator)")
    return "lazy initial values differ between ranks"
