"""Weight-decay groups: which of the optimizer's rows are exempt from weight decay.

``ZeroConfig.no_decay`` names the exempt parameters by shell-style patterns on their names
(``fnmatch``: ``"*.bias"``, ``"ln_f.*"``, ``"wte"``). A rank's rows are the master's
coordinates (its shard of every bucket; stage 0: the whole model), so an exempt parameter
is one or more ranges of rows, merged here into sorted runs. The update then runs AdamW
on each run of the slice it is given, with the configured decay or none: every operation
is elementwise, so cutting a slice changes no bits, and a parameter decays or not whatever
the stage, the world size or where its rows lie, which keeps stages bit-identical and
checkpoints resharding (the groups come from names, never from row positions).
"""
from fnmatch import fnmatchcase
from typing import Iterator, List, Sequence, Tuple

from ..errors import AgreedConfigError


def exempt_names(layout, patterns: Sequence[str]) -> List[str]:
    """The parameters (by name, in layout order) some pattern matches; ConfigError for a pattern
    that matches none (a misspelt name would otherwise decay silently): every rank raises it alike,
    after the ranks agreed on the config and the layout, so the CLI prints it once."""
    names = list(layout.params)
    for pat in patterns:
        if not any(fnmatchcase(n, pat) for n in names):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise AgreedConfigError(f"no_decay pattern {pat!r} (--no-decay) matches no parameter "
                                    f"(the parameters are {shown})")
    return [n for n in names if any(fnmatchcase(n, pat) for pat in patterns)]


def exempt_runs(layout, patterns: Sequence[str], stage: int, slot: int) -> List[Tuple[int, int]]:
    """Sorted, merged ``[start, stop)`` row ranges of this rank's master that take no decay."""
    runs = []
    for name in exempt_names(layout, patterns):
        pr = layout.params[name]
        if stage == 0:
            runs.append((pr.start, pr.stop))
            continue
        b = layout.buckets[pr.bucket]
        lo, hi = b.slice_bounds(slot)
        a, z = max(lo, pr.bucket_offset), min(hi, pr.bucket_offset + pr.numel)
        if a < z:
            runs.append((b.shard_start + a - lo, b.shard_start + z - lo))
    merged = []
    for a, z in sorted(runs):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], z))
        else:
            merged.append((a, z))
    return merged


def pieces(runs: List[Tuple[int, int]], start: int, stop: int) -> Iterator[Tuple[int, int, bool]]:
    """``(lo, hi, decays)`` covering rows ``[start, stop)`` in order, relative to ``start``."""
    at = start
    for a, z in runs:
        if z <= at:
            continue
        if a >= stop:
            break
        if a > at:
            yield at - start, a - start, True
        hi = min(z, stop)
        yield max(a, at) - start, hi - start, False
        at = hi
    if at < stop:
        yield at - start, stop - start, True
