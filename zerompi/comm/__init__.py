"""Collectives: how ranks talk.

communicator (Communicator: the deterministic reduce-scatter, all-gather, all-reduce over
mpi4py, with per-operation counters), staging (device buffers through pinned host memory),
nccl (the same interface over NCCL), device (GPU placement, CUDA-awareness), progress (a
thread that moves collectives on), watchdog (a wait that never ends ends the job),
consistency (the start-up check that every rank runs the same configuration), quantized
(ZeRO++'s wire format: int8/int4 blocks with a scale each, and the rules of its settings),
split (sub-communicators whose colors are a function of the rank), simulated (one process as
rank R of N, the other ranks stood in for).

May import: zerompi.errors, zerompi.optim (the local sum). Importing this package imports
nothing; watchdog, consistency, device and quantized load without MPI (the estimate
uses quantized).
"""
