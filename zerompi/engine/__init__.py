"""The engine: ZeroEngine and the parts it is composed of.

Modules:
- zero_engine: ZeroEngine, composed of the parts below
- step: the optimizer step in two halves, StepResult
- reducer: GradientReducer, gradient buffers, bucketed reduce-scatters
- gatherer: ParameterGatherer, stored parameters, unshard / reshard, all-gathers, prefetch
- optimizer: ShardedAdamW, the fp32 master and Adam moments; the optimizer interface
- optimizers: the optimizers by name, their state rows, the one the config names
- muon: ShardedMuon, Muon on the 2-D matrices and AdamW on the rest
- matrix_owners: whole-matrix ownership, a matrix's pieces to its owner and back
- in_backward: the optimizer in the backward, a bucket's update as soon as its gradient shard is final
- decay: the weight-decay groups
- lazy: parameters given as rules, made a slice at a time
- initial: the initial values into the master, and the check of what the ranks made of lazy ones
- offload/: optimizer rows in host memory or files
- inflight: the collectives in flight
- buffers: the bucket buffer pool
- config: ZeroConfig
- contract: what every rank must do alike, and where the engine checks it
- tp_groups: tensor parallelism, ZeRO over the data-parallel group of a Mesh, the norm across TP ranks
- loss_scale: dynamic loss scaling for fp16
- memory: the ledger and the formulas
- traffic: the bytes one rank sends per step by level, the formula
- timers: where one rank's step time goes
- trace: the run's timeline as a Chrome trace-event file
- phase: the phase of one step and its visit order
- faults: non-finite gradients, injected faults

May import: zerompi.errors, zerompi.layout, zerompi.optim, zerompi.comm, zerompi.checkpoint.
Importing this package imports nothing; config, buffers, memory and reducer load without MPI
(the estimate uses them).
"""
