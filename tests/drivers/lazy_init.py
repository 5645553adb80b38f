"""Lazy parameters under mpiexec (``python lazy_init.py``): every case in one launch.

For each stage, an engine built from lazy rules and one built from whole arrays of the same model:
their masters must be the same bits, each rank must make only its own slice of every bucket and the
slot before it (the agreement check's), and the construction's own memory (tracemalloc, beyond what
the ledger holds) must stay about one bucket. Then a rank with another seed, and broadcast with lazy
parameters. Rank 0 prints one JSON line.
"""
import json
import tracemalloc

from mpi4py import MPI

from zerompi import MeshConfig, ZeroConfig, ZeroEngine
from zerompi.comm.meshconfig import FIELDS as MESH_FIELDS
from zerompi.engine import lazy

WORLD = MPI.COMM_WORLD
RANK, N = WORLD.Get_rank(), WORLD.Get_size()
SIZES = [(512, 512), (1000, 300), (24,), (512, 700)]   # ~0.9 M parameters: the construction must hold far less
lazy.CHUNK = 4096                # small draws at a time: the construction's memory is then its buckets'


class Counting(lazy.Lazy):
    """A rule that counts the elements made of it."""

    def __init__(self, inner):
        super().__init__(inner.shape)
        self.inner, self.made = inner, 0

    def fill(self, out, lo, hi, draws):
        self.made += hi - lo
        self.inner.fill(out, lo, hi, draws)

    def describe(self):
        return self.inner.describe()


def rules(seed=0):
    stream = lazy.Stream([seed, 5])
    return [(f"l{i}", {f"w{i}": Counting(stream.normal(s, scale=0.1)), f"b{i}": Counting(lazy.Constant(s[-1], 0.5))})
            for i, s in enumerate(SIZES)]


def config(stage, **kw):
    return ZeroConfig(**{"stage": stage, "dtype": "fp16", "bucket_mb": 0.5, "timeout_s": 30, **kw})


def make(layers, stage, **kw):
    """A ZeroEngine of ``config(stage, **kw)``, the mesh's fields among ``kw`` as its mesh_config."""
    mesh = MeshConfig(**{k: kw.pop(k) for k in MESH_FIELDS if k in kw})
    return ZeroEngine(layers, config(stage, **kw), mesh_config=mesh)


def made_expected(eng):
    """Elements of parameters in the slices this rank must make: its own and the slot before's."""
    lay, s, size = eng.layout, eng.slot, eng.topology.shard_size
    if eng.config.stage == 0:
        return lay.params_numel
    total = 0
    for b in lay.buckets:
        for slot in sorted({s, (s - 1) % size}):
            lo, hi = b.slice_bounds(slot)
            for layer in b.layers:
                for name in lay.layer_params[layer]:
                    pr = lay.params[name]
                    total += max(0, min(hi, pr.bucket_offset + pr.numel) - max(lo, pr.bucket_offset))
    return total


def errors(run):
    try:
        run()
        mine = None
    except Exception as e:     # noqa: BLE001 -- reported to the test
        mine = f"{type(e).__name__}: {e}"
    return WORLD.allgather(mine)


def main():
    out = {"stages": {}}
    hierarchical = {"shard_size": N // 2, "node_size": N // 2} if N % 2 == 0 else {}
    for stage, kw in [(0, {}), (1, {}), (2, {}), (3, {}), (3, hierarchical)]:
        whole = make(lazy.materialize(rules()), stage, **kw)
        ref = whole.gather_master()
        whole.close()
        layers = rules()
        tracemalloc.start()
        eng = make(layers, stage, **kw)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        held = sum(eng.ledger.current.values())
        made = sum(p.made for _, params in layers for p in params.values())
        got = eng.gather_master()
        largest = max(b.numel for b in eng.layout.buckets) * 4
        report = WORLD.gather({"same": bool((got == ref).all()), "made": made, "expected": made_expected(eng),
                               "extra": peak - held, "largest_slice": largest // eng.topology.shard_size,
                               "model_fp32": 4 * eng.layout.params_numel}, root=0)
        eng.close()
        out["stages"][f"{stage}{'/replicas' if kw else ''}"] = report
    out["seed"] = errors(lambda: ZeroEngine(rules(seed=7 if RANK == 1 else 0), config(3)))
    out["broadcast"] = errors(lambda: ZeroEngine(rules(), config(1, init_values="broadcast")))
    if RANK == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
