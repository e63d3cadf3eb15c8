"""Checkpoints: ``layout`` (directory names, ``latest``), ``integrity`` (manifests, verification), ``selection``
(which checkpoint loads, ``--keep-last``), ``dcp`` (sharded save and load; ``dcp.read_model_tensors``: the whole
weights of one checkpoint directory in one process), ``rng`` and ``export`` (Hugging Face).

The package hands on no names: the command line's checks of ``--load`` import ``layout`` and ``selection``, and
an import of ``dcp`` here would load PyTorch's distributed checkpointing into every launcher (0.8 s of CPU).
"""
