"""The training job: ``mpiexec -n N python -m zerompi.train``.

run (the job: model, engine, step loop, checkpoints, main), config (TrainConfig and the
flags), loop (micro-batches through the engine), report (banner, tables, final metrics),
data (the generated Markov corpus and byte-level files), models (the GPT and the MLP,
forward and backward by hand), simulated_run (the job as one rank of a bigger one: --simulate-world).

May import: every other zerompi subpackage except bench.
"""
