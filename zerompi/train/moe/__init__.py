"""The mixture of experts: the GPT's MoE blocks (``--experts E --top-k k``) and expert parallelism (``--ep K``),
applied to the one GPT (models/gpt.py picks a block's MLP) and run by the one job (job.py, pipeline.py).

Modules:
- config: MoEConfig (--experts, --top-k, --ep, ...), its checks and the compositions it refuses
- mlp: the mixture-of-experts MLP: router, top-k, experts, load-balancing loss, forward and backward
- block: the GPT's MoE block: attention, then the MoE MLP; its parameters' lazy rules
- ep_mlp: the MoE MLP under expert parallelism: rows to the experts and back, per-source gradients
- expert_parallel: --ep, the EP and expert-data-parallel groups, the expert engine, the step over both engines
- stage_experts: --ep inside a pipeline's stages (--pp): each chunk's expert engine, the groups in a stage
- routing: the routing per step over the world, the metrics' moe section and the MoE row
- checkpoints: an MoE run's checkpoints: the experts resharded to the resuming --ep, the selection biases

docs/moe.md. May import what train/ may.
"""
