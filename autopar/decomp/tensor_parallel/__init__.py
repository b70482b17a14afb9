"""Megatron-style tensor parallelism on a (sample x tensor) mesh: one module per decomposition,
registered by this explicit import (``common`` holds the mesh arithmetic they share).

* ``heads``    head-parallel attention (fused or separate q/k/v, grouped KV heads): ``head(s, p)``
* ``sequence`` sequence parallelism of norm / dropout / residual layers: ``sequence(s, p)``
* ``vocab``    vocabulary-parallel embedding: ``vocab(s, p)``
* ``detect``   finds attention blocks in a traced graph (planned as one unit each)
"""

from . import heads, sequence, vocab  # noqa: F401  (registration)
