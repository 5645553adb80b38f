"""The update, once step() knows its scalars (lr, clip factor, loss scale): which path runs it.

- the delayed update (ZeRO-Offload's, ``offload_delayed_update``): update k - 1 is published,
  update k starts in the background, behind the next step;
- stage 0: the whole model, after the gradients' all-gather;
- updates that already ran in the backward with the right scalars (engine/in_backward.py):
  their rows are committed, and stages 1/2 publish (all-gather) every bucket;
- else bucket by bucket, each bucket published (stages 1/2) behind the next one's update.
"""


def apply(engine, grads, s) -> None:
    """Run (or keep) step ``engine.step_count``'s update with scalars ``s`` on the reduced ``grads``."""
    opt, gatherer, stage = engine.optimizer, engine.gatherer, engine.config.stage
    buckets = engine.layout.buckets
    if stage == 0:
        with engine.timers.blocking("all_gather (stage 0)"):
            engine.reducer.all_gather(engine.steps_taken)
    if opt.delayed:     # publish update k - 1 (its master), start update k behind the next step
        opt.wait()
        if opt.unpublished:
            engine.publish_params()
        opt.launch([(bk.shard_slice, grads[bk.index], None) for bk in buckets], s)
        return
    if stage == 0:
        opt.update(slice(None), engine.reducer.grads, gatherer.params, s)
        return
    publish = stage in (1, 2)
    if engine.in_backward.settle(s):
        for bk in buckets if publish else ():
            gatherer.start(bk.index, engine.steps_taken + 1)
        engine.inflight.poll()
    else:
        def after(b):           # stages 1/2 publish bucket b behind the next buckets' update
            if publish:
                gatherer.start(b, engine.steps_taken + 1)
            engine.inflight.poll()
        opt.step([(bk.shard_slice, grads[bk.index], gatherer.param_out(bk.index)) for bk in buckets], s, after)
    if not engine.config.lazy_publish:   # views taken before step() read new values, never a mix
        gatherer.finish_all()
