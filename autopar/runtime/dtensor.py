"""An autopar mesh and placements as torch's ``DeviceMesh`` and DTensor placements: ``to_dtensor``.

Legend: a *dim* is a tensor dimension; an *axis* is a mesh axis. ``Mesh(ranks, shape, names)``
becomes ``DeviceMesh(device_type, ranks laid row-major over shape, mesh_dim_names=names)``:
the same ranks at the same coordinates (``Mesh.ranks`` are torch.distributed ranks of the
default group here), so axis a of the autopar mesh is mesh dim a of the DeviceMesh.

Where the two map exactly (the local tensor of every rank is the same):

* ``Replicate()`` -> DTensor ``Replicate()``;
* ``Partial(sum)`` -> DTensor ``Partial("sum")`` (the sum over the axis is the value; how the
  addends are split is each side's own: autopar keeps the value on coordinate 0);
* ``Shard(d)`` -> DTensor ``Shard(d)`` *when the blocks agree*. autopar splits by the
  ``torch.tensor_split`` rule (the first n % p blocks one longer: 5 over 4 is 2,1,1,1), DTensor
  by ``torch.chunk`` (blocks of ceil(n/p), the last ones short or empty: 2,2,1,0). They agree
  when p divides n, and for some uneven extents (5 over 2: 3,2 both; 7 over 4: 2,2,2,1 both).
  Checked per axis with DTensor's own arithmetic (``Shard.local_shard_size_and_offset``),
  axes in mesh order, each splitting the block the outer ones left, as both sides do.

Refused with ``DTensorMismatch``, naming the placement: ``Shard`` whose blocks differ,
``PaddedShard`` (DTensor has no padded shard: its local tensor holds zeros past the valid
data), and any other placement (e.g. a halo'd or segmented shard); naming the axis: a mesh
whose ranks decrease along an axis (process groups order their members by rank, and DTensor's
scatter then hands block i to the i-th smallest rank, not to coordinate i: measured with
torch 2.13, ranks (1, 0) got rows [0, 3) and [3, 7) of 7 the wrong way round and padded).

Creating a ``DeviceMesh`` creates its process groups: every process of the default group calls
``to_dtensor``/``device_mesh`` with the same arguments (as ``torch.distributed.new_group``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..decomp.distspec import DistSpec, Partial, Replicate, Shard
from ..decomp.mesh import Mesh
from ..errors import AutoparError


class DTensorMismatch(AutoparError):
    """An autopar placement DTensor cannot express exactly (names the placement and why)."""


def device_mesh(mesh: Mesh, device_type: str = "cpu") -> Any:
    """The ``DeviceMesh`` of ``mesh``: its ranks at the same coordinates, its axis names."""
    from torch.distributed.device_mesh import DeviceMesh
    ranks = torch.tensor(mesh.ranks, dtype=torch.int).reshape(mesh.shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=mesh.names)


def mismatch(spec: DistSpec) -> str | None:
    """None when every placement of ``spec`` maps exactly onto DTensor's; else why not (pure)."""
    from torch.distributed.tensor.placement_types import Shard as TShard
    for a, p in enumerate(spec.placements):
        if not isinstance(p, (Shard, Replicate, Partial)):
            return f"{p} on axis {spec.mesh.names[a]}: DTensor has no such placement"
    m = spec.mesh
    for a in range(m.ndim):
        for r in m.ranks:
            g = m.axis_group(r, a)
            if list(g) != sorted(g):
                return (f"axis {m.names[a]} holds ranks {list(g)} in decreasing order: DTensor's process "
                        f"groups order them by rank, not by coordinate")
    for i in range(spec.mesh.size):
        cs = spec.mesh.coords_of_index(i)
        bounds = [(0, n) for n in spec.shape]
        for a, p in enumerate(spec.placements):
            if not isinstance(p, Shard):
                continue
            s, e = bounds[p.dim]
            size, off = TShard.local_shard_size_and_offset(e, spec.mesh.shape[a], cs[a])
            bounds[p.dim] = (s + int(off) if size else s + e, int(size))
        ours = spec.bounds_at(i)
        for d, ((s0, e0), (s1, e1)) in enumerate(zip(ours, bounds)):
            if e0 != e1 or (e0 and s0 != s1):
                shards = [f"{p} on axis {spec.mesh.names[a]}" for a, p in enumerate(spec.placements)
                          if isinstance(p, Shard) and p.dim == d]
                return (f"{', '.join(shards)} of extent {spec.shape[d]}: rank {spec.mesh.ranks[i]} holds "
                        f"[{s0}, {s0 + e0}) by autopar's tensor_split rule but [{s1}, {s1 + e1}) by "
                        f"DTensor's torch.chunk rule")
    return None


def to_dtensor(spec: DistSpec, device_type: str = "cpu") -> tuple[Any, tuple]:
    """(``DeviceMesh``, DTensor placements) of ``spec``, or ``DTensorMismatch`` naming the
    placement that does not map exactly (module docstring). Collective: every process of the
    default group calls it."""
    why = mismatch(spec)
    if why is not None:
        raise DTensorMismatch(f"{spec} of shape {spec.shape} on {spec.mesh} has no exact DTensor form: {why}",
                              "redistribute to Shard/Replicate/Partial placements whose blocks the axis "
                              "sizes divide evenly, on a mesh whose ranks increase along every axis, "
                              "before handing the tensor to DTensor")
    return device_mesh(spec.mesh, device_type), tuple(p.to_torch() for p in spec.placements)


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on this rank: a DTensor (e.g. an FSDP2 shard) gathered over its mesh
    (collective over that mesh), any other tensor itself."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, any other tensor itself."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t

