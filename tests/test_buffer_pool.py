"""Transient bucket buffers (stage-3 gathers, stage-2/3 gradient staging) are reused, not
allocated again, once the engine has seen a step -- whatever the bucket lengths.

A fresh bucket-sized array is paged in (zeroed by the kernel) on first touch: the cost the
engine's pool of released buffers exists to avoid (docs/overlap.md, "Reused bucket buffers").
Checked in-process on one rank with the fake MPI of tests/test_overlap.py, whose collectives
complete at their ``latency``-th test: 1 keeps up with the step, 3 finishes during the next
layers, 100 only when waited for (the reductions pile up to the engine's cap).
"""
import numpy as np
import pytest

import zerompi
from zerompi import ZeroConfig, ZeroEngine

from .test_overlap import FakeComm

# fp32 buckets of 16 elements, one layer each unless a layer is larger (then a bucket of its own);
# align=1 keeps every length as given (no padding on one rank).
BUCKET_MB = 16 * 4 / 2 ** 20
LAYOUTS = {
    "short-last": [16, 16, 16, 16, 8],          # the common case: the last bucket is short
    "long-among-short": [16, 16, 16, 16, 32],   # one layer larger than a bucket
    "long-first": [32, 16, 16, 16, 16, 16],     # an embedding-like first bucket
    "all-different": [48, 16, 40, 8, 32, 24],   # no two buckets of one length
}
STEPS = 5


def layers(sizes):
    rng = np.random.default_rng(0)
    return [(f"l{i}", {f"w{i}": rng.standard_normal(n).astype(np.float32)}) for i, n in enumerate(sizes)]


def count_buffer_events(eng):
    """Wrap the ledger so every bucket-buffer allocation and free is logged as ('alloc'|'free', elements)."""
    events = []
    alloc, free = eng.ledger.alloc, eng.ledger.free

    def logged_alloc(category, numel, *a, **k):
        if category == "buffers":
            events.append(("alloc", int(numel)))
        return alloc(category, numel, *a, **k)

    def logged_free(category, arr):
        if category == "buffers":
            events.append(("free", int(arr.size)))
        return free(category, arr)

    eng.ledger.alloc, eng.ledger.free = logged_alloc, logged_free
    return events


def micro_batch(eng, sizes, hints=True):
    """Forward 0..L-1, backward L-1..0, every layer's gradients handed back (hints: say which is which)."""
    if hints:
        eng.begin_forward()
    for i in range(len(sizes)):
        with eng.unsharded(i):
            pass
    backward(eng, sizes, hints)


def backward(eng, sizes, hints=True):
    if hints:
        eng.begin_backward()
    for i in reversed(range(len(sizes))):
        with eng.unsharded(i):
            pass
        eng.grads_ready(i, {f"w{i}": np.full(sizes[i], 0.01 * (i + 1), np.float32)})


def run(layout, stage, prefetch, overlap, latency, micro_batches=1, hints=True):
    """Events per step (allocations and frees of bucket buffers), the peak buffer bytes, the engine."""
    sizes = LAYOUTS[layout]
    cfg = ZeroConfig(stage=stage, dtype="fp32", bucket_mb=BUCKET_MB, prefetch=prefetch, overlap=overlap,
                     micro_batches=micro_batches, align=1)
    eng = ZeroEngine(layers(sizes), cfg, FakeComm(latency))
    assert [b.numel for b in eng.layout.buckets] == sizes
    events = count_buffer_events(eng)
    per_step = []
    for _ in range(STEPS):
        before = len(events)
        for _ in range(micro_batches):
            micro_batch(eng, sizes, hints)
        assert not eng.step().skipped
        per_step.append(events[before:])
    peak = eng.ledger.peak["buffers"]
    return per_step, peak, eng


CONFIGS = [(stage, prefetch, overlap, latency)
           for stage in (2, 3) for prefetch in (0, 1) for overlap in (True, False)
           for latency in ((1, 3, 100) if overlap else (1,))
           if stage == 3 or prefetch == 0]       # prefetch is a stage-3 knob


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("stage,prefetch,overlap,latency", CONFIGS)
def test_no_bucket_buffer_is_allocated_or_freed_after_the_first_step(layout, stage, prefetch, overlap, latency):
    per_step, peak, eng = run(layout, stage, prefetch, overlap, latency)
    assert any(e[0] == "alloc" for e in per_step[0])
    assert per_step[1:] == [[]] * (STEPS - 1), per_step
    # Nothing freed before close: every buffer the pool holds is one it reuses.
    assert all(kind == "alloc" for kind, _ in per_step[0]), per_step[0]
    # The peak is bounded by the estimate for this layout and config (its bucket-buffer rows;
    # the slow network is the cap, the others the best case or between the two).
    row = zerompi.estimate(layout=eng.layout, dtype="fp32", prefetch=prefetch, overlap=overlap)["stages"][stage]
    rows = ("grad_buckets", "gathered_params", "spare_buffers")
    assert peak <= sum(row["buffers"][k] for k in rows), (peak, row["buffers"])
    eng.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_micro_batches_and_inferred_order_reuse_too(stage):
    for hints in (True, False):
        per_step, _, eng = run("all-different", stage, 1, True, 3, micro_batches=2, hints=hints)
        assert per_step[1:] == [[]] * (STEPS - 1), (hints, per_step)
        eng.close()


def test_buffers_of_different_lengths_do_not_add_up_to_the_model():
    # Stage 3 with every bucket of another length: keeping one buffer per length would hold
    # every bucket (the whole model, gathered) for reuse. The pool holds what is live at
    # once: at most the gathered window (1 + prefetch) and the staged buckets (cap + 1),
    # each as large as the largest bucket.
    sizes = LAYOUTS["all-different"]
    for prefetch in (0, 1):
        _, peak, eng = run("all-different", 3, prefetch, True, 100)
        staged, gathered = zerompi.engine.reducer.MAX_PENDING_REDUCES + 1, 1 + prefetch
        assert peak <= 4 * max(sizes) * (staged + gathered) < 4 * 2 * sum(sizes)
        eng.close()


def test_a_layer_held_through_the_forward_is_reused_too():
    # The GPT holds its embedding layer (bucket 0) unsharded through the forward: one
    # gathered bucket more than the window, which the pool keeps for reuse like the rest.
    sizes = LAYOUTS["long-first"]
    cfg = ZeroConfig(stage=3, dtype="fp32", bucket_mb=BUCKET_MB, prefetch=1, align=1)
    eng = ZeroEngine(layers(sizes), cfg, FakeComm(3))
    events = count_buffer_events(eng)
    per_step = []
    for _ in range(STEPS):
        before = len(events)
        eng.begin_forward()
        with eng.unsharded(0):
            for i in range(1, len(sizes)):
                with eng.unsharded(i):
                    pass
        backward(eng, sizes)
        assert not eng.step().skipped
        per_step.append(events[before:])
    assert per_step[0] and per_step[1:] == [[]] * (STEPS - 1), per_step
    eng.close()


def least_bound_by_brute_force(lengths, staged, gathered):
    """Every way to cut the sorted lengths into runs, each run one class."""
    sizes = sorted(lengths)
    best = None
    for cuts in range(2 ** (len(sizes) - 1)):
        total, start = 0, 0
        for i, n in enumerate(sizes):
            if i == len(sizes) - 1 or cuts >> i & 1:
                count = sum(lengths[m] for m in sizes[start:i + 1])
                total += n * (min(count, staged) + min(count, gathered))
                start = i + 1
        best = total if best is None else min(best, total)
    return best


def test_buffer_classes_take_the_least_bound():
    rng = np.random.default_rng(5)
    for _ in range(500):
        lengths = {int(n): int(rng.integers(1, 5)) for n in rng.integers(1, 200, size=rng.integers(1, 7))}
        staged, gathered = int(rng.integers(0, 5)), int(rng.integers(0, 4))
        classes = zerompi.engine.buffers.buffer_classes(lengths, staged, gathered)
        per_class = {}
        for n, count in lengths.items():
            assert classes[n] >= n and classes[classes[n]] == classes[n]    # served by its class's longest
            per_class[classes[n]] = per_class.get(classes[n], 0) + count
        held = sum(size * (min(c, staged) + min(c, gathered)) for size, c in per_class.items())
        assert held == least_bound_by_brute_force(lengths, staged, gathered), (lengths, staged, gathered)
    # one length: the live buffers, nothing more; a short last bucket shares the full ones' class;
    # a long one among short ones keeps its own when that is cheaper
    assert zerompi.engine.buffers.buffer_classes({16: 5}, 3, 2) == {16: 16}
    assert zerompi.engine.buffers.buffer_classes({32: 4, 16: 1}, 3, 2) == {32: 32, 16: 32}
    assert zerompi.engine.buffers.buffer_classes({16: 4, 32: 1}, 3, 2) == {16: 16, 32: 32}
