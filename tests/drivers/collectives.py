"""The public collectives used on their own, as someone's code would (tests/test_collective_checks.py):
CASE. A rank that fails outside any engine must not leave the others waiting; ranks that pass
different buffers must all stop with one MismatchError naming the ranks and values."""
import sys
import time

import numpy as np
from mpi4py import MPI

import zerompi

case = sys.argv[1]
rank = MPI.COMM_WORLD.Get_rank()
x = np.ones(8, np.float32)

if case == "bare_raise":            # a bare Communicator: rank 1 raises between two all-reduces
    comm = zerompi.Communicator()
    comm.all_reduce(x)
    if rank == 1:
        raise RuntimeError("collectives: rank 1 raises outside any engine")
    comm.all_reduce(x)
elif case == "rs_length":          # the case: reduce-scatter of 8 elements on rank 0, 16 on rank 1
    comm = zerompi.Communicator()
    send = np.ones(8 * (1 + rank), np.float32)
    comm.reduce_scatter(send, np.empty(send.size // comm.size, np.float32))
elif case == "ar_dtype":           # fp32 on rank 0, fp16 on rank 1
    comm = zerompi.Communicator()
    comm.all_reduce(np.ones(8, np.float16 if rank == 1 else np.float32))
elif case == "op":                 # rank 0 all-gathers, rank 1 starts a reduce-scatter of the same buffer
    comm = zerompi.Communicator()
    h = comm.iall_gather(x) if rank == 0 else comm.ireduce_scatter(x, np.empty(4, np.float32))
    h.wait()
elif case == "scalars":            # sum_scalars of 2 numbers on rank 0, 3 on rank 1
    zerompi.Communicator().sum_scalars([1.0] * (2 + rank))
elif case == "quant":              # qgZ with int8 on rank 0, int4 on rank 1
    from zerompi.comm.quantized import quantization
    comm = zerompi.Communicator()
    comm.reduce_scatter(np.ones(128, np.float32), np.empty(64, np.float32), quant=quantization(
        "int4" if rank == 1 else "int8", 64))
elif case == "tp_length":          # the case: Mesh.tp_comm.all_reduce of 8 and 16 elements
    mesh = zerompi.Mesh(tp=2)
    mesh.tp_comm.all_reduce(np.ones(8 * (1 + rank), np.float32))
elif case == "two_level":          # 4 ranks in two nodes of 2: the group's reduce-scatter, 32 elements on rank 3
    from zerompi.comm.topology import Topology, build
    group = build(zerompi.Communicator(), Topology(4, 2, 4)).group
    send = np.ones(32 if rank == 3 else 16, np.float32)
    group.reduce_scatter(send, np.empty(send.size // 4, np.float32))
elif case == "planned":            # the same collectives again and again: each made once (a Plan), started again
    from zerompi.comm.checked import Plan
    from zerompi.comm.signature import signature
    comm = zerompi.Communicator()
    n = comm.size
    send, out, buf = np.empty(8 * n, np.float32), np.empty(8, np.float32), np.empty(8 * n, np.float32)
    for step in range(4):           # a new label every step (the engine's (bucket, step)), new values
        send[:] = np.arange(8 * n) * (rank + 1) + step
        want = sum(np.arange(8 * n, dtype=np.float64) * (r + 1) + step for r in range(n))
        comm.ireduce_scatter(send, out, 0.5, tag=(0, step)).wait()
        assert np.array_equal(out, (0.5 * want[rank * 8:(rank + 1) * 8]).astype(np.float32)), (step, out)
        buf[rank * 8:(rank + 1) * 8] = rank + step
        comm.iall_gather(buf, tag=(1, step)).wait()
        assert np.array_equal(buf, np.repeat(np.arange(n) + step, 8).astype(np.float32)), (step, buf)
    plans = comm.checks.plans
    assert len(plans) == 2 and all(isinstance(p, Plan) for p in plans.values()), plans
    # a plan still in flight is not started again: the second call with its key gets a fresh exchange
    key, sig = ("not", "an address"), signature("all_gather", np.float32, 4)
    into = [np.full(4, -1.0, np.float32) for _ in range(2)]
    def messages(i):
        return ([(r, [np.full(4, rank + 10 * i, np.float32), MPI.FLOAT]) for r in comm.checks.others],
                [(r, [into[i], MPI.FLOAT]) for r in comm.checks.others])
    first = comm.checks.planned(sig, key, lambda: messages(0))
    second = comm.checks.planned(sig, key, lambda: messages(1))
    assert isinstance(first, Plan) and not isinstance(second, Plan), (first, second)
    first.Wait()
    second.Wait()
    peer = 1 - rank
    assert np.array_equal(into[0], np.full(4, peer)) and np.array_equal(into[1], np.full(4, peer + 10.0)), into
    from zerompi.comm import checked
    checked.PLANS = 3               # no more plans kept: the oldest idle one is freed for each new one
    bufs = [np.empty(8 * n, np.float32) for _ in range(3)]
    for step in range(3):
        for i, b in enumerate(bufs):
            b[rank * 8:(rank + 1) * 8] = 100 * i + rank + step
            comm.iall_gather(b, tag=(2 + i, step)).wait()
            assert np.array_equal(b, np.repeat(100 * i + np.arange(n) + step, 8).astype(np.float32)), (i, step, b)
            assert len(comm.checks.plans) == 3, comm.checks.plans
    print(f"collectives: rank {rank} plans {len(comm.checks.plans)}", flush=True)
elif case in ("plan_scale", "plan_step", "plan_length"):   # agreed calls (their plans reused), then one that differs
    comm = zerompi.Communicator()
    send, out, buf, other = (np.ones(8, np.float32), np.empty(4, np.float32), np.ones(8, np.float32),
                             np.ones(16, np.float32))
    for step in range(3):
        comm.ireduce_scatter(send, out, 0.5, tag=(0, step)).wait()
        comm.iall_gather(buf, tag=(1, step)).wait()
    if case == "plan_scale":       # the same buffers (the same plan on both), rank 1 another scale
        comm.ireduce_scatter(send, out, 0.25 if rank == 1 else 0.5, tag=(0, 3)).wait()
    elif case == "plan_step":      # the same buffers, rank 1 a step ahead
        comm.iall_gather(buf, tag=(1, 4 if rank == 1 else 3)).wait()
    else:                          # rank 0 reuses its plan, rank 1 passes a longer buffer (a new plan)
        comm.iall_gather(other if rank == 1 else buf, tag=(1, 3)).wait()
elif case == "mesh_hang":           # a Mesh: rank 1 never joins the TP all-reduce (ZEROMPI_TIMEOUT_S is short)
    mesh = zerompi.Mesh(tp=2)
    mesh.tp_comm.all_reduce(x)
    if rank == 1:
        time.sleep(3600)
    mesh.tp_comm.all_reduce(x)
print(f"collectives: rank {rank} finished {case}", flush=True)
