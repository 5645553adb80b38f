"""The collectives microbenchmark: ``mpiexec -n N python -m zerompi.bench``.

Modules:
- config: the options, BenchConfig and the command line
- run: the measurements, main
- table: what it prints
- cases: what one measured case does, its oracle, the timing loops
- records: one row's record: the padded size, the bus factor, the JSON record
- quantized: the zerompi-q8/q4 rows and their error
- levels: --node-size, the two-level rows and the bytes of one call inside and across nodes
- tp_allreduce: --tp, the all-reduce over the tensor-parallel groups of a Mesh
- sp_alltoall: --sp, the Ulysses all-to-all over the sequence-parallel groups of a Mesh
- ep_alltoallv: --ep, the MoE's all-to-all(v) over expert-parallel groups, balanced and skewed counts
- plot: --plot, busbw against size (matplotlib)

May import: zerompi.errors, zerompi.optim, zerompi.comm, zerompi.checkpoint (outputs: the
--json file), zerompi.estimate (machine: the memory a rank may take).
"""
