"""Pipeline parallelism: schedules as data, and the executor that runs one.

Modules:
- actions: Action, Schedule, a list of actions per rank; the schedule file format
- schedules: the functions that make GPipe, 1F1B, interleaved 1F1B and ZB-H1
- validate: the checks a schedule passes before it runs (each forward before its backward, messages
  matched in order, no cycle of waits)
- timeline: a schedule on per-action costs, when each action runs, the bubble and the activations held
- simulate: deprecated, the old name of timeline (goes in the next release)
- config: PipelineConfig, the schedule, its chunks, where the gradients are reduced
- executor: one rank's actions run through a ZeroEngine per model chunk, with non-blocking
  point-to-point messages between stages (MPI)
- grads: where a chunk's gradients go, to its engine at once or accumulated once per step
- engines: the engines of one rank's chunks, as one: the step over the mesh, checkpoints, closing
- step: the step over the whole mesh, the global norm and overflow
- tied: the weight the first and last chunk share, kept in sync
- digest: the sha256 of the whole model's parameters across stages
- measure: what a pipelined run measures of its schedule, summarized over the mesh
- trace: every rank's schedule as a Chrome trace-event file

May import: zerompi.errors, zerompi.comm, zerompi.engine. actions, schedules, validate and
timeline (and simulate) import no MPI (the estimate uses them, and they are tested offline).
"""
