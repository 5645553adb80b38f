"""AdamW, Muon and the reduce-scatter's local sum: the references and the fused kernels.

Modules:
- reference: the NumPy float32 references every kernel is checked against
- muon: Muon's momentum, Newton-Schulz and shape scale
- impl: which implementation the engine calls
- fused_cpu: the C kernels, compiled on first use
- cuda: the CUDA kernels through CuPy
- sources: where the kernel sources are
- dtypes: the storage dtypes by name, fp16, fp32, and bf16 through ml_dtypes

May import: zerompi.errors. Importing this package imports nothing; none of it needs MPI.
"""
