"""``python -m zerompi.estimate``: memory and communication per rank, before you launch.

    python -m zerompi.estimate --params 10e9 --ranks 64

prints, for ZeRO stages 0-3, the bytes one rank holds: model states (parameters,
gradients, fp32 master + Adam m and v, by ``memory.theory_bytes``), then the buffers this
engine allocates on top of them (gradient buckets, stage-3 gathered layers, spare bucket
buffers, the micro-batch accumulator, the reduce-scatter receive scratch), and the bytes and
time of one step's communication (``memory.theory_comm_bytes``, alpha-beta time model).

In Python, ``zerompi.estimate(params=10e9, ranks=64)`` returns the same table as a dict
(the module is callable: it calls :func:`estimate`).

This module's one concern is being that entry point, the command and the callable, under
the name users know. The work is done in three modules, and every public name of theirs
is re-exported here:

- ``bucket_plan``: the engine's bucket layout for a model described by ``--layers`` or
  ``--largest-layer`` (FlatLayout's rule, run-length encoded): :class:`BucketPlan`,
  :func:`plan_buckets`, :func:`bucket_numel`;
- ``estimate_stages``: the bytes and communication of each stage: :func:`estimate`,
  :func:`formula`, ``buffer_counts``, ``DEFAULT_PREFETCH``, ``BUFFER_ROWS``;
- ``estimate_cli``: options, table and ``--from-run``: :func:`main`, :func:`build_parser`,
  :func:`parse_count`, :func:`format_table`, :func:`run_estimate`, :func:`compare_run`,
  :func:`format_compare`, ``UNITS``.
"""
import sys
import types

from .bucket_plan import BucketPlan, bucket_numel, plan_buckets
from .estimate_cli import (UNITS, build_parser, compare_run, format_compare, format_table, main, parse_count,
                           run_estimate)
from .estimate_stages import BUFFER_ROWS, DEFAULT_PREFETCH, buffer_counts, estimate, formula

__all__ = ["BucketPlan", "plan_buckets", "bucket_numel",
           "estimate", "formula", "buffer_counts", "DEFAULT_PREFETCH", "BUFFER_ROWS",
           "main", "build_parser", "parse_count", "format_table", "run_estimate", "compare_run", "format_compare",
           "UNITS"]


class _CallableModule(types.ModuleType):
    """``zerompi.estimate`` is this module and the function at once: calling it calls estimate()."""

    def __call__(self, *args, **kwargs):
        return estimate(*args, **kwargs)


# Neither the package nor the three modules above import this one, so `python -m zerompi.estimate`
# runs it once, as __main__, without runpy finding it imported already.
sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
