"""What the emulated cluster's links give an MPI job: run under mpiexec across the nodes, in blocks.

    mpiexec ... python scripts/cluster_rates.py RANKS_PER_NODE [MIB]

Rank 0 prints one JSON line: ``inter_gbps`` (Gbit/s through one node's link in one direction,
with every local rank of node 2j exchanging MIB MiB with its peer on node 2j+1 at once, as the
collectives do), ``intra_gbps`` (ranks 0 and 1 of node 0 exchanging the same, when a node holds
two), ``latency_us`` (half the round trip of 8 bytes between each rank of node 2j and its peer
on node 2j+1, all at once), medians of three (rank 0's two hundred round trips for the latency).
scripts/bench_cluster.py feeds them to the estimator.
"""
import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
per_node = int(sys.argv[1])
nbytes = int(float(sys.argv[2]) * 2 ** 20) if len(sys.argv) > 2 else 8 * 2 ** 20
node, local = divmod(rank, per_node)
nodes = size // per_node
send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)


def exchange(peer, reps=3):
    """Median seconds of a Sendrecv of nbytes with ``peer`` (None: this rank only waits)."""
    times = []
    for _ in range(reps):
        comm.Barrier()
        t = time.perf_counter()
        if peer is not None:
            comm.Sendrecv(send, peer, 0, recv, peer, 0)
        comm.Barrier()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


paired = node < nodes - nodes % 2
across = exchange(rank + per_node if node % 2 == 0 else rank - per_node) if paired else exchange(None)
inside = exchange(rank ^ 1 if node == 0 and local < 2 else None) if per_node > 1 else None
rtts = []                 # every rank of node 2j with its peer on node 2j+1 at once, as in a collective
comm.Barrier()
for _ in range(200):
    if paired and node % 2 == 0:
        t = time.perf_counter()
        comm.Send(send[:8], rank + per_node, 1)
        comm.Recv(recv[:8], rank + per_node, 1)
        rtts.append(time.perf_counter() - t)
    elif paired:
        comm.Recv(recv[:8], rank - per_node, 1)
        comm.Send(send[:8], rank - per_node, 1)
if rank == 0:
    print(json.dumps({"inter_gbps": per_node * nbytes * 8 / across / 1e9,
                      "intra_gbps": nbytes * 8 / inside / 1e9 if inside else None,
                      "latency_us": statistics.median(rtts) / 2 * 1e6, "mib": nbytes / 2 ** 20}), flush=True)
