"""Pipeline parallelism: schedules as data, and the executor that runs one.

actions (Action, Schedule: a list of actions per rank; the schedule file format), schedules
(the functions that make GPipe, 1F1B, interleaved 1F1B and ZB-H1), validate (the checks a
schedule passes before it runs: each forward before its backward, messages matched in order,
no cycle of waits), timeline (a schedule on per-action costs: the bubble and the activations
held), executor (one rank's actions run through a ZeroEngine per model chunk, with
non-blocking point-to-point messages between stages: MPI), stage (the step over the whole
mesh: the global norm and overflow, the tied weights between the first and last stage).

May import: zerompi.errors, zerompi.comm, zerompi.engine. actions, schedules, validate and
timeline import no MPI (the estimate uses them, and they are tested offline).
"""
