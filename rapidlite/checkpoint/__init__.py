"""Checkpoints: ``layout`` (directory names, ``latest``), ``integrity`` (manifests, verification), ``selection``
(which checkpoint loads, ``--keep-last``), ``dcp`` (sharded save and load), ``rng`` and ``export`` (Hugging Face).

The package itself offers what the README shows users: ``read_model_tensors``, the whole weights of one
checkpoint directory in one process.
"""

from rapidlite.checkpoint.dcp import read_model_tensors

__all__ = ["read_model_tensors"]
