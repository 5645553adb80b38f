"""Training data made offline: ``python -m zerompi.data prepare TEXT --out FILE [--tokenizer tokenizer.json]``.

Modules:
- prepare: a text file tokenized (a Hugging Face ``tokenizers`` file, or a byte-level BPE trained on the
  text) into a flat token file, ``--data FILE --data-format tokens``'s format

Runs without MPI; ``tokenizers`` (the ``hf`` extra) is imported only when a text is tokenized.

May import: zerompi.errors, zerompi.inputs, zerompi.checkpoint (outputs: the file checked and written).
"""
