"""The built-in models: gpt (a pre-LayerNorm GPT) and mlp (a teacher-student MLP).

Modules:
- gpt: the GPT, its engine layers, parameters, data share and TP split plan
- gpt_chunk: GPTChunk, a run of the GPT's layers (an unpipelined run: the one of all); the GPT's train step
- gpt_fast: the GPT's blocks on the C kernels
- gpt_numpy: the GPT's pieces in plain array code: the reference, CuPy's path
- gpt_sp: the GPT's attention, sequence-parallel (Ulysses)
- activations: the metered workspace and activation checkpointing
- chunks: Chunk, the one layer walk of a layered model, cut by layer range
- mlp: the teacher-student MLP
- mlp_tp: the MLP, tensor-parallel
"""
