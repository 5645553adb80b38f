"""Collectives: how ranks talk.

communicator (Communicator: the deterministic reduce-scatter, all-gather, all-reduce over
mpi4py, with per-operation counters), blocks (how slices travel: the block arithmetic, the
argument checks, the receive rows, the counters), staging (device buffers through pinned host memory),
nccl (the same interface over NCCL), device (GPU placement, CUDA-awareness), progress (a
thread that moves collectives on), watchdog (a wait that never ends ends the job), launcher
(a rank whose launcher is gone ends by itself),
consistency (the start-up check that every rank runs the same configuration), signature and
checked (every collective checks that the ranks passed the same operation, length and dtype),
quantized (ZeRO++'s wire format: int8/int4 blocks with a scale each, and the rules of its
settings), mesh (the tensor-, sequence- and data-parallel groups; the TP all-reduce), alltoall
(the Ulysses all-to-all of sequence parallelism), group (what a model-parallel group's
collectives share), subcomm (sub-communicators whose colors are a function of the rank),
simulated_world (one process as rank R of N, the other ranks stood in for).

May import: zerompi.errors, zerompi.optim (the local sum). Importing this package imports
nothing; watchdog, launcher, consistency, signature, device and quantized load without MPI (the estimate
uses quantized).
"""
