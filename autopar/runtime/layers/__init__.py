"""The decompositions' run-time halves: how each decomposition kind runs an op of a layer on this
rank's local tensors, registered by class into ``autopar.decomp.base.RUNNERS`` (``runs``) and
reached through ``Decomposition.run``. ``autopar.decomp`` holds the plan-time halves (value
types, layouts, legality, cost formulas) and never imports this package; the runtime does.

One module per family: ``local`` (sample, replicate), ``spatial`` (with ``halo``: the halo
exchange), ``channel_filter``, ``tensor_parallel``, ``branch`` (with ``boundary``: the
branch-boundary collectives), ``graph`` (edges, nodes). A decomposition added from outside
autopar (``tests/toys``) keeps its run-time half in its own file as a ``run`` method.
"""

from . import branch, channel_filter, graph, local, spatial, tensor_parallel  # noqa: F401  (registration)
