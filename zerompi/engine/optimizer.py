"""The sharded optimizer state: the fp32 master and the AdamW moments of this rank's shard.

Stage 0 keeps them for the whole model, stages 1-3 for this rank's slice of every bucket
(the shard, in bucket order). :class:`ShardedAdamW` holds the master (engine/initial.py fills it
from the initial values), updates one bucket's slice at a time, and gathers the whole master for a
caller that asks for the parameters by name.

The rows live where engine/offload/ keeps them: on the device (the update runs there, through
``optim.impl``: the fused kernel or the NumPy reference, same bits), in host memory
(``offload_optimizer="cpu"``) or in a file (``"nvme"``). Offloaded, the update runs on the
host with the C kernel (the same bits as the CUDA one): a bucket's reduced gradient is
copied down, the rows updated, and the new stored-dtype parameters copied up; with a file,
the rows stream through host buffers, the next bucket's read overlapping this one's update.
On the CPU device ``"cpu"`` is the normal path: the rows are host memory already, no copies.
"""
import os
from typing import Optional

import numpy as np

from ..optim import dtypes, impl
from ..optim.reference import AdamWScalars, adamw_scalars
from .decay import exempt_runs, pieces
from .offload import ArrayRows, FileRows, check_dir
from .offload.owner import HEADER_BYTES
from .offload.stream import file_bytes

F32 = np.float32


class ShardedAdamW:
    """The rows (``rows``: offload.ArrayRows or FileRows) of the shard (stage 0: the whole model),
    counted under "optimizer" in the ledger, on their place.

    The optimizer interface the engine's step calls (engine/step.py): ``name`` and ``state`` (the rows
    beside the master, which checkpoints save and load by name), ``scalars``, ``step`` over the
    buckets' slices, ``update`` (one slice; stage 0: the whole model). engine/muon.py is another."""

    name = "adamw"
    state = ("exp_avg", "exp_avg_sq")

    @property
    def row_names(self):
        """Every row of the optimizer, the master first (a checkpoint's shard file, in this order)."""
        return ("master",) + self.state

    def __init__(self, layout, config, ledger, slot: int, rank: int, transfers=None):
        self.layout, self.config, self.slot = layout, config, slot     # the slice of every bucket this rank holds
        self.transfers = transfers       # device <-> host copies (a GPU, or its stand-in); None: the host
        self.n = n = layout.numel if config.stage == 0 else layout.shard_numel
        self.ledger = ledger
        self.no_decay = exempt_runs(layout, config.no_decay, config.stage, slot)   # rows with no weight decay
        mode = config.offload_optimizer
        if mode == "nvme":     # two generations of the rows when the folder has room (offload/stream.py)
            slices = [b.shard_slice for b in layout.buckets]
            free = check_dir(config.offload_dir, HEADER_BYTES + file_bytes(slices, 1))
            generations = 2 if free >= HEADER_BYTES + file_bytes(slices, 2) else 1
            self.rows = FileRows(config.offload_dir, f"zerompi-optimizer-rank{rank}-pid{os.getpid()}.bin", slices,
                                 lambda k: ledger.alloc("buffers", k, F32, place="host"), rank, generations,
                                 config.offload_io == "direct")
            ledger.count("optimizer", 12 * n, "disk")
            ledger.count("buffers", 12 * n * (generations - 1), "disk")     # the spare generation
        else:
            place = "host" if mode == "cpu" else "device"
            self.rows = ArrayRows(lambda k: ledger.alloc("optimizer", k, F32, place=place), n, place,
                                  self.row_names)
        self.offloaded = mode != "none"
        self._host = {}                  # staging buffers for offloaded updates on a device (grad, param out)
        self.delayed = config.offload_delayed_update
        self._background = None          # delayed update: the update in flight (a future)
        self.trace = None                # the timeline's Tracer (engine/trace.py), or None
        self.unpublished = False         # ... and the master it wrote is not yet in the stored parameters
        if self.delayed:
            from concurrent.futures import ThreadPoolExecutor
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerompi-delayed-update")
            self._grads = ledger.alloc("buffers", n, dtypes.storage_dtype(config.dtype),
                                       place="host")

    # ---- the master, wherever it is ---------------------------------------------------
    @property
    def master(self):
        """The whole master row as an array (a host copy when it lives in a file), after a delayed
        update in flight has written it."""
        self.wait()
        return self.rows.read("master")

    def master_slice(self, sl: slice):
        """Part of the master (device or host, as it lives; a host copy from a file), after a delayed
        update in flight has written it."""
        self.wait()
        return self.rows.read("master", sl)

    def read_row(self, name: str) -> np.ndarray:
        """A whole row as a host array (checkpoints)."""
        return _to_numpy(self.rows.read(name))

    def write_row(self, name: str, host: np.ndarray, xp) -> None:
        """Overwrite a whole row from a host array (checkpoints)."""
        self.rows.write(name, slice(None), xp.asarray(host) if self.rows.place == "device" else host)

    def scalars(self, lr: Optional[float], step: int, grad_scale: float) -> AdamWScalars:
        """The constants of update number ``step``; ``lr`` None: the config's."""
        c = self.config
        self.rows.at_step(step)
        return adamw_scalars(c.lr if lr is None else lr, c.beta1, c.beta2, c.eps, c.weight_decay, step, grad_scale)

    # ---- the update ----------------------------------------------------------------------
    def step(self, parts, s: AdamWScalars, after=None) -> None:
        """AdamW on every ``(rows slice, reduced grad, stored-param out)`` of ``parts``, in order;
        ``after(i)`` runs after part i (the engine publishes that bucket and moves MPI on). With a
        file, the rows of the last parts are still being written when it returns (offload/stream.py)."""
        parts = list(parts)
        self.rows.plan([sl for sl, _, _ in parts])
        for i, (sl, grad, param_out) in enumerate(parts):
            self.update(sl, grad, param_out, s)
            self.rows.commit([sl])
            if after is not None:
                after(i)

    # ---- the delayed update (offload_delayed_update) ------------------------------------------
    def launch(self, parts, s: AdamWScalars) -> None:
        """Start AdamW on every ``(rows slice, reduced grad, _)`` of ``parts`` in the background, from a
        host copy of the gradients (the next backward rewrites them); the stored parameters are
        written later, from the master, by the engine's publish after :meth:`wait`."""
        self.wait()
        jobs = []
        for sl, grad, _ in parts:
            host = self._grads[sl]
            if self.transfers is None:
                host[...] = grad
            else:
                self.transfers.to_host(grad, host)
            jobs.append((sl, host))
        if self.transfers is not None:
            self.transfers.synchronize()

        trace = self.trace

        def run():
            for sl, g in jobs:
                t0 = trace.clock() if trace is not None else 0.0
                master, m, v = self.rows.fetch(sl)
                self._adamw(impl.host_adamw_update, sl, master, m, v, g, np.empty(g.size, g.dtype), s)
                if trace is not None:
                    trace.background(sl, t0)
        self._background = self._executor.submit(run)
        self.unpublished = True

    def wait(self) -> bool:
        """Wait for the update in flight; True when there was one (the master changed)."""
        if self._background is None:
            return False
        self._background.result()
        self._background = None
        return True

    def update(self, sl, grad, param_out, s: AdamWScalars, background: bool = False) -> None:
        """AdamW on the rows ``[sl]`` from the reduced ``grad``; writes the new stored-dtype
        parameters into ``param_out`` (an array, or a callable given the host result) and puts the
        rows back (not yet committed: see offload/stream.py). ``background``: in a thread of its own
        (engine/in_backward.py), traced as such."""
        t0 = self.trace.clock() if self.trace is not None else 0.0
        if self.trace is not None and not background:
            self.trace.optimizer(sl)     # a span of the compute track, to the end of this update
        master, m, v = self.rows.fetch(sl)
        if not self.offloaded:          # the parameter shard in a file (offload_params alone): a buffer first
            out = impl.array_module(grad).empty_like(grad) if callable(param_out) else param_out
            self._adamw(impl.adamw_update, sl, master, m, v, grad, out, s)
            if out is not param_out:
                param_out(impl.to_host(out))
        else:
            g = grad if self.transfers is None else self._down(grad, "grad")
            out = param_out if self.transfers is None and not callable(param_out) else self._buffer("param", grad)
            self._adamw(impl.host_adamw_update, sl, master, m, v, g, out, s)
            if callable(param_out):
                param_out(out)
            elif out is not param_out:
                self.transfers.to_device(out, param_out)
                self.transfers.synchronize()
        self.rows.put(sl)
        if self.trace is not None:
            self.trace.background(sl, t0) if background else self.trace.pop()

    def _adamw(self, fn, sl, master, m, v, grad, param_out, s: AdamWScalars) -> None:
        """``fn`` (an AdamW implementation) on rows ``[sl]``, each run of the weight-decay groups
        (engine/decay.py) with its decay: elementwise, so the cuts change no bits."""
        start, stop, _ = sl.indices(self.n)
        if not self.no_decay or s.weight_decay == 0:
            return fn(master, m, v, grad, param_out, s)
        plain = s._replace(weight_decay=F32(0.0))
        for lo, hi, decays in pieces(self.no_decay, start, stop):
            fn(master[lo:hi], m[lo:hi], v[lo:hi], grad[lo:hi], param_out[lo:hi], s if decays else plain)

    def _buffer(self, key: str, like) -> np.ndarray:
        buf = self._host.get((key, like.dtype.str))
        if buf is None or buf.size < like.size:
            alloc = self.transfers.pinned if self.transfers is not None else (lambda k, dt: np.empty(k, dt))
            buf = self._host[(key, like.dtype.str)] = alloc(int(like.size), like.dtype)
        return buf[:like.size]

    def _down(self, dev, key: str) -> np.ndarray:
        host = self._buffer(key, dev)
        self.transfers.to_host(dev, host)
        self.transfers.synchronize()
        return host

    # ---- the whole master ------------------------------------------------------------------
    def gather(self, group, step: int) -> np.ndarray:
        """The whole padded fp32 master in world layout, as a NumPy array on every rank: an
        all-gather over the shard ``group`` (a collective), each rank's slice put at its slot."""
        out = np.zeros(self.layout.numel, F32)
        for bucket, values in self.gather_buckets(group, step):
            out[bucket.start:bucket.stop] = values
        return out

    def gather_buckets(self, group, step: int):
        """(bucket, its whole fp32 master as a NumPy array) for every bucket in order, one at a time
        (a collective per bucket): the whole model is never held at once. A delayed update in flight
        is waited for first (it writes the master)."""
        self.wait()
        stage0 = self.config.stage == 0
        for bucket in self.layout.buckets:
            if stage0:
                yield bucket, _to_numpy(self.rows.read("master", slice(bucket.start, bucket.stop)))
                continue
            k = bucket.slice_numel
            mine = np.ascontiguousarray(_to_numpy(self.rows.read("master", bucket.shard_slice)))
            table = np.empty((len(group.slots), k), F32)
            with group.waiting("gather_master (fp32 all-gather)", (bucket.index, step)):
                group.mpi.Allgather(mine, table)   # timed by the watchdog
            values = np.empty(bucket.numel, F32)
            for g, s in enumerate(group.slots):
                values[s * k:(s + 1) * k] = table[g]
            yield bucket, values

    def plan_next(self, slices, step: int) -> None:
        """The order of step ``step``'s update (rows read ahead from a file now, behind the forward)."""
        self.rows.at_step(step)
        self.rows.plan(list(slices))

    def close(self) -> None:
        self.wait()
        if self.delayed:
            self._executor.shutdown()
        self.rows.close()


def _to_numpy(arr) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") else np.asarray(arr)
