"""Decompositions: one module each, registered into ``base.REGISTRY`` by this explicit import."""

from .base import REGISTRY, CostContext, Decomposition, LayerCost, ParamShard, decomposition_from_json, register
from .sharding import Sharding
from . import branch, channel_filter, graph, replicate, sample, spatial, tensor_parallel  # noqa: F401  (registration)

__all__ = ["REGISTRY", "CostContext", "Decomposition", "LayerCost", "ParamShard", "Sharding",
           "decomposition_from_json", "register"]
