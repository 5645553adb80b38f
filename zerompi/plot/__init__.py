"""Pictures of a training run: ``python -m zerompi.plot RUN.json [RUN.json ...] [--out PNG]``.

Modules:
- figure: reading --metrics-json files, the figure, main

Runs where MPI is not installed (a laptop with the run's JSON); matplotlib (the ``plot`` extra)
is imported only when a figure is made.

May import: zerompi.errors, zerompi.checkpoint (outputs: writing the image).
"""
