"""The collectives microbenchmark: ``mpiexec -n N python -m zerompi.bench``.

config (the options: BenchConfig and the command line), run (the measurements, the tables,
main), cases (what one measured case does, its oracle, the timing loops), levels
(--node-size: the two-level rows and the bytes of one call inside and across nodes).

May import: zerompi.errors, zerompi.optim, zerompi.comm, zerompi.checkpoint (outputs: the
--json file), zerompi.estimate (machine: the memory a rank may take).
"""
