"""Megatron-style tensor parallelism on a (sample x tensor) mesh: one module per decomposition,
registered by this explicit import (``common`` holds the mesh arithmetic they share).

* ``heads``    head-parallel attention (fused or separate q/k/v, grouped KV heads): ``head(s, p)``
* ``sequence`` sequence parallelism of norm / dropout / residual layers: ``sequence(s, p)``
* ``vocab``    vocabulary-parallel embedding ``vocab(s, p)`` and LM head ``vocab_head(s, p)``
               (column-parallel, the loss run vocabulary-parallel on its split logits)
* ``cross_entropy`` the vocabulary-parallel cross-entropy (runtime) and the plan-time check
               that a model file's loss is one
* ``detect``   finds attention blocks in a traced graph (planned as one unit each)
"""

from . import heads, sequence, vocab  # noqa: F401  (registration)
