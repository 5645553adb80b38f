"""The engine's bucket layout for a model too big to lay out: FlatLayout's rule, run-length encoded.

One concern: which buckets (sizes in elements, padded) the engine would cut for a model
described only by its parameter count and its layers, without allocating or listing 10^10
parameters. The rule is FlatLayout's (buckets cut at layer boundaries, each padded to a
multiple of ranks x align), and padding is asked of FlatLayout itself, its one owner;
given the engine's own FlatLayout, :meth:`BucketPlan.from_layout` is exact.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

# The engine's own grouping of bucket lengths into buffer classes (engine/buffers.py).
from ..engine.buffers import buffer_classes
from ..engine.config import ZeroConfig
from ..layout import FlatLayout


@dataclass(frozen=True)
class BucketPlan:
    """The bucket sizes of a layout, run-length encoded so a 10^10-parameter model stays small.

    All sizes in elements. ``runs`` lists (padded bucket elements, how many) in layer order.
    """
    params_numel: int                 # Psi, unpadded
    world_size: int                   # ranks the layout is cut for
    runs: Tuple[Tuple[int, int], ...] # (padded elements of a bucket, consecutive buckets of that size)

    @property
    def numel(self) -> int:
        """Padded elements of the world buffer."""
        return sum(n * c for n, c in self.runs)

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard (every bucket divides into world_size equal slices)."""
        return self.numel // self.world_size

    @property
    def num_buckets(self) -> int:
        return sum(c for _, c in self.runs)

    def largest(self, k: int) -> int:
        """Elements of the k largest buckets together (k is capped at the number of buckets)."""
        return _top(self.runs, k)

    def lengths(self) -> Dict[int, int]:
        """Buckets of each distinct padded length: {elements: how many}."""
        out: Dict[int, int] = {}
        for n, c in self.runs:
            out[n] = out.get(n, 0) + c
        return out

    def ends(self, k: int, weight=None) -> Tuple[int, int]:
        """Elements of the first k and of the last k buckets (k is capped at the number of buckets);
        ``weight``: of a bucket's length, what to add up in place of its elements (e.g. its wire bytes)."""
        def take(runs):
            total, left = 0, k
            for n, c in runs:
                got = min(c, left)
                total, left = total + got * (n if weight is None else weight(n)), left - got
            return total
        return take(self.runs), take(reversed(self.runs))

    def per_size(self, k: int) -> int:
        """Elements of up to k buckets of every distinct length together.

        The Communicator pools receive buffers by shape and keeps them: with k reductions in
        flight at most, it ends up holding min(k, buckets of that length) buffers of each length.
        """
        return sum(n * min(c, k) for n, c in self.lengths().items())

    def classes(self, staged: int, gathered: int) -> Dict[int, int]:
        """The engine's buffer classes for these buckets: {bucket length: elements of its buffers}
        (``buffers.buffer_classes``, for the most buffers live at once the engine is sized for)."""
        return buffer_classes(self.lengths(), staged, gathered)

    def pooled(self, staged: int, gathered: int, classes: Dict[int, int]) -> int:
        """Elements of bucket buffers the engine's pool can hold, live and spare together.

        ``staged``/``gathered``: staging and stage-3 gathered buffers live at once, at most;
        ``classes``: :meth:`classes`. A buffer is allocated only when none of its class is
        spare and is kept until close, so a class holds at most min(its buckets, staged) +
        min(its buckets, gathered) buffers, each of the class's size.
        """
        per_class: Dict[int, int] = {}
        for n, c in self.lengths().items():
            per_class[classes[n]] = per_class.get(classes[n], 0) + c
        return sum(size * (min(c, staged) + min(c, gathered)) for size, c in per_class.items())

    @classmethod
    def from_layout(cls, layout: FlatLayout) -> "BucketPlan":
        return cls(layout.params_numel, layout.world_size, _merge((b.numel, 1) for b in layout.buckets))


def _top(runs, k: int) -> int:
    """Sum of the k largest of a multiset given as (value, count) pairs (all of it if fewer)."""
    total, left = 0, max(k, 0)
    for n, c in sorted(runs, reverse=True):
        take = min(c, left)
        total, left = total + take * n, left - take
    return total


def _merge(runs) -> Tuple[Tuple[int, int], ...]:
    out: List[List[int]] = []
    for n, c in runs:
        if c <= 0:
            continue
        if out and out[-1][0] == n:
            out[-1][1] += c
        else:
            out.append([n, c])
    return tuple((n, c) for n, c in out)


def _group_runs(layer_runs: Sequence[Tuple[int, int]], cap: int) -> List[Tuple[int, int]]:
    """(used elements, count) of the buckets FlatLayout cuts from layers given as runs
    (layer elements, count): a layer joins the open bucket while the bucket stays <= cap.

    Done on runs, not layer by layer, so that a model of 10^5 layers costs nothing;
    tests check it against FlatLayout itself.
    """
    buckets: List[Tuple[int, int]] = []
    used = 0                                   # elements in the open bucket
    for size, count in layer_runs:
        if count <= 0:
            continue
        if used:
            fit = min(count, (cap - used) // size) if used + size <= cap else 0
            used, count = used + fit * size, count - fit
            if count:
                buckets.append((used, 1))
                used = 0
        if count:
            per = max(1, cap // size)          # layers of this run that share one bucket
            whole, left = divmod(count, per)
            if left == 0:                      # keep the last bucket open for the next run
                whole, left = whole - 1, per
            buckets.append((per * size, whole))
            used = left * size
    buckets.append((used, 1))
    return [(u, c) for u, c in buckets if c > 0 and u > 0]


def _padded(used: int, world_size: int, align: int) -> int:
    """Padded elements of a bucket holding ``used`` elements (asks FlatLayout, the one owner of padding)."""
    return FlatLayout([("bucket", [("p", (used,))])], world_size, used, align).numel


def plan_buckets(params: int, ranks: int, bucket_numel: int, layers: Optional[int] = None,
                 largest_layer: Optional[int] = None, align: int = ZeroConfig.align) -> BucketPlan:
    """The engine's buckets for a model of ``params`` elements described by its layers.

    ``layers``: that many layers as equal as possible; ``largest_layer``: layers of that
    many elements, the last one takes the rest; neither: layers that fill a bucket each.
    """
    if layers is not None:
        small, extra = divmod(params, layers)
        layer_runs = [(small + 1, extra), (small, layers - extra)]
    else:
        size = largest_layer if largest_layer is not None else min(bucket_numel, params)
        layer_runs = [(size, params // size), (params % size, 1)]
    layer_runs = [(s, c) for s, c in layer_runs if s > 0 and c > 0]
    runs = [(_padded(used, ranks, align), c) for used, c in _group_runs(layer_runs, bucket_numel)]
    return BucketPlan(params, ranks, _merge(runs))


def plan_layer_sizes(sizes: Sequence[int], ranks: int, bucket_numel: int,
                     align: int = ZeroConfig.align) -> BucketPlan:
    """The engine's buckets for layers of the given ``sizes`` (elements, in order): a pipeline chunk's, whose
    layers differ (the GPT's embeddings, blocks, final LayerNorm)."""
    runs = [(n, 1) for n in sizes if n > 0]
    padded = [(_padded(used, ranks, align), c) for used, c in _group_runs(_merge(runs), bucket_numel)]
    return BucketPlan(sum(sizes), ranks, _merge(padded))


def bucket_numel(dtype: str, bucket_mb: float) -> int:
    """Elements per bucket target, as the engine derives it from ``bucket_mb`` MiB of storage dtype."""
    cfg = ZeroConfig(dtype=dtype, bucket_mb=bucket_mb)
    return max(1, cfg.bucket_bytes // cfg.itemsize)


def layer_layout(sizes: Sequence[int], shard_size: int, replicas: int, dtype: str, bucket_mb: float) -> FlatLayout:
    """The engine's own FlatLayout of a model whose engine layers hold ``sizes`` parameters (one parameter each: the
    buckets are cut at layers, so how a layer's parameters split does not change them), cut as the engine cuts it
    over ``shard_size`` ranks in ``replicas`` shard groups (each slice a multiple of align x groups): with it the
    estimate is the engine's, to the byte (the built-in GPT's layers: activations.gpt_layer_sizes)."""
    return FlatLayout([(f"l{j}", [(f"l{j}.p", (n,))]) for j, n in enumerate(sizes)], shard_size,
                      bucket_numel(dtype, bucket_mb), ZeroConfig.align * replicas)
