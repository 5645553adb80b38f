"""Sharded checkpoints: saved by every rank, loaded at any world size, stage or bucket size.

Modules:
- collective: save / load, the collective protocol and resharding
- writer: a rank's shard file, written now or by a background thread from a host copy
- state_rows: the optimizer's rows in a shard file, by name
- format: the manifest, the atomic publish, reading and verifying
- checksums: CRC-32, sha256 and the C hash zck64 of shard files and offload records
- pointer: which of a save folder's folders are published checkpoints, and ``latest``
- orphans: checkpoints whose every shard was written but that no one published, found and published
- savedir: the save directory's lock, no silent overwrite, retention
- cli: ``python -m zerompi.checkpoint inspect | consolidate | export-hf``, offline and without MPI
- outputs: every tool's output files, checked before the work, written atomically
- parts: a save folder's pipeline, tensor-parallel and expert-parallel part folders, each a whole set, in order
- hf_names: the GPT's parameters by GPT-2's names, and GPT-2's config.json, written and checked
- safetensors_files: safetensors files read and written a piece at a time, the shard index
- hf_export: ``export-hf``, a GPT checkpoint as a Hugging Face GPT-2 folder, streamed
- replicas: every step's shard in memory on this rank's node and a buddy's, committed by an agreement
- replica_files: the replicas' folders in node-local shared memory, and the checkpoint assembled from them
- part_load: one engine loaded from several checkpoints of one step, each element from where a map says

May import: zerompi.errors, zerompi.layout, zerompi.comm; it works on the engine object it is
given (ZeroEngine.save / load call it). Importing this package imports nothing; format, writer,
savedir, cli and outputs load without MPI.
"""
