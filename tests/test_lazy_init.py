"""Lazy parameters (engine/lazy.py, engine/initial.py): the built-in models give the engine rules
instead of arrays, each rank makes only what it keeps, and the values are today's bit for bit.

The oracle for "today's" is the whole-array construction as the models wrote it before they were
lazy, copied here (GPT-2 style normals from one generator in turn; the MLP's N(0, 1/width))."""
import json

import numpy as np
import pytest

from zerompi import ZeroConfig, ZeroEngine
from zerompi.comm.tp_pieces import piece
from zerompi.engine import lazy
from zerompi.errors import UsageError
from zerompi.train.models.gpt import GPT
from zerompi.train.models.mlp import MLP
from zerompi.train.models.mlp_tp import TPMLP
from tests.mpirun import ROOT, run_mpi


def gpt_whole(vocab, seq_len, n_layer, d_model, seed):
    """The GPT's initial values as GPT.init_layers built them whole before lazy_layers existed."""
    rng = np.random.default_rng([seed, 0x6E7])
    C, L = d_model, n_layer
    normal = lambda shape, std=0.02: (rng.standard_normal(shape) * std).astype(np.float32)
    zeros, ones = (lambda n: np.zeros(n, np.float32)), (lambda n: np.ones(n, np.float32))
    layers = [("embed", {"wte": normal((vocab, C)), "wpe": normal((seq_len, C))})]
    resid = 0.02 / np.sqrt(2 * L)
    for i in range(L):
        p = f"block{i}."
        layers.append((f"block{i}", {p + "ln1.g": ones(C), p + "ln1.b": zeros(C), p + "qkv.w": normal((C, 3 * C)),
                                     p + "qkv.b": zeros(3 * C), p + "proj.w": normal((C, C), resid),
                                     p + "proj.b": zeros(C), p + "ln2.g": ones(C), p + "ln2.b": zeros(C),
                                     p + "fc.w": normal((C, 4 * C)), p + "fc.b": zeros(4 * C),
                                     p + "out.w": normal((4 * C, C), resid), p + "out.b": zeros(C)}))
    layers.append(("ln_f", {"ln_f.g": ones(C), "ln_f.b": zeros(C)}))
    return layers


def mlp_whole(width, depth, seed):
    rng = np.random.default_rng(seed)
    return [(f"block{i}",
             {f"block{i}.weight": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
              f"block{i}.bias": np.zeros(width, np.float32)}) for i in range(depth)]


def same_bits(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert list(g) == list(w)
        for k in w:
            assert g[k].dtype == np.float32 and g[k].shape == w[k].shape and g[k].tobytes() == w[k].tobytes(), k


class _TP:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_models_give_todays_values_bit_for_bit():
    same_bits(GPT(32, 8, 3, 4, 16, seed=5).init_layers(), gpt_whole(32, 8, 3, 16, 5))
    same_bits(MLP(24, 3, seed=2).init_layers(), mlp_whole(24, 3, 2))
    for r in range(2):                       # tensor-parallel pieces: today's whole values, cut
        tp = GPT(32, 8, 2, 4, 16, seed=5, tp=_TP(r, 2))
        want = [(ln, {n: piece(a, *tp.tp_split()[n], r, 2) if n in tp.tp_split() else a for n, a in ps.items()})
                for ln, ps in gpt_whole(32, 8, 2, 16, 5)]
        same_bits(tp.init_layers(), want)
        mtp = TPMLP(24, 4, seed=2, tp=_TP(r, 2))
        want = [(ln, {n: piece(a, *mtp.tp_split()[n], r, 2) if n in mtp.tp_split() else a for n, a in ps.items()})
                for ln, ps in mlp_whole(24, 4, 2)]
        same_bits(mtp.init_layers(), want)


def test_any_run_in_any_order_is_the_same_values(monkeypatch):
    # Small draws at a time and states kept every 64 draws: runs that cross both, forwards and back.
    monkeypatch.setattr(lazy, "CHUNK", 16)
    monkeypatch.setattr(lazy, "KEEP_EVERY", 64)
    stream = lazy.Stream(11)
    a, b = stream.normal((50, 30), scale=0.3), stream.normal((70, 9), divisor=3.0)
    rng = np.random.default_rng(11)
    want_a = (rng.standard_normal((50, 30)) * 0.3).astype(np.float32).reshape(-1)
    want_b = (rng.standard_normal((70, 9)) / 3.0).astype(np.float32).reshape(-1)
    draws = lazy.Draws()
    for p, want, (lo, hi) in [(b, want_b, (600, 630)), (a, want_a, (1400, 1500)), (a, want_a, (3, 90)),
                              (b, want_b, (0, 630)), (a, want_a, (777, 778)), (a, want_a, (0, 1500))]:
        out = np.empty(hi - lo, np.float32)
        p.fill(out, lo, hi, draws)
        assert out.tobytes() == want[lo:hi].tobytes(), (lo, hi)
    w = lazy.Normal((12, 6), 3, 0, scale=1.0)
    full = w.materialize()
    for axis, groups in [(0, 1), (1, 3), (1, 1)]:
        for r in range(3 if groups == 1 and axis == 0 else 2):
            size = 3 if groups == 1 and axis == 0 else 2
            p = lazy.Piece(w, axis, groups, r, size)
            ref = piece(full, axis, groups, r, size).reshape(-1)
            out = np.empty(5, np.float32)
            p.fill(out, 3, 8, draws)
            assert out.tobytes() == ref[3:8].tobytes() and p.materialize().tobytes() == ref.tobytes()
    with pytest.raises(ValueError, match="scale or a divisor"):
        lazy.Normal((2,), 0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_engine_from_rules_equals_arrays(stage):
    model = GPT(32, 8, 2, 4, 16, seed=1)
    cfg = ZeroConfig(stage=stage, dtype="fp16", bucket_mb=0.01)
    engines = [ZeroEngine(layers, cfg) for layers in (model.lazy_layers(), model.init_layers())]
    masters = [e.gather_master() for e in engines]
    assert masters[0].tobytes() == masters[1].tobytes()
    for e in engines:
        e.close()


def test_broadcast_needs_arrays():
    with pytest.raises(UsageError, match="broadcast.*lazy"):     # on one rank too (the driver checks N = 4)
        ZeroEngine(MLP(8, 2).lazy_layers(), ZeroConfig(init_values="broadcast"))


def test_ranks_make_only_their_part_and_check_it():
    proc = run_mpi(4, [ROOT / "tests" / "drivers" / "lazy_init.py"], timeout=180)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, ranks in out["stages"].items():
        for r in ranks:
            assert r["same"], case                         # the same master bits as from whole arrays
            assert r["made"] == r["expected"], case        # its own slices and the slot before's, nothing else
            if not case.startswith("0"):                   # what the construction held beside the ledger:
                assert r["extra"] < 2 * r["largest_slice"] + 2 ** 17, (case, r)   # a bucket's slices ...
                assert r["extra"] < r["model_fp32"] / 2, (case, r)                # ... never the model
    assert len(set(out["seed"])) == 1 and "MismatchError" in out["seed"][0]
    assert "slot 0's slice of bucket 0" in out["seed"][0] and "by rank 0; one value by rank 1" in out["seed"][0]
    assert all(e and "UsageError" in e and "broadcast" in e for e in out["broadcast"])
