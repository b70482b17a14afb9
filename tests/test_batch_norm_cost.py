"""Batch-norm statistics choice, pure logic: pricing follows the choice (local statistics cost
sample parallelism nothing), legality names the layer, and the plan records the choice."""

from __future__ import annotations

import json
import textwrap

import pytest

from autopar.decomp.base import CostContext
from autopar.decomp.bn import BatchNormStats, check_groups, resolve
from autopar.decomp.channel_filter import ChannelFilter
from autopar.decomp.replicate import Replicate
from autopar.decomp.sample import Sample
from autopar.decomp.spatial import Spatial

NET = """
import torch
from torch import nn
import torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)
    def forward(self, x):
        return self.fc(F.relu(self.b1(self.c1(x))).mean((2, 3)))

def build_model():
    return Net()

def example_inputs(batch_size):
    return (torch.randn(batch_size, 4, 12, 12),)
"""


@pytest.fixture
def layer(tmp_path):
    from autopar.modelfile import load_model_file
    from autopar.trace.tracer import trace_model
    f = tmp_path / "net.py"
    f.write_text(textwrap.dedent(NET))
    g = trace_model(load_model_file(f), 8)
    return g.layers[0]


def _ctx(profile, bn):
    return CostContext(profile=profile, world=4, ranks_per_node=4, batch_size=8, batch_norm=bn)


def test_pricing_follows_the_statistics(layer, profile):
    local, glob = _ctx(profile, BatchNormStats("local", 2)), _ctx(profile, BatchNormStats("global"))
    # sample parallelism: DDP's function costs no batch-norm communication
    assert Sample(4).cost(layer, local).fwd_comm_s == 0.0 and Sample(4).cost(layer, local).bwd_comm_s == 0.0
    assert Sample(4).cost(layer, glob).fwd_comm_s > 0.0
    # a replicated layer holds whole groups either way
    assert Replicate().cost(layer, local).fwd_comm_s == Replicate().cost(layer, glob).fwd_comm_s == 0.0
    # spatial: the ranks holding the same samples' other blocks still combine their statistics
    sp_local, sp_glob = Spatial(1, (2, 2)).cost(layer, local), Spatial(1, (2, 2)).cost(layer, glob)
    halo = Spatial(1, (2, 2)).cost(layer, _ctx(profile, BatchNormStats("local", 8)))
    assert sp_local.fwd_comm_s > 0.0 and sp_glob.fwd_comm_s > 0.0 and halo.fwd_comm_s > 0.0
    # channel/filter: each rank holds whole groups of its channels
    cf = ChannelFilter(1, 2, 2)
    assert cf.cost(layer, local).bwd_comm_s < cf.cost(layer, glob).bwd_comm_s


def test_grouped_batch_norm_on_one_rank_is_priced(layer, profile):
    """Local statistics with several groups whole on a rank run the grouped kernel path
    (``runtime.ops._native_group_batch_norm``: the groups moved into the channel dim, more small
    ops): priced by ``decomp.common.bn_group_copies_s``, in compute, both directions; nothing
    for one group a rank, global statistics, or groups whose blocks are spread over ranks."""
    from autopar.decomp.common import bn_group_copies_s
    from autopar.decomp.sharding import Partial, Shard, Sharding
    bn_op = next(op for op in layer.ops if op.kind == "batch_norm")
    local, glob = _ctx(profile, BatchNormStats("local", 2)), _ctx(profile, BatchNormStats("global"))
    f, b = bn_group_copies_s(bn_op, Sharding(), local)              # 8 samples: 4 groups of 2 here
    assert f > 0.0 and b > 0.0
    assert bn_group_copies_s(bn_op, Sharding(), glob) == (0.0, 0.0)
    assert bn_group_copies_s(bn_op, Sharding.of((Shard(0), 4)), local) == (0.0, 0.0)       # one group a rank
    spread = Sharding.of((Shard(2), 4))                                   # every rank a quarter of each image
    assert bn_group_copies_s(bn_op, spread, local) == (0.0, 0.0)
    rep_local, rep_glob = Replicate().cost(layer, local), Replicate().cost(layer, glob)
    assert rep_local.fwd_compute_s == pytest.approx(rep_glob.fwd_compute_s + f)
    assert rep_local.bwd_compute_s == pytest.approx(rep_glob.bwd_compute_s + b)


def test_legality_names_the_layer(layer, profile):
    ctx = _ctx(profile, BatchNormStats("local", 4))
    why = Sample(4).check(layer, ctx)
    assert why and "--bn-group 4 does not divide the 2 samples a rank holds" in why and "c1" in why
    assert Sample(2).check(layer, ctx) is None and Replicate().check(layer, ctx) is None
    assert Spatial(2, (2, 1)).check(layer, ctx) is None and Spatial(1, (2, 2)).check(layer, ctx) is None
    assert check_groups(8, 2, 4) is None and check_groups(8, 4, 4) and check_groups(6, 2, 2)


def test_resolve_defaults_to_the_samples_of_a_rank():
    assert resolve("local", None, 16, 4) == BatchNormStats("local", 4)
    assert resolve("local", 8, 16, 4) == BatchNormStats("local", 8)
    assert resolve("global", None, 16, 4) == BatchNormStats("global")
    assert resolve("local", None, 6, 4) == BatchNormStats("global")     # no samples-per-rank
    with pytest.raises(ValueError, match="does not divide the batch"):
        resolve("local", 5, 16, 4)
    with pytest.raises(ValueError, match="local only"):
        resolve("global", 4, 16, 4)


def test_plan_records_and_checks_the_choice(tmp_path, root, profile):
    from autopar.artifacts import PlanHooks, PlanOptions, load_plan
    from autopar.errors import PlanFileError
    from autopar.planner import make_plan
    r = make_plan(root / "strategies/examples/resnet2d.py",
                  PlanOptions(world_size=2, batch_size=8, out_dir=str(tmp_path / "p"), bn_group=2),
                  PlanHooks(profile=profile))
    obj = json.loads(r.plan_path.read_text())
    assert obj["batch_norm"] == {"mode": "local", "group": 2}
    assert load_plan(r.plan_path).bn_stats() == BatchNormStats("local", 2)
    del obj["batch_norm"]                     # a plan made before the choice: global
    (tmp_path / "old.json").write_text(json.dumps(obj))
    from autopar.artifacts import Plan
    assert Plan.from_json(obj, "old").bn_stats() == BatchNormStats("global")
    obj["batch_norm"] = {"mode": "local", "group": 3}
    with pytest.raises(PlanFileError, match="batch_norm.group"):
        Plan.from_json(obj, "bad")
    obj["batch_norm"] = {"mode": "ghost"}
    with pytest.raises(PlanFileError, match="batch_norm.mode"):
        Plan.from_json(obj, "bad")
