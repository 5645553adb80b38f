"""FlatLayout: where every parameter, bucket and slice lives in the flat buffers.

One flat buffer holds all parameters in layer order. It is cut into buckets at layer
boundaries (a layer never straddles two buckets), each bucket is padded to a multiple of
``world_size * align`` elements and split into ``world_size`` equal contiguous slices.
Rank r owns slice r of every bucket; its shard is the concatenation of its slices.

All offsets here are in elements, not bytes. Nothing else in zerompi computes offsets.
"""
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Sequence, Tuple

from .errors import check

ParamSpec = Tuple[str, Tuple[int, ...]]
LayerSpec = Tuple[str, Sequence[ParamSpec]]


@dataclass(frozen=True)
class ParamRange:
    """One parameter's place in the world buffer and in its bucket."""
    name: str               # unique parameter name
    layer: int              # index of the layer that owns it
    shape: Tuple[int, ...]  # the shape the model sees
    numel: int              # elements
    bucket: int             # index of the bucket that holds it
    start: int              # first element in the world buffer
    bucket_offset: int      # first element inside its bucket

    @property
    def stop(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Bucket:
    """A contiguous run of whole layers, padded and cut into world_size slices."""
    index: int              # bucket number, in layer order
    start: int              # first element in the world buffer
    numel: int              # padded elements (a multiple of world_size * align)
    used: int               # elements that belong to parameters (the rest is padding)
    layers: Tuple[int, ...] # layers held, in order
    slice_numel: int        # numel // world_size: elements per rank
    shard_start: int        # where this bucket's slice starts in a rank's shard

    @property
    def stop(self) -> int:
        return self.start + self.numel

    def slice_bounds(self, rank: int) -> Tuple[int, int]:
        """Rank's slice as [lo, hi) inside the bucket."""
        lo = rank * self.slice_numel
        return lo, lo + self.slice_numel

    def world_slice(self, rank: int) -> slice:
        """Rank's slice of this bucket as a slice of the world buffer."""
        lo, hi = self.slice_bounds(rank)
        return slice(self.start + lo, self.start + hi)

    @property
    def shard_slice(self) -> slice:
        """This bucket's slice as a slice of a rank's shard (the same on every rank)."""
        return slice(self.shard_start, self.shard_start + self.slice_numel)


class FlatLayout:
    """Answers "where is parameter p, bucket b, and rank r's slice of it"."""

    def __init__(self, layers: Sequence[LayerSpec], world_size: int, bucket_numel: int, align: int = 16):
        check(world_size >= 1, f"world_size={world_size} must be >= 1")
        check(bucket_numel >= 1, f"bucket_numel={bucket_numel} must be >= 1")
        check(len(layers) >= 1, "a model needs at least one layer")
        self.world_size = world_size
        self.align = align
        self.layer_names: List[str] = [name for name, _ in layers]
        check(len(set(self.layer_names)) == len(self.layer_names), f"layer names repeat: {self.layer_names}")
        self.params: Dict[str, ParamRange] = {}
        self.layer_params: List[List[str]] = []
        self.buckets: List[Bucket] = []
        self.layer_bucket: List[int] = []
        self._build(layers, bucket_numel)

    def _build(self, layers, bucket_numel):
        quantum = self.world_size * self.align
        groups: List[List[int]] = []
        sizes = []
        for i, (lname, specs) in enumerate(layers):
            n = 0
            for pname, shape in specs:
                shape = tuple(int(d) for d in shape)
                check(all(d >= 1 for d in shape),
                      f"parameter {pname!r} has shape {shape}; every dimension must be >= 1")
                n += prod(shape)
            check(n >= 1, f"layer {lname!r} has no parameters")
            sizes.append(n)
            if groups and sum(sizes[j] for j in groups[-1]) + n <= bucket_numel:
                groups[-1].append(i)
            else:
                groups.append([i])
        world = shard = 0
        for b, group in enumerate(groups):
            offset = 0
            for i in group:
                names = []
                for pname, shape in layers[i][1]:
                    check(pname not in self.params, f"parameter name {pname!r} repeats")
                    shape = tuple(int(d) for d in shape)
                    numel = prod(shape)
                    self.params[pname] = ParamRange(pname, i, shape, numel, b, world + offset, offset)
                    names.append(pname)
                    offset += numel
                self.layer_params.append(names)
                self.layer_bucket.append(b)
            padded = -(-offset // quantum) * quantum
            slice_numel = padded // self.world_size
            self.buckets.append(Bucket(b, world, padded, offset, tuple(group), slice_numel, shard))
            world += padded
            shard += slice_numel
        self.numel = world            # padded elements of the world buffer
        self.shard_numel = shard      # elements of one rank's shard
        self.params_numel = sum(p.numel for p in self.params.values())  # Psi, unpadded

    @property
    def num_layers(self) -> int:
        return len(self.layer_params)

    def bucket_of_layer(self, layer: int) -> Bucket:
        return self.buckets[self.layer_bucket[layer]]

    def describe(self) -> dict:
        """A JSON-able summary used by the start-up consistency check and checkpoints."""
        return {
            "world_size": self.world_size,
            "align": self.align,
            "params": [[p.name, list(p.shape), p.layer, p.bucket, p.start] for p in self.params.values()],
            "buckets": [[b.start, b.numel, b.used, list(b.layers)] for b in self.buckets],
        }
