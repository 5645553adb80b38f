"""ZeroEngine: sharded parameters, gradients and AdamW state for stages 0-3.

The model drives it layer by layer::

    engine.begin_forward()                       # optional hint: the visit order that follows
    for layer in range(L):                       # forward
        with engine.unsharded(layer) as p: ...   # stage 3 gathers here (and prefetches the next buckets)
    engine.begin_backward()
    for layer in reversed(range(L)):             # backward
        with engine.unsharded(layer) as p: ...
        engine.grads_ready(layer, grads)         # starts the bucket's reduce-scatter
    result = engine.step()                       # stages 1/2: all-gathers the new parameters

Collectives run behind compute: non-blocking, moved on at every unshard, reshard and
grads_ready, waited for when their data is read (docs/overlap.md; ``engine.timers``).
Gradients handed back are this rank's micro-batch loss's, times ``loss_scale``; the engine
averages them over ranks and micro-batches.
"""
import atexit
import functools
from contextlib import contextmanager
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..checkpoint import collective as checkpoint
from ..comm.communicator import as_communicator
from ..comm.meshconfig import MeshConfig
from ..comm.staging import device_transfers, on_device
from ..comm.topology import arrange, place
from ..comm.watchdog import watched
from ..errors import UsageError, install_abort_hook
from ..layout import FlatLayout
from ..optim import impl
from . import contract, initial, step as stepping, trace, traffic
from .buffers import BucketPool, plan_classes
from .config import ZeroConfig
from .gatherer import ParameterGatherer
from .in_backward import UpdateInBackward
from .inflight import InFlight
from .loss_scale import DynamicLossScaler
from .memory import MemoryLedger, memory_report
from .optimizers import sharded_optimizer
from .phase import Phase, infer_phase
from .reducer import MAX_PENDING_REDUCES, GradientReducer
from .step import PendingStep, StepResult
from .tp_groups import TensorParallel, group_sizes, mesh_config_of, mesh_of
from .timers import StepTimers

LayersArg = Union[Mapping[str, Mapping[str, np.ndarray]], Sequence[Tuple[str, Mapping[str, np.ndarray]]]]


class ZeroEngine:
    """ZeRO data parallelism over ``comm`` for a model given as named layers of named arrays.

    ``layers``: an ordered mapping (or list of pairs) layer name -> {param name -> array, or a lazy
    rule (engine/lazy.py): each rank then makes only its shard}; every rank must pass the same values.
    ``config``: a ZeroConfig.
    ``comm``: an mpi4py communicator (default COMM_WORLD), a zerompi Communicator, or a zerompi.Mesh
    (tensor / sequence parallelism: ZeRO over its dp x sp ranks; ``tp_split`` names the TP-split parameters);
    with ``xp`` CuPy, a host one is staged through pinned buffers (comm/staging.py; or pass a device one).
    ``mesh_config``: a MeshConfig (nodes, shard groups; tp / sp > 1 without a Mesh: one is made over ``comm``).
    ``sources``: each rank hands back every gradient as that many partials (an array of that many gradients),
    reduced in (rank, source) order as if the ranks were that many times more (expert parallelism: each partial
    a source rank's; comm/sources_reduce.py). ``sources_per_node``: with sources, the world's node size counted in
    sources, where each rank's sources span whole nodes (its group one rank per node): each node's partials are
    then summed first, as a two-level reduce-scatter's node level sums them.

    Composed of its parts, each owning its state: ``reducer`` (GradientReducer: the gradient
    buffers and reduce-scatters), ``gatherer`` (ParameterGatherer: the stored parameters,
    unshard / reshard, all-gathers), ``optimizer`` (ShardedAdamW: the fp32 master and Adam
    moments); the first two start their collectives through one ``inflight`` (InFlight)
    and take bucket buffers from one ``pool`` (BucketPool). The engine runs the step.
    """

    def __init__(self, layers: LayersArg, config: Optional[ZeroConfig] = None, comm=None, xp=np, tp_split=None,
                 mesh_config: Optional[MeshConfig] = None, sources: int = 1,
                 sources_per_node: Optional[int] = None):
        self.config = config or ZeroConfig()
        if not isinstance(self.config, ZeroConfig):
            raise UsageError(f"config is a {type(self.config).__name__}; pass a zerompi.ZeroConfig")
        if self.config.abort_on_exception:
            # an exception on one rank ends the job, as in the CLI (misuse found below too)
            install_abort_hook()
        pairs = contract.check_layers(layers)
        # A Mesh (comm/mesh.py: tp, sp, pp; engine/tp_groups.py), or mesh_config tp / sp > 1:
        # ZeRO over its dp x sp ranks.
        if mesh_config is not None and not isinstance(mesh_config, MeshConfig):
            raise UsageError(f"mesh_config is a {type(mesh_config).__name__}; pass a zerompi.MeshConfig")
        self.mesh_config = mesh_config_of(comm, self.config, mesh_config)
        self.mesh = mesh_of(comm, self.mesh_config, "config" if mesh_config is None else "mesh_config")
        shapes = {n: np.shape(a) for _, p in pairs for n, a in p.items()}
        self.tp = TensorParallel.of(self.mesh, self.recorded_config(), tp_split, shapes)
        comm = self.mesh.zero_comm if self.mesh else comm
        # Nodes and shard groups (comm/topology.py; of the ZeRO group with a Mesh; ranks placed round-robin are
        # numbered node by node).
        mesh = self.mesh
        units = mesh.tp if mesh and mesh.pp == 1 else 1      # a bad size is named in the world's units, the user's
        comm = on_device(as_communicator(comm, self.config.timeout_s, self.config.abort_on_exception), xp)
        self.comm, self.topology = place(comm, *group_sizes(mesh, self.mesh_config), renumber=mesh is None, tp=units)
        self.xp, topo = xp, self.topology
        self.rank, self.world_size = self.comm.rank, self.comm.size
        self.optimizer_impl = impl.use_impl(self.config.optimizer_impl, xp, verbose=self.rank == 0)  # "fused"/"numpy"
        self.dtype = contract.storage_dtype(self.config.dtype, xp)   # bf16: ConfigError where it cannot be had
        spec = [(lname, [(pname, np.shape(a)) for pname, a in params.items()]) for lname, params in pairs]
        # A bucket is cut into shard_size slices, each a multiple of align * replicas elements
        # (the all-reduce across groups splits it again).
        self.layout = FlatLayout(spec, topo.shard_size,
                                 max(1, self.config.bucket_bytes // np.dtype(self.dtype).itemsize),
                                 self.config.align * topo.replicas)
        self.guard, self.watchdog = contract.start_guards(self)   # the watchdog (its peers: every rank's host)
        pairs = contract.agree_initial_values(self.comm, pairs, self.config.init_values, self.tp)
        comms = arrange(self.comm, topo, bool(self.config.quantize_weights or self.config.quantize_grads))
        self.group, self.replica = comms.group, comms.replica   # gradients and parameters; across groups
        self.slot = self.group.slot
        transfers = device_transfers(self.comm, xp)     # device <-> host copies, for offloaded state
        self.ledger = MemoryLedger(xp, transfers and transfers.pinned)
        self.scaler = DynamicLossScaler(self.config.init_loss_scale, self.config.loss_scale_window,
                                        self.config.min_loss_scale, enabled=self.config.dtype == "fp16")
        self.step_count = 0             # optimizer updates applied
        self.steps_taken = 0            # step() calls, skipped ones included
        self.stand_in_overflows = 0     # a simulated rank's steps applied with zero gradients (engine/step.py)
        self.closed = False
        self._pending = None            # a step begun (begin_step) and not finished (engine/step.py)
        self.timers = StepTimers()                      # phase and communication seconds (engine/timers.py)
        self._phase = Phase.IDLE                        # where the step is: drives prefetch and timers
        self._last_layer: Optional[int] = None          # layer of the latest unshard (direction inference)
        progress_thread = None
        if self.config.progress == "thread":
            from ..comm.progress import ProgressThread
            with watched(self.comm, "progress thread: duplicating the communicator"):   # a collective
                progress_thread = ProgressThread(self.comm.mpi)
        self.inflight = InFlight(self.comm, self.timers, progress_thread)
        self.pool = pool = BucketPool(self.ledger, self.dtype,
                                      plan_classes(self.layout, self.config, MAX_PENDING_REDUCES))
        self.gatherer = ParameterGatherer(self.layout, self.config, self.group, self.inflight, pool, self.ledger,
                                          self.dtype, self.rank)
        self.reducer = GradientReducer(self.layout, self.config, self.group, self.replica, self.world_size,
                                       self.inflight, pool, self.ledger, self.guard, self.dtype, sources,
                                       sources_per_node)
        self.optimizer = sharded_optimizer(self.layout, self.config, self.ledger, self.slot, self.rank, transfers,
                                           self.group)
        initial.load(self, pairs)        # each rank makes its own part (lazy: checked, engine/initial.py)
        self.in_backward = UpdateInBackward(self)       # nvme: a bucket's update starts when its shard is final
        self.trace = trace.attach(self) if self.config.trace else None   # the timeline (engine/trace.py)
        self.publish_params(all_gather=True)
        # A program that ends without close() must not reach MPI_Finalize with collectives in flight.
        self._at_exit = functools.partial(self.inflight.drain, self.config.timeout_s)
        atexit.register(self._at_exit)

    # ---- the step's phase: what the timers charge, the direction prefetch follows ----
    def _enter(self, phase: Phase) -> None:
        self._phase = phase
        self.timers.enter(phase)

    # ---- parameters for compute (the gatherer) ----------------------------------------
    def unshard(self, layer: int) -> Dict[str, np.ndarray]:
        """Make layer's parameters whole on this rank and return them (views, storage dtype).

        Stage 3 all-gathers the layer's bucket (every rank must call this in the same
        order); stages 0-2 already hold them. Pair each call with :meth:`reshard`.
        """
        self._check_open()
        self._check_layer(layer)
        self._enter(infer_phase(self._phase, self._last_layer, layer))
        self._last_layer = layer
        return self.gatherer.unshard(layer, self._phase, self.reducer.micro, self.steps_taken + 1)

    def reshard(self, layer: int) -> None:
        """Release layer's parameters (frees nothing itself: stage 3's bucket returns to the pool at
        the next unshard, begin_forward or step that finds no layer or window needing it)."""
        self._check_layer(layer)
        self.gatherer.reshard(layer)

    @contextmanager
    def unsharded(self, layer: int):
        """``with engine.unsharded(i) as params:`` unshard on entry, reshard on exit."""
        params = self.unshard(layer)
        try:
            yield params
        finally:
            self.reshard(layer)

    def params(self, layer: int) -> Dict[str, np.ndarray]:
        """Layer's stored parameters (views). Stage 3: only between unshard and reshard."""
        self._check_open()
        self._check_layer(layer)
        return self.gatherer.read(layer)

    def begin_forward(self) -> None:
        """Hint: a forward pass over layers 0, 1, ... starts now (then the backward, in reverse).

        Optional: without it the direction is inferred from the unshard order. Stage 3 starts
        gathering the first buckets here (step() already did, for the first micro-batch).
        Every rank must make the same calls.
        """
        self._check_open()
        self._enter(Phase.FORWARD)
        self._last_layer = None
        if self.config.stage == 3 and self.config.overlap:
            self.gatherer.prefetch_forward(self.steps_taken + 1)
        self.inflight.poll()

    def begin_backward(self) -> None:
        """Hint: the backward pass (layers L-1, ..., 0) starts now."""
        self._check_open()
        self._enter(Phase.BACKWARD)
        self.inflight.poll()

    # ---- gradients (the reducer) ---------------------------------------------------
    def grads_ready(self, layer: int, grads: Mapping[str, np.ndarray]) -> None:
        """Hand back layer's gradients for this micro-batch (every parameter, its shape).

        They are stored in the storage dtype; when every layer of a bucket has handed
        its gradients back, that bucket's reduce-scatter starts (non-blocking).
        """
        self._check_open()
        self._check_layer(layer)
        self.reducer.check_grads(layer, grads)
        if self._phase is not Phase.BACKWARD:     # gradients arriving: the backward has begun
            self._enter(Phase.BACKWARD)
        if self.reducer.add(layer, grads, self.steps_taken + 1):
            self._enter(Phase.IDLE)               # a micro-batch is complete

    def synchronize(self) -> None:
        """Complete every in-flight collective (gradient reductions, parameter all-gathers).

        Call it before touching the engine's buffers other than through unshard, params and
        step: full_parameters, close and checkpoints do. Every rank must call it.
        """
        self.reducer.finish_all()
        self.gatherer.finish_all()

    # ---- the optimizer step -------------------------------------------------
    def step(self, lr: Optional[float] = None) -> StepResult:
        """Finish the reductions, check for overflow, clip, update the shard, publish parameters.

        Every rank must call it after the configured number of micro-batches.
        ``lr`` overrides config.lr for this step (a schedule); it must be the same on every rank.
        """
        return stepping.finish(self, stepping.begin(self, lr))

    def begin_step(self, lr: Optional[float] = None) -> PendingStep:
        """step()'s first half (engine/step.py): the reductions completed and this engine's gradient totals
        (sum of squares, non-finite count) over its group, the same on its every rank. For several engines
        deciding one step (a pipeline's stages): sum their totals and give the sum to each finish_step."""
        return stepping.begin(self, lr)

    def finish_step(self, pending: PendingStep, totals=None) -> StepResult:
        """step()'s second half: skip (a non-finite total) or clip and update by ``totals`` (sum of squares,
        non-finite count; None: the engine's own), then publish. Every rank must pass the same totals."""
        return stepping.finish(self, pending, totals)

    def _end_step(self) -> None:
        """Stage 3 starts gathering the next forward's first buckets; the step's timer closes."""
        if self.config.stage == 3 and self.config.overlap:
            self.gatherer.prefetch_forward(self.steps_taken + 1)
        self._last_layer = None
        self.optimizer.plan_next(self.in_backward.order(), self.steps_taken + 1)   # a file's rows: read ahead now
        self._enter(Phase.IDLE)
        if self.trace is not None:
            self.trace.step_done(self.steps_taken)

    def publish_params(self, all_gather: bool = True) -> None:
        """Write the stored-dtype parameters from the master; stages 1/2 then all-gather them
        (every rank calls it: after the master was written other than by step(), as load() does)."""
        st, params = self.config.stage, self.gatherer.params
        self.optimizer.unpublished = False
        self.gatherer.parameters_changed()
        if st == 0:
            params[...] = self.optimizer.master
            return
        for bucket in self.layout.buckets:
            self.gatherer.set_shard(bucket.index, self.optimizer.master_slice(bucket.shard_slice))
        if all_gather and st in (1, 2):
            for bucket in self.layout.buckets:
                self.gatherer.wire.all_gather(params[bucket.start:bucket.stop])   # quantized with qwZ

    # ---- checkpoints (zerompi/checkpoint/, docs/checkpoint.md) ---------------
    def save(self, path: str, extra_state: Optional[dict] = None, blocking: bool = True,
             keep_last: Optional[int] = None):
        """Write a sharded checkpoint under directory ``path`` (a collective, between steps); returns the new
        checkpoint directory, which ``path``/latest names once it is complete. ``blocking=False``: copy the
        shard to host memory, write it in the background and return a PendingSave (published at a later
        step(), the next save or close()). ``keep_last``: then keep the newest K (checkpoint/collective.py).
        With tensor parallelism each TP rank saves under ``path``/tp{r}-of-{K}."""
        if self.tp:
            path, extra_state = self.tp.path(path), self.tp.extra(extra_state)
        return checkpoint.save(self, path, extra_state, blocking, keep_last)

    def load(self, path: str):
        """Restore from a checkpoint (directory, or a save directory's ``latest``) saved at any world
        size, stage or bucket size (a collective); returns a LoadInfo, CheckpointError on bad input."""
        return self.tp.load(self, path, checkpoint.load) if self.tp else checkpoint.load(self, path)

    # ---- results and reports ---------------------------------------------------
    def recorded_config(self) -> dict:
        """The config as checkpoints and the ranks' agreement record it: ZeroConfig's fields and the mesh's."""
        return dict(self.config.to_dict(), **self.mesh_config.to_dict())

    @property
    def loss_scale(self) -> float:
        """Multiply the loss (or its gradient) by this before the backward (1.0 in fp32 mode)."""
        return self.scaler.scale

    def full_parameters(self) -> Dict[str, np.ndarray]:
        """Consolidated fp32 master parameters by name, as NumPy arrays (a collective: all ranks call)."""
        flat = self.gather_master()
        return {name: flat[pr.start:pr.stop].reshape(pr.shape).copy() for name, pr in self.layout.params.items()}

    def gather_master(self) -> np.ndarray:
        """The whole padded fp32 master in world layout on every rank (a collective)."""
        self._check_open()
        self.synchronize()
        self.optimizer.wait()          # a delayed update in flight: the master is whole again
        return self.optimizer.gather(self.group, self.steps_taken)

    def unpadded_master(self) -> np.ndarray:
        """fp32 master parameters in layout order without padding (a collective)."""
        flat = self.gather_master()
        return np.concatenate([flat[pr.start:pr.stop] for pr in self.layout.params.values()])

    def memory_report(self) -> Dict[str, Dict[str, int]]:
        """Bytes per rank: ``measured`` (allocated by this engine now), ``theory`` (DESIGN.md formula
        on Psi, unpadded), ``theory_padded`` (the same formula on the padded layout),
        ``peak_buffers`` (largest transient bytes held at once, communication scratch included)."""
        k = self.group.k if self.gatherer.secondary is not None else 0    # hpZ's copy: 1/node_size
        return memory_report(self.ledger, self.layout, self.config, self.topology.shard_size,
                             np.dtype(self.dtype).itemsize, k, sum(c.peak_scratch_bytes for c in self.communicators()))

    def comm_theory_bytes(self) -> int:
        """Bytes per step one rank should send for the gradient and parameter collectives (padded layout)."""
        return sum(self.comm_theory_bytes_by_level().values())

    def comm_theory_bytes_by_level(self, logical: bool = False) -> Dict[str, int]:
        """{"intra": bytes inside the node, "inter": across} (engine/traffic.py; ``logical``: unquantized)."""
        c, t = self.config, self.topology
        q = {} if logical else {"weights": self.gatherer.wire_quant, "grads": self.reducer.quant}
        size = np.dtype(self.dtype).itemsize
        out = traffic.step_bytes(c.stage, [b.numel for b in self.layout.buckets], size,
                                 t.size, t.node_size, t.shard_size, c.micro_batches, c.prefetch if c.overlap else 0,
                                 self.gatherer.secondary is not None, **q)
        if self.reducer.sources > 1:    # each reduce-scatter's partials (comm/sources_reduce.py)
            from collections import Counter
            extra = traffic.sources_bytes_by_level(Counter(b.numel for b in self.layout.buckets), size, t.size,
                                           self.reducer.sources, c.micro_batches, t.node_size, t.shard_size,
                                           self.reducer.per_node)
            out = {level: out[level] + extra[level] for level in out}
        return out

    def close(self) -> None:
        """Free every buffer. The engine cannot be used afterwards (a collective: every rank calls it)."""
        checkpoint.finish(self, release=True)      # a background save is published first
        self.reducer.close()
        self.gatherer.close()
        self.pool.clear()
        self.inflight.close()
        self.in_backward.close()
        self.optimizer.close()
        for c in self.communicators():
            c.free_scratch()
        if self.trace is not None:      # a collective: rank 0 writes the merged timeline
            self.trace.close()
        self.watchdog.close()
        atexit.unregister(self._at_exit)
        self.closed = True

    # ---- failures (docs/failures.md) --------------------------------------------
    def communicators(self) -> list:
        """The distinct Communicators this engine uses (the world's, its shard group's, across the groups)."""
        return list({id(c): c for c in (self.comm, self.group, self.replica) if c}.values())

    def _check_open(self) -> None:
        if self.closed:
            raise UsageError("this engine was closed; create a new one")

    def _check_layer(self, layer: int) -> None:
        if not (isinstance(layer, (int, np.integer)) and 0 <= layer < self.layout.num_layers):
            raise UsageError(f"layer={layer!r} is not a layer index; use 0..{self.layout.num_layers - 1}")
