"""The training job: ``mpiexec -n N python -m zerompi.train``.

Modules:
- run: the driver, main: one job (SingleJob or PipelineJob) through the step loop, checkpoints, report
- job: Job, what both jobs share; SingleJob, the unpipelined job: the whole model in one chunk, one ZeroEngine
- pipeline: PipelineJob, --pp: its checks, the chunks and their engines, the step
- loop: the layer-by-layer training step of the built-in models, on the public engine API
- parallel: --tp and --sp, the Mesh, the models split over it, the groups metered
- tp_run: --tp, the job's checks, the TP bytes formula and the TP row
- sp_run: --sp, the job's checks, the SP bytes formula and the SP row
- moe/: the mixture of experts (--experts, --ep): the MoE MLP and block, expert parallelism, its settings, its
  checkpoints and row
- muon_run: --optimizer muon, the metrics' muon section: matrices, Newton-Schulz time, the owners' exchange bytes
- simulated_run: --simulate-world, the job as one rank of a bigger one: checks, banner, metrics
- config: TrainConfig and the flags
- preflight: the checks at start, before the first step
- saves: the save directory claimed at start, and the saves of the step loop
- replicas: --replicas, every step's state in memory on two nodes; the records of a recovery
- history: the step loop's record, in bounded memory
- report: banner, tables, final metrics
- console: the progress bar or one line per logged step
- data: the generated Markov corpus and byte-level files
- tokens: --data-format tokens, a flat file of token ids, checked at start, each rank reading its rows
- tensorboard: --tensorboard, the run's scalars for TensorBoard, written by rank 0 through tensorboardX
- hf_init: --init-from, the GPT's initial parameters from a Hugging Face GPT-2 folder, each rank its own
- model_kernels: the GPT's fused elementwise kernels (C)
- models/: the GPT and the MLP, forward and backward by hand

May import: every other zerompi subpackage except bench.
"""
