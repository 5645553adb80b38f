"""The engine: ZeroEngine and the parts it is composed of.

zero_engine (ZeroEngine, composed of the parts below), step (the optimizer step in two
halves, StepResult), reducer (GradientReducer: gradient buffers, bucketed reduce-scatters),
gatherer (ParameterGatherer: stored parameters, unshard / reshard, all-gathers, prefetch),
optimizer (ShardedAdamW: the fp32 master and Adam moments), decay (its weight-decay
groups), lazy (parameters given as rules, made a slice at a time), initial (the initial values
into the master, and the check of what the ranks made of lazy ones), offload (optimizer rows in host memory or files), inflight (the collectives in
flight), buffers (the bucket buffer pool), config (ZeroConfig), loss_scale, memory (the
ledger and the formulas), timers, phase (the phase of one step and its visit order),
faults (non-finite gradients, injected faults).

May import: zerompi.errors, zerompi.layout, zerompi.optim, zerompi.comm, zerompi.checkpoint.
Importing this package imports nothing; config, buffers, memory and reducer load without MPI
(the estimate uses them).
"""
