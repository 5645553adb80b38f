"""Collectives: how ranks talk.

Modules:
- communicator: Communicator, the deterministic reduce-scatter, all-gather, all-reduce over mpi4py,
  with per-operation counters
- blocks: how slices travel, the block arithmetic, the argument checks, the receive rows, the counters
- staging: device buffers through pinned host memory
- nccl: the same interface over NCCL
- device: GPU placement, CUDA-awareness
- progress: a thread that moves collectives on
- watchdog: a wait that never ends ends the job
- launcher: a rank whose launcher is gone ends by itself
- flight: what every rank was doing when a collective timed out
- consistency: the start-up check that every rank runs the same configuration
- signature: every collective checks that the ranks passed the same operation, length and dtype
- checked: one checked collective's messages, and the comparison of the ranks' signatures
- quantized: ZeRO++'s wire format, int8/int4 blocks with a scale each, and the rules of its settings
- topology: nodes, shard groups, and the communicators of each level
- hierarchical: two-level collectives for a shard group that spans nodes
- subcomm: sub-communicators whose colors are a function of the rank
- mesh: the tensor-, sequence- and data-parallel groups and pipeline stages; the TP all-reduce
- meshconfig: MeshConfig, the mesh's sizes (tp, sp, pp, node size, shard size) apart from the engine's config
- group: what a model-parallel group's collectives share
- alltoall: the Ulysses all-to-all of sequence parallelism
- ep_alltoall: the expert-parallel all-to-all(v) of token rows: counts, then rows
- sources_reduce: a reduce-scatter of several sources' partials per rank, summed in the world's rank order
- p2p: the pipeline's point-to-point messages between stages
- tp_pieces: how a tensor-parallel parameter is cut into pieces and put back (NumPy)
- simulated_world: SimulatedWorld, one process as rank R of N, the other ranks stood in for
- simulated: deprecated, the old name of simulated_world (goes in the next release)

May import: zerompi.errors, zerompi.optim (the local sum). Importing this package imports
nothing; watchdog, launcher, consistency, signature, device and quantized load without MPI (the estimate
uses quantized).
"""
