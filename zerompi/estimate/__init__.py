"""The estimate: memory and communication per rank for ZeRO stages 0-3, before you launch.

    python -m zerompi.estimate --params 10e9 --ranks 64

prints, for ZeRO stages 0-3, the bytes one rank holds: model states (parameters,
gradients, fp32 master + Adam m and v, by ``engine.memory.theory_bytes``), then the buffers
the engine allocates on top of them (gradient buckets, stage-3 gathered layers, spare
bucket buffers, the micro-batch accumulator, the reduce-scatter receive scratch), and the
bytes and time of one step's communication (alpha-beta time model).

Modules:
- plan: the engine's bucket layout for a model described by its size (BucketPlan)
- stages: the arithmetic, ``estimate``, ``formula``
- levels: nodes and shard groups, the topology's checks, bytes and time inside and across nodes
- activations: the GPT's activation bytes, with and without checkpointing
- tp_bytes: --tp, the GPT's parameters per TP rank and its TP all-reduce bytes
- sp_bytes: --sp, the GPT's activations per rank and its all-to-all bytes
- pipeline: --pp, a pipeline schedule's bubble and activations
- moe_bytes: --experts/--ep, the GPT's dense and expert parameters and model states, the EP all-to-all's bytes
- replica_bytes: --replicas, the host shared memory of a rank's in-memory shard replicas
- machine: the memory a job's ranks can still take
- cli: the options, --from-run
- table: the table the command line prints
- fromrun: ``--from-run``, a run's measured bytes beside its estimate
- configs: ``zero=`` a ZeroConfig, ``mesh=`` a MeshConfig: a run's configs in place of the keywords

In Python, ``zerompi.estimate(params=10e9, ranks=64)`` returns the same table as a dict:
this package is callable (it calls :func:`zerompi.estimate.stages.estimate`).

May import: zerompi.errors, the MPI-free parts of zerompi.engine (config, layout, buffers,
memory, reducer, traffic), zerompi.comm.quantized (the wire format of quantized
communication), zerompi.comm.meshconfig (MeshConfig) and the MPI-free parts of zerompi.pipeline
(actions, schedules, validate, timeline). Runs where mpi4py cannot be imported.
"""
import sys
import types

from .stages import estimate


class _CallableModule(types.ModuleType):
    """``zerompi.estimate`` is this package and the function at once: calling it calls estimate()."""

    def __call__(self, *args, **kwargs):
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
