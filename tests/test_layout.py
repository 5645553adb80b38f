"""FlatLayout: buckets at layer boundaries, padding, slices and shards, checked by brute force."""
import numpy as np
import pytest

from zerompi.errors import ConfigError
from zerompi.layout import FlatLayout

LAYERS = [
    ("a", [("a.w", (5, 3)), ("a.b", (3,))]),
    ("b", [("b.w", (7,))]),
    ("c", [("c.w", (4, 4)), ("c.b", (4,))]),
    ("d", [("d.w", (50,))]),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_numel", [1, 20, 30, 1000])
@pytest.mark.parametrize("align", [1, 4])
def test_layout_invariants(world, bucket_numel, align):
    lay = FlatLayout(LAYERS, world, bucket_numel, align)
    # Every parameter element has exactly one home, in layer order, never in padding.
    owner = np.full(lay.numel, -1)
    for k, pr in enumerate(lay.params.values()):
        assert (owner[pr.start:pr.stop] == -1).all()
        owner[pr.start:pr.stop] = k
        b = lay.buckets[pr.bucket]
        assert b.start <= pr.start and pr.stop <= b.start + b.used
        assert pr.start - b.start == pr.bucket_offset
    assert (owner >= 0).sum() == lay.params_numel == 15 + 3 + 7 + 16 + 4 + 50
    starts = [pr.start for pr in lay.params.values()]
    assert starts == sorted(starts)
    # Buckets tile the buffer, hold whole layers, and split into equal slices.
    pos = shard = 0
    for b in lay.buckets:
        assert b.start == pos and b.numel % (world * align) == 0 and b.used <= b.numel
        assert b.numel - b.used < world * align
        assert b.slice_numel * world == b.numel and b.shard_start == shard
        assert (owner[b.start + b.used:b.stop] == -1).all()
        for layer in b.layers:
            assert all(lay.params[n].bucket == b.index for n in lay.layer_params[layer])
        pos += b.numel
        shard += b.slice_numel
    assert pos == lay.numel and shard == lay.shard_numel
    # A bucket takes several layers only while they fit in bucket_numel.
    sizes = [sum(lay.params[n].numel for n in names) for names in lay.layer_params]
    for b in lay.buckets:
        if len(b.layers) > 1:
            assert sum(sizes[i] for i in b.layers) <= bucket_numel
    # The world slices of all ranks tile each bucket.
    for b in lay.buckets:
        cover = np.zeros(b.numel, int)
        for r in range(world):
            cover[b.world_slice(r).start - b.start:b.world_slice(r).stop - b.start] += 1
        assert (cover == 1).all()


def test_bad_layouts():
    with pytest.raises(ConfigError, match="repeats"):
        FlatLayout([("a", [("w", (2,))]), ("b", [("w", (2,))])], 2, 10)
    with pytest.raises(ConfigError, match="shape"):
        FlatLayout([("a", [("w", (0, 2))])], 2, 10)
    with pytest.raises(ConfigError, match="world_size"):
        FlatLayout(LAYERS, 0, 10)
