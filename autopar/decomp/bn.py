"""Batch-norm statistics as a stated, plan-wide choice (pure: no torch, no process group).

``BatchNormStats("local", G)``: in training, each batch norm normalises over fixed groups of
``G`` consecutive samples (samples ``[k G, (k+1) G)``, k = 0..N/G-1), each group with its own
mean and variance over its samples and spatial positions ("ghost" batch norm). With ``G`` = the
samples one rank holds under pure data parallelism (N / world, the default) this is exactly
what torch DDP without SyncBatchNorm computes (and LBANN's default), so sample parallelism needs
no batch-norm communication at all.

``BatchNormStats("global")``: statistics over the whole batch, the single-process function
(what DDP + SyncBatchNorm computes); every decomposition that splits samples or spatial extents
then pays blocking all-reduces per batch norm.

Every decomposition computes exactly the chosen statistics: under ``local`` a rank holding a
whole number of groups (``check_groups``) computes their statistics locally, and only ranks
holding other spatial blocks of the same samples (spatial decomposition) combine theirs.

Running statistics under ``local`` are defined as one update per step with the MEAN over the
N/G groups of the group means and of the groups' unbiased variances:
``r <- (1 - m) r + m * mean_k stat_k``; every rank holds the same values (one small all-reduce
per step, ``runtime.ops.BatchNormRuntime.flush``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping
from .ir import BATCH_NORM
from .sharding import block_extent, block_start

MODES = ("local", "global")
#: what a plan without a ``batch_norm`` field computed (plans made before the choice existed)
LEGACY = {"mode": "global", "group": None}


@dataclass(frozen=True)
class BatchNormStats:
    mode: str = "global"
    group: int | None = None      # samples per statistics group (local only)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"batch-norm statistics {self.mode!r}: choose one of {MODES}")
        if self.mode == "global":
            object.__setattr__(self, "group", None)
        elif self.group is not None:
            object.__setattr__(self, "group", int(self.group))

    @property
    def local(self) -> bool:
        return self.mode == "local"

    def __str__(self) -> str:
        return f"local(G={self.group})" if self.local else "global"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "group": self.group}

    @staticmethod
    def from_json(obj: Mapping[str, Any] | None) -> "BatchNormStats":
        obj = obj or LEGACY
        return BatchNormStats(str(obj.get("mode", "global")), obj.get("group"))

    def groups(self, batch: int) -> int:
        """Number of statistics groups in a batch of ``batch`` samples (1 under global)."""
        return batch // self.group if self.local else 1


def resolve(mode: str, group: int | None, batch: int, world: int) -> BatchNormStats:
    """The plan's statistics from the user's flags; ``ValueError`` (a sentence saying what to
    do) when the group does not split the batch into whole groups. Local without a group on a
    batch that does not split evenly over the world (no samples-per-rank exists): global."""
    if mode not in MODES:
        raise ValueError(f"--batch-norm {mode!r} is not one of {', '.join(MODES)}")
    if mode == "global":
        if group is not None:
            raise ValueError("--bn-group applies to --batch-norm local only")
        return BatchNormStats("global")
    if group is None:
        if batch % world:
            # no data-parallel group size exists (DDP cannot even run a batch smaller than the
            # world): the single-process function, said by the caller
            return BatchNormStats("global")
        group = batch // world
    if group < 1 or batch % group:
        raise ValueError(f"--bn-group {group} does not divide the batch of {batch} samples")
    return BatchNormStats("local", int(group))


def check_groups(n: int, parts: int, group: int) -> str | None:
    """None when splitting ``n`` samples into ``parts`` blocks (``tensor_split`` rule) gives
    every rank a whole number of groups of ``group`` samples; else why not."""
    q, r = divmod(n, parts)
    if group == 1 or (r == 0 and q % group == 0):
        return None       # equal blocks of q samples starting at multiples of q: all whole groups
    for c in range(parts):
        a, e = block_start(n, parts, c), block_extent(n, parts, c)
        if a % group or e % group:
            return (f"--bn-group {group} does not divide the {e} samples a rank holds "
                    f"({n} samples in {parts} blocks)")
    return None


def layer_problem(layer, layout_of, bn: "BatchNormStats | None") -> str | None:
    """Why a decomposition cannot compute local statistics of ``layer``'s training batch norms
    (``layout_of(op)`` = the layout of the batch norm's input), naming the layer; None if it can."""
    if bn is None or not bn.local:
        return None
    for op in layer.ops:
        if op.kind == BATCH_NORM and op.attrs.get("training", True):
            lay = layout_of(op)
            why = check_groups(int(op.in_shapes[0][0]), lay.parts_of(0), bn.group)
            if why:
                return f"{layer.module or layer.name} ({op.name}): {why}"
    return None
