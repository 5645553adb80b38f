"""The parameter gatherer: parameters made whole for compute (unshard / reshard).

Stage 3 keeps only this rank's slice of each bucket. ``unshard(layer)`` all-gathers the
layer's bucket into a transient buffer, and starts gathering the next buckets in visit
order (the prefetch window: at most 1 + ``config.prefetch`` buckets alive, plus those of
layers still held); ``reshard(layer)`` releases it, and the buffer returns to the engine's
pool once no held layer and no window needs it. Stages 1/2 publish their parameters with
the same gathers after the step, and ``unshard`` / ``params`` wait for a bucket only when
it is read.
Each bucket's state is a :class:`BucketState` (docs/overlap.md).
"""
import os
from enum import Enum
from typing import Dict, List

import numpy as np

from ..comm.quantized import QuantizedGather, quantization
from ..errors import UsageError
from ..optim import impl
from .offload import ParamFile, check_dir
from .offload.owner import HEADER_BYTES
from .contract import GatherLog
from .phase import Phase, prefetch_window, visits_after


class BucketState(Enum):
    """Where a bucket's whole stored parameters are on this rank."""
    SHARDED = "sharded"        # stage 3: only this rank's slice exists
    GATHERING = "gathering"    # all-gather in flight (stage 3, or the stage 1/2 publish after a step)
    UNSHARDED = "unsharded"    # whole bucket present


class ParameterGatherer:
    """Owns the stored parameters (the whole model in stages 0-2, the shard in stage 3), the
    stage-3 gathered buckets, the all-gathers in flight and the layers held unsharded.

    Uses the engine's ``layout``, ``config``, ``comm`` (the shard group's Communicator, flat or
    two-level), ``inflight`` (where its collectives are started and polled), ``pool``
    (stage-3 bucket buffers) and ``ledger`` (where the parameters are counted).

    hpZ (``config.hpz``, stage 3, a group across nodes): a bucket gathered across nodes also
    keeps this rank's super-slice (1/node_size of it) as a secondary copy; until the next
    step changes the parameters, the bucket is gathered from those copies inside the node.
    """

    def __init__(self, layout, config, comm, inflight, pool, ledger, dtype, rank: int = 0):
        self.layout, self.config, self.comm = layout, config, comm
        self.inflight, self.pool = inflight, pool
        self.slot = comm.slot
        st = config.stage
        self.param_file = None           # stage 3, offload_params="nvme": the stored shard in a file
        if config.offload_params == "nvme":
            n = layout.shard_numel * np.dtype(dtype).itemsize
            check_dir(config.offload_dir, HEADER_BYTES + n)
            self.param_file = ParamFile(config.offload_dir, f"zerompi-params-rank{rank}-pid{os.getpid()}.bin",
                                        [b.shard_slice for b in layout.buckets], dtype, rank)
            ledger.count("params", n, "disk")
            self.params = None
        else:
            self.params = ledger.alloc("params", layout.numel if st < 3 else layout.shard_numel, dtype)
        # hpZ: this rank's super-slice of every bucket (ledger category "secondary"), and whether it is current
        self.secondary = None
        if st == 3 and config.hpz and comm.hierarchical:
            self.secondary = [ledger.alloc("secondary", b.numel // comm.k, dtype) for b in layout.buckets]
        self.fresh = [False] * len(layout.buckets)
        self.wire_quant = q = quantization(config.quantize_weights, config.quant_block)
        self.wire = QuantizedGather(comm, q) if q is not None else comm   # qwZ: what the gathers send
        self._keep = set()             # buckets whose gather in flight refreshes their secondary
        nb = len(layout.buckets)
        self.state = [BucketState.UNSHARDED if st < 3 else BucketState.SHARDED] * nb
        self.gathered: Dict[int, np.ndarray] = {}     # stage 3: bucket -> whole bucket buffer
        self.handles: Dict[int, object] = {}          # bucket -> in-flight all-gather (stage 3, or 1/2 publish)
        self.holds = [0] * layout.num_layers          # unshard() calls not yet matched by reshard()
        self.peak_gathered_buckets = 0                 # stage 3: most gathered buckets alive at once
        self.log = GatherLog()                          # buckets gathered since the last step (contract.py)
        self.trace = None                               # the timeline's Tracer (engine/trace.py), or None

    # ---- where the parameters are ------------------------------------------------
    def param_slice(self, b: int) -> np.ndarray:
        """This rank's slice of bucket b's stored parameters (what the step writes)."""
        bucket = self.layout.buckets[b]
        if self.config.stage < 3:
            return self.params[bucket.world_slice(self.slot)]
        return self.params[bucket.shard_slice]

    def param_out(self, b: int):
        """Where the step writes bucket b's new stored parameters: this rank's slice, or (with the
        shard in a file) a callable that writes the host result there."""
        if self.param_file is not None:
            return lambda host: self.param_file.write(self.layout.buckets[b].shard_slice, host)
        return self.param_slice(b)

    def set_shard(self, b: int, values) -> None:
        """This rank's slice of bucket b from fp32 ``values`` (host or device), in the stored dtype."""
        if self.param_file is not None:
            self.param_file.write(self.layout.buckets[b].shard_slice,
                                  impl.to_host(values).astype(self.param_file.dtype))
            return
        dst = self.param_slice(b)
        dst[...] = impl.array_module(dst).asarray(values)

    def _read_shard(self, b: int, out) -> None:
        """This rank's slice of bucket b's stored parameters into ``out`` (from the file when there is one)."""
        sl = self.layout.buckets[b].shard_slice
        if self.param_file is None:
            out[...] = self.params[sl]
        elif impl.array_module(out) is np:
            self.param_file.read(sl, out)
        else:
            out[...] = impl.array_module(out).asarray(self.param_file.read(sl))

    def bucket_params(self, b: int) -> np.ndarray:
        """The whole bucket of stored parameters (stage 3: only while gathered)."""
        bucket = self.layout.buckets[b]
        if self.config.stage < 3:
            return self.params[bucket.start:bucket.stop]
        return self.gathered[b]

    def views(self, layer: int) -> Dict[str, np.ndarray]:
        """Layer's parameters as views of its whole bucket."""
        buf = self.bucket_params(self.layout.layer_bucket[layer])
        out = {}
        for name in self.layout.layer_params[layer]:
            pr = self.layout.params[name]
            out[name] = buf[pr.bucket_offset:pr.bucket_offset + pr.numel].reshape(pr.shape)
        return out

    @property
    def held(self) -> bool:
        """Some layer is unsharded (between unshard and reshard)."""
        return any(self.holds)

    # ---- parameters for compute ---------------------------------------------------
    def unshard(self, layer: int, phase: Phase, micro: int, step: int) -> Dict[str, np.ndarray]:
        """Make layer's parameters whole and hold them; ``phase`` and ``micro`` (micro-batches
        done) say which layers come next, for the prefetch window; ``step`` names the gathers."""
        if self.trace is not None:
            self.trace.pause()               # a held layer's compute stops while the engine runs
        b = self.layout.layer_bucket[layer]
        if self.config.stage == 3:
            window = self._window(layer, phase, micro)
            self.free(keep=window)
            for w in window:                 # this layer's bucket first, then the prefetches
                if self.state[w] is BucketState.SHARDED:
                    self.start(w, step)
        self.inflight.poll()
        if self.state[b] is BucketState.GATHERING:
            self.finish(b)
        self.holds[layer] += 1
        if self.trace is not None:
            self.trace.hold(layer, phase)    # its compute span starts
        return self.views(layer)

    def reshard(self, layer: int) -> None:
        if self.holds[layer] == 0:
            raise UsageError(f"reshard({layer}) without a matching unshard({layer})")
        if self.trace is not None:
            self.trace.release(layer)
        self.holds[layer] -= 1
        self.inflight.poll()
        if self.trace is not None:
            self.trace.resume()              # a layer still held computes again

    def read(self, layer: int) -> Dict[str, np.ndarray]:
        """Layer's stored parameters without holding them (stage 3: only while held)."""
        b = self.layout.layer_bucket[layer]
        if self.config.stage == 3 and (self.holds[layer] == 0 or self.state[b] is not BucketState.UNSHARDED):
            raise UsageError(f"stage 3: layer {layer} ({self.layout.layer_names[layer]!r}) is sharded; "
                             "read its parameters inside engine.unsharded(layer)")
        if self.state[b] is BucketState.GATHERING:      # stages 1/2: the step's all-gather of this bucket
            self.finish(b)
        return self.views(layer)

    # ---- the prefetch window ---------------------------------------------------------
    def _window(self, layer: int, phase: Phase, micro: int) -> List[int]:
        """Stage 3: the buckets to hold gathered while ``layer`` computes (at most 1 + prefetch)."""
        lb = self.layout.layer_bucket
        if not self.config.overlap or self.config.prefetch == 0:
            return [lb[layer]]
        more = micro + 1 < self.config.micro_batches
        upcoming = visits_after(layer, phase, self.layout.num_layers, more)
        return prefetch_window(layer, upcoming, lb, self.config.prefetch)

    def prefetch_forward(self, step: int) -> None:
        """Stage 3: start gathering what the next forward's first layer will hold (1 + prefetch buckets)."""
        if self.config.prefetch == 0:
            return
        first = prefetch_window(None, iter(range(self.layout.num_layers)), self.layout.layer_bucket,
                                1 + self.config.prefetch)
        self.free(keep=first)
        for b in first:
            if self.state[b] is BucketState.SHARDED:
                self.start(b, step)

    # ---- gathers ----------------------------------------------------------------------
    def start(self, b: int, step: int) -> None:
        """All-gather bucket b in place: stage 3 into a fresh bucket buffer, stages 1/2 in the
        stored parameters (their publish after the step)."""
        bucket = self.layout.buckets[b]
        gather = self.wire.iall_gather
        if self.config.stage == 3:
            buf = self.pool.take(bucket.numel)
            if self.secondary is not None and self.fresh[b]:     # hpZ: inside the node, from the copies
                lo, hi = self.comm.super_slice(bucket.numel)
                buf[lo:hi] = self.secondary[b]
                gather = self.comm.iall_gather_intra
            else:
                lo, hi = bucket.slice_bounds(self.slot)
                if self.param_file is not None:
                    self.param_file.at_step(step)
                self._read_shard(b, buf[lo:hi])
                if self.secondary is not None:
                    self._keep.add(b)
            self.gathered[b] = buf
            self.peak_gathered_buckets = max(self.peak_gathered_buckets, len(self.gathered))
        else:
            buf = self.params[bucket.start:bucket.stop]
        self.state[b] = BucketState.GATHERING
        self.log.add(b)
        self.handles[b] = self.inflight.launch(lambda: gather(buf, (b, step)), lambda: self.finish(b))
        if not self.config.overlap:
            self.finish(b)

    def finish(self, b: int) -> None:
        self.inflight.finish(self.handles.pop(b))
        self.state[b] = BucketState.UNSHARDED
        if b in self._keep:                      # hpZ: keep this rank's super-slice for the next gathers
            self._keep.discard(b)
            lo, hi = self.comm.super_slice(self.layout.buckets[b].numel)
            self.secondary[b][...] = self.gathered[b][lo:hi]
            self.fresh[b] = True

    def parameters_changed(self) -> None:
        """The step (or a load) rewrote the parameters: hpZ's secondary copies are stale."""
        self.fresh = [False] * len(self.layout.buckets)

    def finish_all(self) -> None:
        for b in list(self.handles):
            self.finish(b)

    def free(self, keep=()) -> None:
        """Stage 3: drop gathered buckets outside ``keep`` that no held layer reads.

        A gather still in flight is completed first (MPI writes its buffer until then).
        """
        for b in list(self.gathered):
            if b in keep or any(self.holds[i] for i in self.layout.buckets[b].layers):
                continue
            if self.state[b] is BucketState.GATHERING:
                self.finish(b)
            self.pool.give(self.gathered.pop(b))
            self.state[b] = BucketState.SHARDED

    def close(self) -> None:
        self.finish_all()
        self.gathered.clear()
        self.params = self.secondary = None
        if self.param_file is not None:
            self.param_file.close()
