"""Sharded data parallelism (issue 40): the pure value type and formulas (``decomp.fsdp``) and the
run on torch's FSDP2 + DTensor (``runtime.fsdp``) against one process in float64.

Tolerance: 1e-12 absolute on outputs, loss, every gradient, the clipped norm and every parameter
after two AdamW steps with clipping (the sums differ from one process only in their order)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autopar.decomp.fsdp import (DDP_ZERO, Sharded, UnitComm, UnitParams, UnitTime, candidates, check_plan,
                                 plan_memory_bytes, schedule, shard_rows, unit_comm, unit_memory, zero1_memory_bytes,
                                 zero1_partition, zero1_step_s)
from autopar.errors import AutoparError

TOL = 1e-12


# ---- pure: shard arithmetic, legality, formulas ----------------------------------------------------

def test_shard_rows_are_torch_chunk_exactly():
    for d0 in range(0, 23):
        for n in (1, 2, 3, 4, 8):
            got = [shard_rows(d0, n, r) for r in range(n)]
            want = [c.shape[0] for c in torch.arange(d0).chunk(n)] if d0 else []
            want += [0] * (n - len(want))
            assert got == want, (d0, n)
            assert sum(got) == d0


def test_uneven_shard_bytes():
    u = UnitParams("blk", ((10, 6), (10,), (5, 3)), itemsize=8)
    assert u.whole_bytes() == 8 * (60 + 10 + 15)
    # 4 ranks: ceil(10/4)=3 rows of 6, 3 of the bias, ceil(5/4)=2 rows of 3 (padded)
    assert u.shard_bytes(4) == 8 * (18 + 3 + 6)
    valid = [u.shard_bytes(4, r) for r in range(4)]
    assert sum(valid) == u.whole_bytes()
    assert valid[3] == 8 * (1 * 6 + 1 + 0)      # rows 9 of 10 (w, bias); nothing of the 5-row one
    assert u.gathered_bytes(4) == 4 * u.shard_bytes(4)


def test_levels_fall_out_as_choices():
    assert [str(s) for s in candidates(4)] == ["zero1(dp4,ddp+zero)", "zero2(dp4)", "zero3(dp4,reshard)"]
    assert [(s.level, s.engine) for s in candidates(4, microbatches=2)] == [(1, DDP_ZERO), (1, "fsdp2"), (2, "fsdp2"),
                                                                            (3, "fsdp2")]
    assert [str(s) for s in candidates(4, tp=2)] == ["zero2(dp4,tp2)", "zero3(dp4,tp2,reshard)"]   # no ZeRO-1 with TP
    z1 = Sharded(1, False, 4, engine=DDP_ZERO)
    assert Sharded.from_json(z1.to_json()) == z1 and z1.check() is None
    assert "level 1" in Sharded(2, False, 4, engine=DDP_ZERO).check()
    assert "plan-wide" in check_plan([z1, Sharded(2, False, 4)]) and check_plan([z1, z1]) is None
    assert "level 2" in Sharded(3, False, 4).check()
    assert "accumulation" in Sharded(1, False, 4).check()
    assert "shards nothing" in Sharded(3, True, 1).check()
    s = Sharded(2, False, 4, 2)
    assert Sharded.from_json(s.to_json()) == s


def test_unit_memory_against_data_parallel():
    u = UnitParams("blk", ((1024, 1024),), itemsize=4)
    F = u.whole_bytes()
    dp = unit_memory(u, None, 2.0)
    assert dp.resident_bytes == 4 * F                        # param + grad + 2 Adam states
    z3 = unit_memory(u, Sharded(3, True, 4), 2.0, next_whole_bytes=F)
    assert z3.resident_bytes == 4 * F / 4 and z3.transient_bytes == 3 * F
    z2 = unit_memory(u, Sharded(2, False, 4), 2.0)
    assert z2.resident_bytes == F + 4 * F / 4
    z1 = unit_memory(u, Sharded(1, False, 4), 2.0)
    assert z1.grads_bytes == F and z1.resident_bytes == 2 * F + 3 * F / 4
    mem = plan_memory_bytes([u, u, u], [Sharded(3, True, 4)] * 3, 2.0, activation_bytes=100.0)
    assert mem.resident_bytes == 3 * F and mem.transient_bytes == 3 * F and mem.activation_bytes == 100.0


def test_zero1_partition_is_zero_redundancy_optimizers():
    """The greedy partition priced is the one torch's ZeroRedundancyOptimizer makes (its own
    ``_partition_parameters``, read without a process group), uneven sizes and ties included."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    shapes = ((10, 6), (10,), (5, 3), (7, 7), (3,), (15,), (2, 2), (1,))
    u = UnitParams("blk", shapes, itemsize=8)
    for n in (2, 3, 4):
        ps = [torch.zeros(s) for s in shapes]
        z = ZeroRedundancyOptimizer.__new__(ZeroRedundancyOptimizer)
        z.param_groups, z.world_size, z._partition_parameters_cache = [{"params": ps}], n, []
        z._partition_param_group = lambda g, per_rank: z._partition_parameters_cache.__setitem__(
            slice(None), [[{"params": r}] for r in per_rank])
        want = [sum(p.numel() for p in r[0]["params"]) for r in ZeroRedundancyOptimizer._partition_parameters(z)]
        got = zero1_partition([u], n)
        assert [p.param_bytes for p in got] == [8.0 * w for w in want], n
        assert sum(p.n_tensors for p in got) == len(shapes)
        assert zero1_memory_bytes([u], n, 2.0) == 2 * 8.0 * max(want)
    # memory of the plan: params and grads whole, the largest partition's state (not F / N)
    big = UnitParams("emb", ((1000, 4),), itemsize=4)
    small = UnitParams("b", ((10, 4),) * 4, itemsize=4)
    z1 = Sharded(1, False, 4, engine=DDP_ZERO)
    m = plan_memory_bytes([big, small], [z1, z1], 2.0, 0.0)
    F = big.whole_bytes() + small.whole_bytes()
    assert m.resident_bytes == 2 * F + 2 * big.whole_bytes() and m.transient_bytes == 0
    dp = plan_memory_bytes([big, small], [None, None], 2.0, 0.0)
    assert dp.resident_bytes - m.resident_bytes == 2 * small.whole_bytes()


def test_zero1_time_is_ddp_allreduce_then_partition_step_and_broadcasts():
    u = UnitParams("blk", ((1000, 100), (1000,)), itemsize=4)
    opt = lambda n, by: n * 1e-5 + by * 1e-10  # noqa: E731
    z1 = Sharded(1, False, 4, engine=DDP_ZERO)
    c = unit_comm(u, z1, _fake_collective, opt)
    dp = unit_comm(u, None, _fake_collective, opt, world_dp=4)
    assert c.reduce_s == dp.reduce_s and c.gathers == 0 and c.optim_s == 0.0
    # 2 tensors on 4 ranks: rank 0 the matrix, rank 1 the bias; the step is rank 0's
    t = zero1_step_s([u], 4, _fake_collective, opt)
    bc = _fake_collective("broadcast", 4, 400000) + _fake_collective("broadcast", 4, 4000)
    assert t == pytest.approx(opt(1, 400000) + bc)


def _fake_collective(kind, p, nbytes):
    a, b = {"allgather": (1, (p - 1) / p), "reduce_scatter": (1, (p - 1) / p), "allreduce": (2, 2 * (p - 1) / p),
            "broadcast": (1, 1.0)}[kind]
    return a * math.ceil(math.log2(p)) * 1e-4 + b * nbytes * 1e-9


def test_unit_comm_counts_collectives():
    u = UnitParams("blk", ((1000, 100),), itemsize=4)
    opt = lambda n, by: by * 1e-10  # noqa: E731
    z3 = unit_comm(u, Sharded(3, True, 4), _fake_collective, opt)
    z2 = unit_comm(u, Sharded(2, False, 4), _fake_collective, opt)
    dp = unit_comm(u, None, _fake_collective, opt, world_dp=4)
    assert z3.gathers == 2 and z2.gathers == 1 and dp.gathers == 0
    assert z3.allgather_s == pytest.approx(2 * 1e-4 + 0.75 * 400000 * 1e-9)
    assert z3.reduce_s == pytest.approx(z3.allgather_s)
    # all-gather + reduce-scatter move what one all-reduce moves
    assert z2.allgather_s + z2.reduce_s == pytest.approx(dp.reduce_s)
    assert z3.optim_s == pytest.approx(dp.optim_s / 4)
    z1 = unit_comm(u, Sharded(1, False, 4), _fake_collective, opt, microbatches=3)
    z2m = unit_comm(u, Sharded(2, False, 4), _fake_collective, opt, microbatches=3)
    assert z2m.reduce_s == pytest.approx(3 * z1.reduce_s)


def test_schedule_overlap_by_hand():
    # two units, 1 s forward / 2 s backward each; gathers of 0.5 s, reduce-scatters 0.25 s
    t = [UnitTime(1.0, 2.0)] * 2
    c = [UnitComm(0.5, 2, 0.25, 0.0)] * 2
    s = schedule(t, c)
    # fwd: AG0 0-0.5, F0 0.5-1.5, AG1 0.5-1.0 (issued at F0's start), F1 1.5-2.5
    # bwd: AG1' issued 2.5 -> 3.0, B1 3.0-5.0, RS1 5.0-5.25; AG0' issued 3.0 -> 3.5 (stream free),
    #      B0 5.0-7.0, RS0 7.0-7.25
    assert s.step_time_s == pytest.approx(7.25)
    assert s.exposed_comm_s == pytest.approx(7.25 - 6.0)
    no_comm = schedule(t, [UnitComm(0.0, 0, 0.0, 0.0)] * 2)
    assert no_comm.step_time_s == pytest.approx(6.0)


def test_non_elementwise_optimizer_refused():
    from autopar.runtime.fsdp import check_optimizer
    p = [nn.Parameter(torch.zeros(2))]
    check_optimizer(torch.optim.AdamW(p))
    with pytest.raises(AutoparError, match="LBFGS"):
        check_optimizer(torch.optim.LBFGS(p))


def test_live_bytes_counts_a_step():
    from autopar.runtime.fsdp import LiveBytes
    a = torch.zeros(1000, dtype=torch.float64)
    with LiveBytes(also=[a]) as lb:
        b = a + 1                  # 8000 more
        c = b * 2                  # 8000 more
        del b, c
        d = a + 3                  # the two before are gone
    assert lb.start_bytes == 8000
    assert lb.peak_bytes == 24000
    del d


# ---- distributed: FSDP2 (+ DTensor TP) against one process ----------------------------------------

class Block(nn.Module):
    def __init__(self, d=6, h=10):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


CONFIGS = {
    "zero3": ({"blocks.0": (3, True), "blocks.1": (3, True)}, 1, 1),
    "zero2": ({"blocks.0": (2, False), "blocks.1": (2, False)}, 1, 1),
    "zero1-accum": ({"blocks.0": (1, False), "blocks.1": (1, False)}, 1, 2),
    "mixed-dp": ({"blocks.0": None, "blocks.1": (3, True)}, 1, 1),
    "zero3+tp": ({"blocks.0": (3, True), "blocks.1": (3, True)}, 2, 1),
    "zero2+tp": ({"blocks.0": (2, False), "blocks.1": (1, False)}, 2, 2),
    "zero1-ddp": ({"blocks.0": (1, False, DDP_ZERO), "blocks.1": (1, False, DDP_ZERO), "": (1, False, DDP_ZERO)}, 1, 1),
    "zero1-ddp-accum": ({"blocks.0": (1, False, DDP_ZERO), "blocks.1": (1, False, DDP_ZERO),
                         "": (1, False, DDP_ZERO)}, 1, 2),
    # activation checkpointing (4th field) on one unit at ZeRO-3, on both at ZeRO-2 with accumulation
    "zero3-ac": ({"blocks.0": (3, True, "fsdp2", True), "blocks.1": (3, True)}, 1, 1),
    "zero2-ac-accum": ({"blocks.0": (2, False, "fsdp2", True), "blocks.1": (1, False, "fsdp2", True)}, 1, 2),
    "zero3-ac+tp": ({"blocks.0": (3, True, "fsdp2", True), "blocks.1": (2, False, "fsdp2", True)}, 2, 1),
}


def _units(spec, dp, tp):
    """CONFIGS' unit decisions, and the root's ("" in the spec; default ZeRO-3)."""
    units = {k: (None if v is None else Sharded(v[0], v[1], dp, tp, engine=(v[2] if len(v) > 2 else "fsdp2"),
                                                ac=len(v) > 3 and v[3]))
             for k, v in spec.items()}
    root = units.pop("", "zero3")
    return units, root


def _full_t(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check_configs(rank, world, names):
    import torch.distributed as dist

    from autopar.runtime import fsdp as rf
    torch.set_default_dtype(torch.float64)
    out = {}
    batch = 8
    for name in names:
        spec, tp, micro = CONFIGS[name]
        dp = world // tp
        torch.manual_seed(0)
        ref = Tiny()
        model = Tiny()
        model.load_state_dict(ref.state_dict())
        mesh = rf.make_mesh(world, tp)
        units, root = _units(spec, dp, tp)
        styles = {}
        if tp > 1:
            for i in range(2):
                styles[f"blocks.{i}.up"] = "colwise"
                styles[f"blocks.{i}.down"] = "rowwise"
        rf.parallelize(model, mesh, units, styles, root=root)
        calls = []      # forwards of blocks.0.up: twice a micro-batch under AC (the recompute in backward)
        model.get_submodule("blocks.0.up").register_forward_pre_hook(lambda m, a: calls.append(1))
        dp_rank = mesh["dp"].get_local_rank() if tp > 1 else mesh.get_local_rank()
        opt = rf.make_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        if root != "zero3" and root.engine == DDP_ZERO:   # ZeRO-1: this rank holds part of the state
            from torch.distributed.optim import ZeroRedundancyOptimizer
            assert isinstance(opt, ZeroRedundancyOptimizer)
            assert 0 < len(opt.optim.param_groups[0]["params"]) < len(list(model.parameters()))
            with pytest.raises(rf.Zero1OptimizerError, match="make_optimizer"):
                rf.check_zero1_optimizer(torch.optim.AdamW(model.parameters()))
        rf.check_optimizer(opt)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(1)
        errs = []
        for step in range(2):
            x = torch.randn(micro, batch, 5, generator=g)
            y = torch.randn(micro, batch, 3, generator=g)
            for k in range(micro):
                rf.set_microbatch(model, last=(k == micro - 1))
                xs, ys = x[k].chunk(dp)[dp_rank], y[k].chunk(dp)[dp_rank]
                o = model(xs)
                loss = ((o - ys) ** 2).mean() / micro
                loss.backward()
                ro = ref(x[k])
                rloss = ((ro - y[k]) ** 2).mean() / micro
                rloss.backward()
                errs.append((o - ro.chunk(dp)[dp_rank]).abs().max().item())
                lt = loss.detach().clone()
                dist.all_reduce(lt)
                errs.append(abs(lt.item() / world - rloss.item()))
            for (q, p), rp in zip(model.named_parameters(), ref.parameters()):
                errs.append((_full_t(p.grad) - rp.grad).abs().max().item())
            norm = rf.clip_grad_norm_(model.parameters(), 0.05)        # clips: the norm is ~1
            rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            assert rnorm > 0.05
            errs.append(abs(norm.item() - rnorm.item()))
            opt.step()
            ropt.step()
            opt.zero_grad()
            ropt.zero_grad()
            for p, rp in zip(model.parameters(), ref.parameters()):
                errs.append((_full_t(p) - rp).abs().max().item())
        ac = units["blocks.0"] is not None and units["blocks.0"].ac
        assert len(calls) == 2 * micro * (2 if ac else 1), (name, len(calls))
        out[name] = max(errs)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_every_level_alone_and_with_tp_matches_one_process(world):
    from autopar.runtime.launch import run_ranks
    names = [n for n in CONFIGS if world == 4 or CONFIGS[n][1] == 1]
    res = run_ranks(_check_configs, world, args=(names,), start_method="fork", timeout_s=240)
    for r in res:
        for name, err in r.items():
            assert err < TOL, (world, name, err)
    assert set(res[0]) == set(names)


# ---- checkpoints: sharded <-> sharded + tensor parallel <-> data parallel at another world size -----

def _build(world, name):
    from autopar.runtime import fsdp as rf
    spec, tp, _ = CONFIGS[name]
    torch.manual_seed(0)
    model = Tiny()
    mesh = rf.make_mesh(world, tp)
    units, root = _units(spec, world // tp, tp)
    styles = {f"blocks.{i}.{n}": s for i in range(2) for n, s in (("up", "colwise"), ("down", "rowwise"))} if tp > 1 else {}
    rf.parallelize(model, mesh, units, styles, root=root)
    return model, (mesh["dp"].get_local_rank() if tp > 1 else mesh.get_local_rank()), world // tp


def _opt(model):
    from autopar.runtime import fsdp as rf
    return rf.make_optimizer(model, torch.optim.AdamW, lr=1e-2)


def _step(model, opt, dp_rank, dp, seed):
    import autopar.train
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    loss = ((model(x.chunk(dp)[dp_rank]) - y.chunk(dp)[dp_rank]) ** 2).mean()
    loss.backward()
    autopar.train.clip_grad_norm_(model, 0.5)     # the global norm over every mesh
    opt.step()
    opt.zero_grad()


def _full(model, opt):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    out = {q: _full_t(p.detach()).clone() for q, p in model.named_parameters()}
    if isinstance(opt, ZeroRedundancyOptimizer):     # ZeRO-1: each rank's partition, gathered whole
        mine = {id(p) for g in opt.optim.param_groups for p in g["params"]}
        part = {f"{q}.{k}": v.clone() for q, p in model.named_parameters() if id(p) in mine
                for k, v in opt.optim.state[p].items()}
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, part)
        for d in parts:
            out.update(d)
    else:
        for q, p in model.named_parameters():
            for k, v in opt.state[p].items():
                out[f"{q}.{k}"] = _full_t(v).clone()
    return {k: v.numpy().copy() for k, v in out.items()}      # arrays: tensors would cross by fd


def _save_then_continue(rank, world, ck, name):
    """Train 2 steps under ``name``, save, crash two saves (every rank raising inside DCP's save,
    and after it before the commit), then one more step: the state to compare with."""
    import torch.distributed.checkpoint as dcp

    import autopar
    torch.set_default_dtype(torch.float64)
    model, r, dp = _build(world, name)
    opt = _opt(model)
    for s in range(2):
        _step(model, opt, r, dp, s)
    autopar.save(ck, model, opt, extra={"step": 2})
    saved = _full(model, opt)
    _step(model, opt, r, dp, 99)          # change the weights, then fail to save them
    real, outcomes = dcp.save, []
    for where in ("during", "after"):
        def crash(*a, **kw):
            if where == "after":
                real(*a, **kw)
            raise RuntimeError("simulated crash")
        dcp.save = crash
        try:
            autopar.save(ck, model, opt, extra={"step": 3})
        except RuntimeError as e:
            outcomes.append(str(e))
        finally:
            dcp.save = real
    return {"saved": saved, "outcomes": outcomes}


def _load_and_step(rank, world, ck, name):
    import autopar
    torch.set_default_dtype(torch.float64)
    model, r, dp = _build(world, name)
    opt = _opt(model)
    extra = autopar.load(ck, model, opt)
    loaded = _full(model, opt)
    _step(model, opt, r, dp, 2)
    return {"extra": extra, "loaded": loaded, "after": _full(model, opt)}


def _one_process(ck):
    """Load the checkpoint into a single-process model and take the same step."""
    from autopar.train import sharded
    torch.manual_seed(0)
    model = Tiny().double()          # in this (pytest's) process: the default dtype stays
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = sharded.state_dict(model, None)
    import torch.distributed.checkpoint as dcp
    from autopar.train.checkpoint import _data_dir
    dest = {k: v for k, v in sd.items() if k.startswith("model.")}
    dcp.load(dest, checkpoint_id=str(_data_dir(ck)), no_dist=True)
    with torch.no_grad():
        for q, p in model.named_parameters():
            p.copy_(dest[f"model.{q}"])
    return model


@pytest.mark.dist
def test_checkpoint_round_trip_between_sharded_tp_and_dp_at_other_world(tmp_path):
    from autopar.runtime.launch import run_ranks
    ck = tmp_path / "ck"
    saved = run_ranks(_save_then_continue, 4, args=(str(ck), "zero3"), start_method="fork", timeout_s=240)
    assert saved[0]["outcomes"] == ["simulated crash", "simulated crash"]
    want = saved[0]["saved"]
    # the crashed saves left LATEST on the first one: load it as sharded+TP at world 4, and as a
    # data-parallel unit beside a sharded one at world 2
    for world, name in ((4, "zero3+tp"), (2, "mixed-dp")):
        got = run_ranks(_load_and_step, world, args=(str(ck), name), start_method="fork", timeout_s=240)
        assert got[0]["extra"] == {"step": 2}
        for k, v in want.items():
            assert (got[0]["loaded"][k] == v).all(), (name, k)
        # one more step from the loaded state is the same function whatever the plan
        if world == 4:
            ref_after = got[0]["after"]
        else:
            for k, v in ref_after.items():
                assert abs(got[0]["after"][k] - v).max() < TOL, (name, k)
    # and the one-process model reads the same weights
    m = _one_process(ck)
    for q, p in m.named_parameters():
        assert (p.detach().numpy() == want[q]).all(), q


@pytest.mark.dist
def test_zero1_checkpoint_round_trip_to_zero1_and_zero3_at_another_world(tmp_path):
    """ZeRO-1 on DDP saved at world 2 (each rank writes its partition's optimizer state), two
    crashed saves after it; loaded as ZeRO-1 at world 4 (another partition) and as ZeRO-3 at world
    4: every parameter and optimizer state exactly as saved, and the next AdamW step the same."""
    from autopar.runtime.launch import run_ranks
    ck = tmp_path / "ck"
    saved = run_ranks(_save_then_continue, 2, args=(str(ck), "zero1-ddp"), start_method="fork", timeout_s=240)
    assert saved[0]["outcomes"] == ["simulated crash", "simulated crash"]
    want = saved[0]["saved"]
    assert any(k.endswith(".exp_avg") for k in want)
    afters = []
    for world, name in ((4, "zero1-ddp"), (4, "zero3")):
        got = run_ranks(_load_and_step, world, args=(str(ck), name), start_method="fork", timeout_s=240)
        assert got[0]["extra"] == {"step": 2}
        assert set(got[0]["loaded"]) == set(want), name
        for k, v in want.items():
            assert (got[0]["loaded"][k] == v).all(), (name, k)
        afters.append(got[0]["after"])
    for k, v in afters[0].items():
        assert abs(afters[1][k] - v).max() < TOL, k
    m = _one_process(ck)
    for q, p in m.named_parameters():
        assert (p.detach().numpy() == want[q]).all(), q


# ---- the planner: sharded data parallelism as a plan-level strategy --------------------------------

#: under the synthetic profile the shipped GPT's data-parallel plan needs 0.49 MiB per rank at world 4
LIMIT = 0.4 * 2**20


@pytest.fixture(scope="module")
def gpt_plans(tmp_path_factory, root=None):
    from pathlib import Path

    from fakes import synthetic_profile

    from autopar.artifacts import PlanOptions
    from autopar.planner import make_plan
    from autopar.profile import save_profile
    base = tmp_path_factory.mktemp("fsdp-plans")
    prof = base / "prof.json"
    save_profile(synthetic_profile(), prof)
    gpt = Path(__file__).resolve().parents[1] / "strategies/examples/gpt.py"
    out = {}
    for name, world, limit, kinds in (("free", 4, None, None), ("limited", 4, LIMIT, None),
                                      ("limited-w2", 2, 0.6 * 2**20, None), ("off", 4, LIMIT, ("sample", "replicate"))):
        try:
            out[name] = make_plan(gpt, PlanOptions(world_size=world, calibration=str(prof), out_dir=str(base / name),
                                                   memory_limit_bytes=limit, kinds=kinds))
        except AutoparError as e:
            out[name] = e
    return out


def test_sharded_plan_chosen_under_a_limit_data_parallelism_misses(gpt_plans):
    r = gpt_plans["limited"]
    plan = r.plan
    assert plan.runtime.expected == "fsdp"
    sh = dict(plan.runtime.extra)["sharded"]
    assert sh["axis"] == "dp" and sh["mesh"] == {"dp": 4} and sh["base"] == "native"
    decs = [Sharded.from_json(v) for v in sh["units"].values() if v is not None]
    assert decs and all(d.dp == 4 and d.check() is None for d in decs)
    assert plan.predicted.memory_per_rank_bytes <= LIMIT
    nat = next(s for s in plan.strategies if s.strategy == "native")
    assert nat.illegal and "over the memory limit" in nat.illegal
    assert any(s.chosen for s in plan.strategies if s.strategy == "sharded")


def test_sharded_listed_with_its_prediction_when_not_chosen_and_off_by_kinds(gpt_plans):
    free = gpt_plans["free"].plan
    sh = [s for s in free.strategies if s.strategy == "sharded"]
    assert sh and all(s.step_time_s is not None for s in sh)
    chosen = next(s for s in free.strategies if s.chosen)
    assert chosen.step_time_s <= min(s.step_time_s for s in free.strategies if s.illegal is None) * (1 + 1e-12)
    off = gpt_plans["off"]
    # without sharding, the per-layer kinds given cannot meet the limit, or the plan is traced
    if isinstance(off, AutoparError):
        assert "memory" in str(off).lower()
    else:
        assert off.plan.runtime.expected != "fsdp"
        assert any("leaves out sharded" in (s.illegal or "") for s in off.plan.strategies)


def test_zero1_offered_plan_wide_with_its_price(gpt_plans):
    """ZeRO-1 (DDP + ZeroRedundancyOptimizer) is listed beside the per-unit assignment, priced
    against the native data-parallel plan: memory less k (F - max_r P_r) exactly (the partition
    of the whole model's tensors), step plus the partition's step and broadcasts less the whole
    optimizer step (recomputed here from the formulas)."""
    from autopar.cost.native import choose_runtime, native_choice
    from autopar.cost.table import evaluate
    from autopar.planner.strategies.sharded import _Pricer
    from autopar.profile.optimizer import optimizer_step_s
    r = gpt_plans["free"]
    z = [s for s in r.plan.strategies if s.strategy == "sharded" and "ZeRO-1" in s.label]
    assert len(z) == 1 and z[0].illegal is None and "all" in z[0].label and "dp4" in z[0].label
    nat = next(s for s in r.plan.strategies if s.strategy == "native")
    table = r.table
    choice = native_choice(table)
    _, pred = choose_runtime(table, choice, evaluate, None)
    pr = _Pricer(table, tuple(choice), pred)
    params = pr.units.params
    k = table.ctx.optimizer_state_per_param
    F = sum(u.whole_bytes() for u in params)
    assert z[0].memory_per_rank_bytes == pytest.approx(nat.memory_per_rank_bytes - k * F
                                                       + zero1_memory_bytes(params, 4, k), rel=1e-12)
    assert z[0].memory_per_rank_bytes < nat.memory_per_rank_bytes
    prof = table.ctx.profile
    dp_opt = sum(optimizer_step_s(prof, u.n_tensors, u.whole_bytes()) or 0.0 for u in params)
    extra = zero1_step_s(params, 4, pr.coll, pr.opt)
    assert z[0].step_time_s == pytest.approx(nat.step_time_s + extra - dp_opt, rel=1e-9)


def test_sharded_plan_at_another_world_size_refused_naming_both(gpt_plans):
    from autopar.artifacts import load_plan
    from autopar.errors import PlanFileError
    with pytest.raises(PlanFileError, match="4.*2|2.*4"):
        load_plan(gpt_plans["limited"].plan_path, 2)


@pytest.mark.dist
def test_autopar_execute_validates_a_sharded_plan(gpt_plans, tmp_path):
    """``autopar execute`` of the world-2 sharded plan: float64 validation against one process,
    peak memory measured beside the prediction, plan / DDP and plan / FSDP2 timed."""
    from autopar.execute.runner import ExecuteOptions, execute
    r = gpt_plans["limited-w2"]
    assert r.plan.runtime.expected == "fsdp", [(s.strategy, s.illegal) for s in r.plan.strategies]
    run, out = execute(r.plan_path, ExecuteOptions(steps=3, warmup=1), out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed and run.validation.checked > 10
    sh = dict(run.extra)["sharded"]
    assert sh["measured_peak_bytes_per_rank"] > 0 and sh["ratio_to_fsdp2"] > 0 and sh["ratio_to_ddp"] > 0
    assert (out / "run.json").is_file()


def _user_loop(rank, world, plan_path, wrong_plan_path):
    """``autopar.parallelize`` of a sharded plan in a user's loop: AdamW, clipping, a scheduler,
    gradient accumulation over 2 micro-batches, against one process; LBFGS refused at its step;
    a plan for another world size refused naming both sizes."""
    import importlib.util

    import autopar
    import autopar.train
    from autopar.errors import PlanFileError
    spec = importlib.util.spec_from_file_location("gpt_example", Path_(plan_path).parents[0] / "gpt_model.py")
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    torch.manual_seed(0)
    ref = mf.build_model().double()
    model = mf.build_model().double()
    model.load_state_dict(ref.state_dict())
    out = {}
    try:
        autopar.parallelize(mf.build_model(), wrong_plan_path)
    except PlanFileError as e:
        out["wrong_world"] = str(e)
    model = autopar.parallelize(model, plan_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(3)
    batch = 4
    for step in range(2):
        for k in range(2):
            x = torch.randint(0, mf.VOCAB, (batch, mf.SEQ), generator=g)
            y = torch.randint(0, mf.VOCAB, (batch, mf.SEQ), generator=g)
            model.set_requires_gradient_sync(k == 1)
            (mf.loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]) / 2).backward()
            (mf.loss_fn(ref(x), y) / 2).backward()
        n = autopar.train.clip_grad_norm_(model, 0.1)
        rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        out.setdefault("norm_err", []).append(abs(n.item() - rn.item()))
        opt.step(); ropt.step(); sched.step(); rsched.step(); opt.zero_grad(); ropt.zero_grad()  # noqa: E702
    rp = dict(ref.named_parameters())
    out["param_err"] = max((p.detach().full_tensor() - rp[q].detach()).abs().max().item()
                           for q, p in model.named_parameters())
    bad = torch.optim.LBFGS(model.parameters())
    try:
        bad.step(lambda: mf.loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]))
    except AutoparError as e:
        out["lbfgs"] = str(e)
    return out


def Path_(p):
    from pathlib import Path
    return Path(p)


@pytest.mark.dist
def test_parallelize_sharded_plan_in_a_user_loop(gpt_plans, tmp_path):
    import shutil

    from autopar.runtime.launch import run_ranks
    r = gpt_plans["limited-w2"]
    shutil.copy(Path_(__file__).resolve().parents[1] / "strategies/examples/gpt.py", r.plan_path.parent / "gpt_model.py")
    res = run_ranks(_user_loop, 2, args=(str(r.plan_path), str(gpt_plans["limited"].plan_path)),
                    start_method="fork", timeout_s=240)
    for o in res:
        assert o["param_err"] < 1e-10 and max(o["norm_err"]) < 1e-10, o
        assert "LBFGS" in o["lbfgs"]
        assert "world size 4" in o["wrong_world"] and "2 ranks" in o["wrong_world"]


def test_step_peak_by_hand():
    from autopar.decomp.fsdp import step_peak_bytes
    root = UnitParams("<root>", ((100,),), itemsize=1)        # F = 100
    blk = UnitParams("b", ((400,),), itemsize=1)              # F = 400, S = 100 at 4 ranks
    z3 = Sharded(3, True, 4)
    # execution order: root (embedding), b, root (head); activations 10, 50, 5
    m = step_peak_bytes([root, blk], [z3, z3], 1.0, [0, 1, 0], [10.0, 50.0, 5.0])
    res = 3 * 25 + 3 * 100                                    # (param + grad + 1 state) x shard
    # forward: root gathered (100) throughout; in b: + b gathered (400) -> res + 60 + 500
    # backward in b: res + 60 + b gathered + b grad + root prefetched (100) = res + 60 + 900
    assert m.resident_bytes == res and m.activation_bytes == 65
    assert m.total_bytes == res + 60 + 900
    dp = step_peak_bytes([root, blk], [None, None], 1.0, [0, 1, 0], [10.0, 50.0, 5.0])
    assert dp.total_bytes == 3 * 500 + 65                     # everything whole, all activations


def _generated_step(rank, world, module_path, model_path):
    import importlib.util

    from torch.distributed.device_mesh import init_device_mesh
    mods = []
    for name, path in (("gen_sharded", module_path), ("gpt_model_g", model_path)):
        spec = importlib.util.spec_from_file_location(name, path)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        mods.append(m)
    gen, mf = mods
    torch.manual_seed(0)
    ref = mf.build_model().double()
    model = mf.build_model().double()
    model.load_state_dict(ref.state_dict())
    model = gen.parallelize(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    x = torch.randint(0, mf.VOCAB, (4, mf.SEQ), generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, mf.VOCAB, (4, mf.SEQ), generator=torch.Generator().manual_seed(6))
    opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    mf.loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    mf.loss_fn(ref(x), y).backward()
    opt.step()
    ropt.step()
    rp = dict(ref.named_parameters())
    return max((p.detach().full_tensor() - rp[q].detach()).abs().max().item() for q, p in model.named_parameters())


@pytest.mark.dist
def test_generated_module_is_a_readable_parallelize(gpt_plans):
    import shutil

    from autopar.runtime.launch import run_ranks
    r = gpt_plans["limited-w2"]
    text = r.module_path.read_text()
    assert "def parallelize(model, mesh):" in text and "fully_shard(model, mesh=" in text
    assert "self.op(" not in text                       # not an op-by-op interpreter
    model_copy = r.plan_path.parent / "gpt_model.py"
    shutil.copy(Path_(__file__).resolve().parents[1] / "strategies/examples/gpt.py", model_copy)
    errs = run_ranks(_generated_step, 2, args=(str(r.module_path), str(model_copy)), start_method="fork", timeout_s=240)
    assert max(errs) < 1e-10


def test_runtime_refuses_tied_units_and_tp_on_conv1d_naming_them():
    from autopar.runtime.fsdp import check_tied, check_tp_styles

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.blocks[1].weight = self.blocks[0].weight

    m = Tied()
    check_tied(m, [])                               # both users in the root: one owner
    with pytest.raises(AutoparError, match=r"blocks\.0\.weight.*blocks\.0.*blocks\.1\.weight.*blocks\.1"):
        check_tied(m, ["blocks.0", "blocks.1"])
    with pytest.raises(AutoparError, match=r"blocks\.1\.weight \(unit <root>\)"):
        check_tied(m, ["blocks.0"])                 # the root would manage blocks.0's shard again
    from transformers.pytorch_utils import Conv1D
    gpt2_like = nn.Sequential(Conv1D(12, 4))
    with pytest.raises(AutoparError, match="Conv1D.*colwise"):
        check_tp_styles(gpt2_like, {"0": "colwise"})
