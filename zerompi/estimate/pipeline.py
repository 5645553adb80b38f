"""The pipeline's bubble and activations before launch: ``--pp P --micro-batches m --schedule NAME``.

The schedule is made (or read from ``--schedule-file``) and validated as the train CLI does, then
simulated (zerompi/pipeline/timeline.py) on per-chunk costs F, B, W (``--costs``; default 1, 1, 1:
a full backward costs twice a forward) divided by the chunks per stage, so that every schedule is
timed on the same model. Printed beside the closed forms of the shipped schedules (equal costs):
GPipe and 1F1B (P - 1) / (m + P - 1), interleaved (P - 1) / (v m + P - 1), ZB-H1 with
F = B = W: (P - 1) / (3 m + P - 1).
"""
from typing import Optional, Sequence

from ..errors import check
from ..pipeline import actions, schedules, timeline, validate


def closed_form(name: str, p: int, m: int, v: int, costs: Sequence[float]) -> Optional[float]:
    """The bubble fraction of a shipped schedule by its formula (equal F, B, W costs only), else None."""
    f, b, w = costs
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1" and f == b == w:
        return (p - 1) / (3 * m + p - 1)
    return None


def parse_costs(text: str):
    """'1,1,1' -> (F, B, W) seconds (any unit) of one micro-batch on one stage."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    check(len(values) == 3 and all(v > 0 and v < float("inf") for v in values),
          f"costs={text!r} is not allowed; give three numbers > 0: F,B,W (e.g. 1,1,1)")
    return values


def pipeline_estimate(pp: int, micro_batches: int, schedule: str = "1f1b", chunks: int = 1,
                      schedule_file: Optional[str] = None, costs: Sequence[float] = (1.0, 1.0, 1.0)) -> dict:
    """{schedule, P, m, v, bubble_fraction, formula, peak_activations, ...} of one schedule
    (ConfigError on bad input)."""
    check(isinstance(pp, int) and pp >= 1, f"pp={pp!r} must be a whole number of stages >= 1")
    if schedule_file is not None:
        s = actions.read(schedule_file)
        name = s.name
    else:
        s, name = schedules.make(schedule, pp, micro_batches, chunks), schedule
    validate.check(s, micro_batches=micro_batches, ranks=pp)
    v = s.chunks // s.ranks
    f, b, w = (c / v for c in costs)
    sim = timeline.run(s, timeline.unit_costs(s, f, b, w))
    formula = None if schedule_file is not None else closed_form(schedule, pp, micro_batches, v, costs)
    return {"schedule": name, "pp": pp, "micro_batches": micro_batches, "chunks": v, "costs": list(costs),
            "split_backward": s.split_backward, "bubble_fraction": sim.bubble_fraction, "bubble_formula": formula,
            "bubble_per_rank": sim.bubble, "peak_activations": sim.peak_activations,
            "peak_in_flight": sim.peak_in_flight, "step_length": sim.makespan,
            "ideal_length": micro_batches * (costs[0] + costs[1] + costs[2])}


def stage_estimate(params, ranks, layers, pp: int, dtype: str, opts: dict) -> dict:
    """zerompi.estimate's table of one of ``pp`` equal pipeline stages of a model of ``params`` parameters (``layers``
    equal layers) on ``ranks`` ranks: Ψ/P (layers/P) sharded over the stage's N/P data-parallel ranks."""
    from .stages import estimate
    check(params is not None and ranks is not None, "a stage's memory table needs --params and --ranks; give both")
    check(isinstance(pp, int) and pp >= 1, f"pp={pp!r} must be a whole number of stages >= 1")
    check(ranks % pp == 0, f"pp={pp} does not divide ranks={ranks}; each stage holds ranks/pp of them")
    check(layers is None or layers % pp == 0, f"pp={pp} does not divide layers={layers}; each stage holds an equal "
                                              "run of them")
    est = estimate(params / pp, ranks // pp, dtype, layers=None if layers is None else layers // pp, **opts)
    return dict(est, pipeline_stage={"pp": pp, "params": params / pp, "ranks": ranks // pp,
                                     "layers": None if layers is None else layers // pp})


def format_pipeline(est: dict) -> str:
    f, b, w = est["costs"]
    lines = [f"zerompi.estimate: pipeline schedule {est['schedule']}, P = {est['pp']} stages, m = "
             f"{est['micro_batches']} micro-batches, {est['chunks']} chunk(s) per stage; a stage's micro-batch costs "
             f"F {f:g}, B {b:g}, W {w:g}" + (" (B and W split)" if est["split_backward"] else " (B = full backward)")]
    formula = est["bubble_formula"]
    lines.append(f"  bubble fraction        {est['bubble_fraction']:.4f}" +
                 (f"   (formula {formula:.4f})" if formula is not None else "") +
                 "   per rank " + ", ".join(f"{x:.3f}" for x in est["bubble_per_rank"]))
    per = ", ".join(str(p) for p in est["peak_in_flight"])
    lines.append(f"  peak activations       {est['peak_activations']:g} micro-batches of one stage's "
                 f"(chunk micro-batches held per rank: {per})")
    lines.append(f"  step length            {est['step_length']:g} (without a bubble: {est['ideal_length']:g})")
    st = est.get("stage_table", {}).get("pipeline_stage")
    if st:
        lines.append(f"  the table above: one of {st['pp']} pipeline stages, its {st['params']:,.0f} parameters"
                     + (f" ({st['layers']} layers)" if st["layers"] else "") + f" sharded over its {st['ranks']} "
                     "data-parallel ranks (equal stages; the built-in GPT's own, exact: python -m zerompi.train "
                     "--simulate-world)")
    return "\n".join(lines)


