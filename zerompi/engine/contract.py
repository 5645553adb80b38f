"""The cross-rank contract: what every rank must do alike, and where the engine checks it.

ZeRO pairs each rank's collectives with the others' by call order, and builds one model from
every rank's slices, so ranks that disagree give wrong numbers without an error unless
someone checks. The contract, and what breaking it gets:

- **Same configuration and layers** (names, shapes, order): compared at construction, one
  digest per rank (comm/consistency.py); a difference names the field and the ranks.
- **Same initial values**: a digest per parameter, compared at construction
  (``init_values="check"``, the default; a difference names the first differing parameter
  and the ranks), or rank 0's values broadcast to every rank (``init_values="broadcast"``).
  Lazy parameters (engine/lazy.py) are checked on what the ranks made of them: every slice is
  made by two ranks and their digests compared (engine/initial.py).
- **Same order of gradient reductions**: nothing to check -- the reducer starts them in a
  fixed bucket order whatever order the gradients arrive in (reducer.py).
- **Same unshard order (stage 3), same lr, same step**: every step's gradient-norm
  all-gather carries three more numbers per rank: the ``lr`` the step uses, the step
  number, and a fingerprint of the buckets this rank gathered since the last step. A
  difference stops every rank in ``step()``, before any parameter is updated.

Every failure is a MismatchError raised on every rank at the same point (exit status 2 in
the CLI), naming the ranks and the values.
"""
import hashlib
import weakref
from dataclasses import asdict
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np

from ..comm.communicator import world_rank
from ..comm.consistency import check_consistent, rank_set
from ..comm.flight import Peers
from ..comm.simulated_world import simulated
from ..comm.watchdog import Watchdog, watched
from ..errors import ConfigError, MismatchError, UsageError
from ..optim import dtypes
from .faults import GradientGuard, fault_from_env
from .lazy import is_lazy

FINGERPRINT_MOD = 2 ** 52        # fingerprints stay exact integers in a float64
STEP_COLUMNS = ("lr", "step", "gathers")   # what rides along with the step's all-gather, in order


# ---- at construction ------------------------------------------------------------------
def start_guards(engine):
    """(faults.GradientGuard, comm.watchdog.Watchdog) of a new engine: before its first collective
    that depends on the config the watchdog starts, then every rank must have the same config,
    layers and topology (comm/consistency.py; MismatchError on every rank otherwise), then the
    ranks exchange their reporters' addresses (comm/flight.py: who had not arrived, when it fires)."""
    mpi = engine.comm.mpi
    stand_ins = simulated(mpi)     # comm/simulated_world.py: rank R of a world of stand-ins
    rank = world_rank(mpi)        # what the fault's rankR and every rank's own lines number (not the DP rank under TP)
    guard = GradientGuard(rank, engine.dtype, engine.config.max_skipped_steps, fault_from_env(),
                          stand_ins=engine.comm if stand_ins else None)
    if engine.tp is not None:     # the step's non-finite count is summed over the TP group too: its report as well
        guard.tp_rank = engine.mesh.tp_rank
        guard.groups.append(("the tensor-parallel group", engine.mesh.tp_comm))
    me = weakref.ref(engine)      # the thread must not keep a forgotten engine alive
    step = lambda: me().steps_taken + 1      # noqa: E731
    dog = Watchdog(engine.comm.waiting, engine.config.timeout_s, rank, mpi, step=step)
    if stand_ins:                 # what its watchdog can time: this rank's injected hang, the stand-ins waiting
        dog.stand_ins = mpi.world_size - 1
    weakref.finalize(engine, dog.close)
    try:
        agreed = setup_fields(engine.recorded_config(), engine.layout, engine.topology)
        check_consistent(engine.comm, "engine", agreed)
        if engine.comm.size > 1 and not stand_ins:    # a fired watchdog names who had not arrived (comm/flight.py)
            dog.peers = Peers.start(engine.comm, engine.comm.waiting, rank, step, lambda: dog.fired is not None)
    except BaseException:
        dog.close()
        raise
    return guard, dog


# ---- the layers ----------------------------------------------------------------------
def setup_fields(config, layout, topology) -> dict:
    """What every rank must have alike at construction, for comm/consistency.check_consistent: the
    config (a dict: the engine's recorded_config), each parameter's shape as a field of its own (a
    difference names it), the layer order, the layout and the topology."""
    return {"zero": config, "shape": {name: list(pr.shape) for name, pr in layout.params.items()},
            "layers": layout.layer_names, "layout": layout.describe(), "topology": asdict(topology)}



def check_layers(layers):
    """``layers`` as a list of (layer name, {param name: array}); UsageError naming what is wrong
    (not a mapping of layers, or a parameter that is not a floating array)."""
    pairs = list(layers.items()) if isinstance(layers, Mapping) else list(layers)
    for item in pairs:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], Mapping)):
            raise UsageError(f"layers: {item!r:.60} is not a (layer name, {{param name: array}}) pair; pass an "
                             "ordered mapping or a list of such pairs")
        lname, params = item
        for pname, arr in params.items():
            dt = getattr(arr, "dtype", None)
            if dt is None or not dtypes.is_float(dt):
                what = f"dtype {dt}" if dt is not None else f"a {type(arr).__name__}"
                raise UsageError(f"parameter {pname!r} of layer {lname!r} is {what}; a floating array (float16, "
                                 "bfloat16, float32 or float64) is required")
    return pairs


def storage_dtype(name: str, xp):
    """The NumPy dtype of ZeroConfig.dtype; ConfigError where bf16 cannot be had (no ml_dtypes, or
    a CuPy without bfloat16 arrays)."""
    dt = dtypes.storage_dtype(name)
    if name == "bf16" and getattr(xp, "__name__", "") == "cupy":
        try:
            xp.zeros(1, dt)
        except Exception as e:   # CuPy before 14 refuses the dtype (TypeError, ValueError)
            raise ConfigError(f"dtype='bf16' on the GPU needs a CuPy with bfloat16 arrays (14 or later; this is "
                              f"{getattr(xp, '__version__', '?')}: {type(e).__name__}); "
                              "use fp16 or fp32 on it") from None
    return dt


# ---- initial values ----------------------------------------------------------------
def _digest(values: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(values).tobytes(), digest_size=16).digest()


def agree_initial_values(comm, pairs, mode: str, tp=None) -> List[Tuple[str, Dict[str, np.ndarray]]]:
    """The initial values every rank will use, as fp32 arrays in the callers' shapes; with tensor
    parallelism (``tp``, engine/tp_groups.py) also the same config, split and replicated values over the mesh."""
    values = _agree_values(comm, pairs, mode)
    if tp is not None:
        tp.agree(comm, values, mode, _agree_values)
    return values


def _agree_values(comm, pairs, mode: str) -> List[Tuple[str, Dict[str, np.ndarray]]]:
    """The initial values every rank of ``comm`` will use, as fp32 arrays in the callers' shapes (lazy
    parameters, engine/lazy.py, pass through: engine/initial.py checks what the ranks make of them).

    ``mode`` "check": MismatchError on every rank unless every rank passed the same values
    (one 16-byte digest all-gathered; per-parameter digests only on a mismatch).
    "broadcast": rank 0's values, broadcast to every rank. A collective.
    """
    values = [(lname, {p: a if is_lazy(a) else np.ascontiguousarray(a, dtype=np.float32) for p, a in params.items()})
              for lname, params in pairs]
    lazy = [p for _, params in values for p, a in params.items() if is_lazy(a)]
    if mode == "broadcast" and lazy:       # at any world size: a script must not work on one rank only
        raise UsageError(f"init_values='broadcast' needs whole arrays, and parameter {lazy[0]!r} is lazy (each "
                         "rank makes only its shard of it); use init_values='check', or pass the arrays")
    mpi = comm.mpi
    if mpi.Get_size() == 1:
        return values
    whole = [(lname, {p: a for p, a in params.items() if not is_lazy(a)}) for lname, params in values]
    if mode == "broadcast":
        with watched(comm, "broadcast of rank 0's initial values"):
            for _, params in values:
                for arr in params.values():
                    mpi.Bcast(arr, root=0)
        return values
    digests = [(lname, p, _digest(a), float(a.reshape(-1)[0]) if a.size else 0.0)
               for lname, params in whole for p, a in params.items()]
    mine = hashlib.blake2b(b"".join(d for _, _, d, _ in digests), digest_size=16).digest()
    with watched(comm, "start-up check of the initial values"):
        everyone = mpi.allgather(mine)
        if all(d == everyone[0] for d in everyone):
            return values
        tables = mpi.allgather(digests)      # only on a mismatch: every rank is here too
    raise MismatchError(init_mismatch_message(tables))


def init_mismatch_message(tables: Sequence[Sequence[tuple]]) -> str:
    """One line naming the first parameter whose initial values differ, and which ranks hold which."""
    for i, (lname, pname, _, _) in enumerate(tables[0]):
        groups: Dict[bytes, List[int]] = {}
        first: Dict[bytes, float] = {}
        for rank, table in enumerate(tables):
            _, _, d, f = table[i]
            groups.setdefault(d, []).append(rank)
            first.setdefault(d, f)
        if len(groups) > 1:
            held = "; ".join(f"{rank_set(rs)} (first element {first[d]:.6g})" for d, rs in groups.items())
            return (f"initial values differ between ranks: parameter {pname!r} of layer {lname!r} has "
                    f"{len(groups)} different values: {held}; give every rank the same initial values (the "
                    "same seed), or ZeroConfig(init_values='broadcast') to use rank 0's")
    return "initial values differ between ranks"   # the digests of the digests differed: not reached


# ---- every step ------------------------------------------------------------------------
class GatherLog:
    """The buckets this rank started gathering since the last step: a fingerprint (exact in a
    float64) and the first few bucket numbers, for the message."""

    KEEP = 64

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.fingerprint = 0
        self.count = 0
        self.first: List[int] = []

    def add(self, bucket: int) -> None:
        self.fingerprint = (self.fingerprint * 1_000_003 + bucket + 1) % FINGERPRINT_MOD
        self.count += 1
        if len(self.first) < self.KEEP:
            self.first.append(bucket)


def step_columns(lr: float, step: int, gathers: GatherLog) -> List[float]:
    """The numbers (STEP_COLUMNS) this rank adds to the step's all-gather."""
    return [float(lr), float(step), float(gathers.fingerprint)]


def check_step(comm, table: np.ndarray, gathers: GatherLog) -> None:
    """MismatchError on every rank when the STEP_COLUMNS of ``table`` (its last columns; one row
    per rank, identical on every rank) differ between ranks. On a gather mismatch the ranks
    all-gather their bucket lists to name them (every rank is on this path together)."""
    cols = table[:, -len(STEP_COLUMNS):]
    if (cols == cols[0]).all():
        return
    lr, step, fp = (cols[:, i] for i in range(3))
    if not (step == step[0]).all():
        raise MismatchError("ranks are at different steps: " + _groups(step, lambda v: f"step() call {int(v)}")
                            + "; every rank must call step() once per step")
    if not (lr == lr[0]).all():
        raise MismatchError("ranks called step() with different learning rates: " + _groups(lr, lambda v: f"lr={v:g}")
                            + "; every rank must use the same lr (and schedule)")
    with watched(comm, "gather-order report: all-gather of the buckets each rank gathered", int(step[0])):
        logs = comm.mpi.allgather((gathers.count, gathers.first))
    shown = []
    for rank, (count, first) in enumerate(logs):
        more = f" and {count - len(first)} more" if count > len(first) else ""
        shown.append(f"rank {rank} {first}{more}")
    raise MismatchError(f"ranks gathered parameters in different orders before step {int(step[0])} (buckets, in "
                        f"order: {'; '.join(shown)}); every rank must unshard the same layers in the same order")


def _groups(values: np.ndarray, show) -> str:
    seen: Dict[float, List[int]] = {}
    for rank, v in enumerate(values.tolist()):
        seen.setdefault(v, []).append(rank)
    return ", ".join(f"{show(v)} on {rank_set(rs)}" for v, rs in seen.items())
