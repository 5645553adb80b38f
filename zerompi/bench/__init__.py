"""The collectives microbenchmark: ``mpiexec -n N python -m zerompi.bench``.

config (the options: BenchConfig and the command line), run (the measurements, main),
table (what it prints), cases (what one measured case does, its oracle, the timing loops),
quantized (the zerompi-q8/q4 rows and their error), levels (--node-size: the two-level rows
and the bytes of one call inside and across nodes), tp_allreduce (--tp: the all-reduce over tensor-parallel
groups of a Mesh), plot (--plot: busbw against size; matplotlib).

May import: zerompi.errors, zerompi.optim, zerompi.comm, zerompi.checkpoint (outputs: the
--json file), zerompi.estimate (machine: the memory a rank may take).
"""
