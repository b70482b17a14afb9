"""The spatial decomposition states its halo on its placements (issue 39, item 1): the input of a
spatially split conv / pool is ``HaloShard(d, lo, hi)``, plan.json carries it, loading gives it
back, a halo wider than the neighbour's block is refused naming layer, value and field, and a
transition into it is a transition into its owned block (no price, no step)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from autopar.artifacts import PlanMigrated, load_plan
from autopar.decomp.distspec import DistSpec, HaloShard, Replicate, Shard
from autopar.decomp.mesh import Mesh
from autopar.decomp.redistribute import plan_redistribution
from autopar.decomp.sharding import Sharding, block_extent, block_start
from autopar.decomp.spatial.geometry import HaloIllegal, WindowGeom, halo_widths, plan_halo
from autopar.decomp.transition import plan_layouts, recv_bytes, transition_s
from autopar.errors import PlanFileError

ROOT = Path(__file__).resolve().parents[1]
H, W = 13, 6          # H split in 4: blocks 4, 3, 3, 3 (uneven)

MODEL = f'''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)                 # halo 1 each side
        self.c2 = nn.Conv2d(4, 4, 5, stride=2, padding=2)       # stride 2: per-block halos differ
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        y = torch.relu(self.c2(y))
        return self.head(y.mean(dim=(2, 3)))


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 2, {H}, {W}),)
'''


def brute_widths(n_in: int, n_out: int, pad_lo: int, stride: int, k_eff: int, parts: int) -> tuple[int, int]:
    """The most input elements any output block's window reads below / above its own input
    block (inside the tensor), from the window definition alone."""
    lo = hi = 0
    for c in range(parts):
        o0, on = block_start(n_out, parts, c), block_extent(n_out, parts, c)
        a, b = o0 * stride - pad_lo, (o0 + on - 1) * stride - pad_lo + k_eff
        i0, i_n = block_start(n_in, parts, c), block_extent(n_in, parts, c)
        lo = max(lo, i0 - max(a, 0))
        hi = max(hi, min(b, n_in) - (i0 + i_n))
    return lo, hi


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """A plan with both convs pinned to H split in 4 (spatial(1,4x1))."""
    from autopar.cli import main
    tmp = tmp_path_factory.mktemp("halo")
    model = tmp / "net.py"
    model.write_text(MODEL)
    out = tmp / "plan"
    assert main(["plan", str(model), "--world-size", "4", "--batch-size", "2", "--pin", "c1=spatial(1,4x1)",
                 "--pin", "c2=spatial(1,4x1)", "-o", str(out)]) == 0
    return out / "plan.json"


def _conv_layer(obj: dict, module: str) -> tuple[int, dict]:
    return next((i, d) for i, d in enumerate(obj["layers"]) if d["module"] == module)


def test_plan_json_states_the_halo_of_each_split_conv(planned):
    obj = json.loads(planned.read_text())
    out1 = 13                                  # c1 keeps H; c2: (13 + 4 - 5) // 2 + 1 = 7
    want = {"c1": brute_widths(H, out1, 1, 1, 3, 4), "c2": brute_widths(H, 7, 2, 2, 5, 4)}
    assert want == {"c1": (1, 1), "c2": (2, 3)}     # c2: block 2 (input [7, 10)) reads [6, 13)
    for module, (lo, hi) in want.items():
        _, d = _conv_layer(obj, module)
        assert d["choice"] == "spatial(1,4x1)"
        (v, rec), = d["in_placements"].items()
        assert rec["placements"] == [f"HaloShard(2, {lo}, {hi})"], (module, rec)
        assert rec["mesh"]["shape"] == [4]
        assert f"HaloShard(2, {lo}, {hi})" in d["placements"]["in"][v]
    # c1's output (owned H blocks) enters c2 (the same blocks, read with a halo): no transition
    _, d2 = _conv_layer(obj, "c2")
    assert not [t for t in obj["transitions"] if t["dst"] == d2["layer"]], obj["transitions"]


def test_loading_gives_the_same_placements_back(planned, tmp_path):
    from autopar.artifacts import write_plan
    obj = json.loads(planned.read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMigrated)     # a plan made now needs no migration
        plan = load_plan(planned)
    for d, rec in zip(plan.layers, obj["layers"]):
        assert {v: sh.to_json(4) for v, sh in d.in_placements.items()} == rec["in_placements"]
    _, d1 = _conv_layer(obj, "c1")
    got = next(d for d in plan.layers if d.module == "c1")
    assert list(got.in_placements.values()) == [Sharding.of((HaloShard(2, 1, 1), 4))]
    again = load_plan(write_plan(plan, tmp_path / "again" / "plan.json"))
    assert [d.in_placements for d in again.layers] == [d.in_placements for d in plan.layers]


@pytest.mark.parametrize("edit,match", [
    ("HaloShard(2, 4, 1)", r"reads a halo of 4 below / 1 above, but dim 2 of extent 13 over 4 parts "
                           r"leaves a neighbour block of 3 below / 3 above"),
    ("HaloShard(2, 1, 9)", r"reads a halo of 1 below / 9 above"),
])
def test_a_halo_wider_than_the_neighbour_block_is_refused(planned, tmp_path, edit, match):
    obj = json.loads(planned.read_text())
    i, d = _conv_layer(obj, "c1")
    (v, rec), = d["in_placements"].items()
    rec["placements"] = [edit]
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(obj))
    with pytest.raises(PlanFileError) as e:
        load_plan(bad)
    msg = str(e.value)
    assert f"layer {d['layer']} (c1)" in msg and f"layers[{i}].in_placements[{v!r}]" in msg, msg
    assert re.search(match, msg), msg


def test_a_halo_other_than_the_ops_is_refused_naming_both(planned, tmp_path):
    obj = json.loads(planned.read_text())
    i, d = _conv_layer(obj, "c1")
    (v, rec), = d["in_placements"].items()
    rec["placements"] = ["HaloShard(2, 2, 1)"]          # fits the neighbours, but not the op's
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(obj))
    with pytest.raises(PlanFileError, match=r"is \(H:4\)\[HaloShard\(2, 2, 1\)\] but decomposition "
                                            r"spatial\(1,4x1\) reads the tensor as \(H:4\)\[HaloShard\(2, 1, 1\)\]"):
        load_plan(bad)


def test_a_plan_stating_the_owned_block_is_completed_and_the_warning_says_so(planned, tmp_path):
    """Plans made before halos were stated (every shipped plan) load with the op's halo."""
    obj = json.loads(planned.read_text())
    i, d = _conv_layer(obj, "c1")
    (v, rec), = d["in_placements"].items()
    rec["placements"] = ["Shard(2)"]
    old = tmp_path / "plan.json"
    old.write_text(json.dumps(obj))
    with pytest.warns(PlanMigrated, match=rf"halo of 1 spatially split input\(s\).*layer {d['layer']} value {v}") as w:
        plan = load_plan(old)
    assert "plan completed on load" in str(w[0].message) and "mesh.ranks" not in str(w[0].message)
    got = next(x for x in plan.layers if x.layer == d["layer"])
    assert got.in_placements[v] == Sharding.of((HaloShard(2, 1, 1), 4))


def test_migration_warning_names_only_what_was_migrated(tmp_path):
    """A schema-2 plan that already has mesh.ranks: the warning does not claim to add them."""
    # the shipped cnn3d-w4 plan as it was written in schema 2 (the shipped plans are schema 3 now)
    f = ROOT / "tests/data/cnn3d-w4-schema2-plan.json"
    obj = json.loads(f.read_text())
    obj["model"]["path"] = str(ROOT / "strategies/examples/cnn3d_large.py")
    assert obj["schema"] == "autopar.plan/2"
    obj["mesh"]["ranks"] = [0, 1, 2, 3]
    g = tmp_path / "plan.json"
    g.write_text(json.dumps(obj))
    with pytest.warns(PlanMigrated) as w:
        plan = load_plan(g)
    msg = str(w[0].message)
    assert "mesh.ranks" not in msg and "layouts [[dim, parts], ...] written as placements" in msg, msg
    assert "halo of 1 spatially split input(s)" in msg, msg      # layer 1's 3x3 conv split in D
    del obj["mesh"]["ranks"]
    g.write_text(json.dumps(obj))
    with pytest.warns(PlanMigrated, match=r"mesh.ranks = 0..3 added"):
        assert load_plan(g).mesh.ranks == plan.mesh.ranks


# ---- semantics of the placement ---------------------------------------------------------------
@pytest.mark.parametrize("n_in,k,s,p,parts", [(13, 3, 1, 1, 4), (13, 5, 2, 2, 4), (9, 2, 2, 0, 2),
                                              (17, 4, 2, 1, 3), (10, 7, 1, 3, 2), (12, 2, 2, 0, 4)])
def test_halo_widths_are_the_widest_window_reach(n_in, k, s, p, parts):
    n_out = (n_in + 2 * p - k) // s + 1
    g = WindowGeom(n_in, n_out, p, s, k)
    assert halo_widths(g, parts) == brute_widths(n_in, n_out, p, s, k, parts)
    assert halo_widths(g, 1) == (0, 0)


def test_a_window_reaching_no_neighbour_states_a_plain_shard():
    """Pooling 2/2 on blocks of even extent reads nothing of its neighbours: HaloShard(2, 0, 0)
    is Shard(2) (normal form), so such an input states Shard."""
    assert Sharding.of((HaloShard(2, 0, 0), 4)) == Sharding.of((Shard(2), 4))
    # 12 over 4 (blocks of 3) pooled to 6 (blocks 2,2,1,1): block 1's window [4, 8) reaches 2 above
    assert halo_widths(WindowGeom(12, 6, 0, 2, 2), 4) == (0, 2)
    assert halo_widths(WindowGeom(16, 8, 0, 2, 2), 4) == (0, 0)


def test_a_transition_into_a_halo_is_one_into_its_owned_block():
    shape, world = (4, 8, 13, 6), 4
    owned = Sharding.of((Shard(2), 4))
    halo = Sharding.of((HaloShard(2, 1, 1), 4))
    assert halo.owned() == owned and halo != owned
    assert plan_layouts(owned, halo, shape, world) == ()
    assert recv_bytes(owned, halo, shape, world, 8) == 0.0
    assert transition_s(owned, halo, shape, 8, None) == (0.0, 0.0)    # no ctx needed: nothing moves
    mesh = Mesh(tuple(range(4)), (4,), ("H",))
    assert plan_redistribution(DistSpec(mesh, (Shard(2),), shape), DistSpec(mesh, (HaloShard(2, 1, 1),), shape)) == ()
    # into a halo from elsewhere: exactly the steps (and bytes) into the owned block
    samples = Sharding.of((Shard(0), 4))
    assert plan_layouts(samples, halo, shape, world) == plan_layouts(samples, owned, shape, world) != ()
    assert recv_bytes(samples, halo, shape, world, 8) == recv_bytes(samples, owned, shape, world, 8) > 0
    # the owned block of a halo'd placement is a Shard's
    for c in range(4):
        assert halo.local_bounds(shape, c, world) == owned.local_bounds(shape, c, world)
    assert Sharding.of((HaloShard(2, 1, 1), 2), (Replicate(), 2)).owned() == Sharding.of((Shard(2), 2))


def test_the_exchange_is_checked_against_the_stated_halo():
    """The geometry stays the single source of each block's window; plan_halo refuses a
    placement that states less halo than a block reads."""
    g = WindowGeom(13, 13, 1, 1, 3)
    geoms = ((2, g),)
    shape = (1, 1, 13, 4)
    ok = Sharding.of((HaloShard(2, 1, 1), 4))
    for r in range(4):
        st = plan_halo(shape, ok, geoms, r, 4).steps[0]
        assert st.lo_len <= 1 and st.hi_len <= 1
    with pytest.raises(HaloIllegal, match=r"reads 0 below / 1 above its block, but its placement .* states a halo of 0 / 0"):
        plan_halo(shape, Sharding.of((Shard(2), 4)), geoms, 0, 4)
