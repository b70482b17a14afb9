"""The op vocabulary: one module per op family, one table (``registry.FAMILIES``).

How to add an op family (the whole diff is one file plus one import line):

1. Write ``autopar/ops/myop.py`` (or, outside the package, any module)::

       from .registry import OpFamily, numel, register_family, same_index_dims

       @register_family
       class MyOp(OpFamily):
           '''aten.my_op(x, ...): FLOPs ``3 n`` forward, ``6 n`` backward (formula here).'''
           kind = "my_op"                      # the OpSpec.kind string
           aten = frozenset({"my_op"})         # base names of the aten ops it matches
           kernel_class = "elementwise"        # calibration class pricing it (fallback_class
                                               # when a profile lacks it)
           def flops(self, op):                # global shapes -> (fwd, bwd)
               n = float(numel(op.out_shape)); return 3 * n, 6 * n
           def local_flops(self, op, in_shapes, out_shape, w_shape=None):
               return 3.0 * numel(out_shape)   # a local block, in the class's convention
           def independent_dims(self, op):     # dims a block may split unchanged
               return same_index_dims(op, range(len(op.out_shape)))

   Override only what differs from ``OpFamily``'s defaults (bytes in + out, saves its first
   input, ``attrs`` empty, runs only replicated).
2. Add ``from . import myop`` to the list below (a family outside the package registers when
   its module is imported: ``tests/toys/toy_op.py``).

The tracer then gives matching ops ``kind = "my_op"`` with the family's attributes and FLOPs,
the cost model prices them with its class and formulas, and sample parallelism runs them where
``0 in independent_dims(op)``. Ops that match no family stay ``other`` (replicated) and are
listed in ``LayerGraphData.unregistered``.
"""

from __future__ import annotations

from . import (attention, conv, dropout, elementwise, embedding, gather, graph, linear,  # noqa: F401
               loss, norm, pool, reduce, scatter, shape, softmax)
from .registry import (BUFFER_UPDATE, FAMILIES, MULTI_OUTPUT, OTHER, KindSet, OpFamily,
                       RegistryError, classify, describe_unregistered, family_of, kernel_class_for,
                       register_family, register_multi_output, unregister_family)

__all__ = ["BUFFER_UPDATE", "FAMILIES", "MULTI_OUTPUT", "OTHER", "KindSet", "OpFamily",
           "RegistryError", "classify", "describe_unregistered", "family_of", "kernel_class_for",
           "register_family", "register_multi_output", "unregister_family"]
