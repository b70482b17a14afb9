"""Training with a plan in one's own loop (``autopar.train``), against one process, in float64.

20 steps of AdamW (weight decay) with global-norm clipping (that clips) and a LambdaLR
scheduler on a fixed synthetic data set of 40 samples (5 global batches of 8 per epoch,
shuffled per epoch with a seed), read through ``plan_loader`` (each rank loads only its
blocks), under a spatial + sample plan and a channel/filter plan at world 2 and 4: every
step's loss, every gradient norm, the parameters and buffers after 20 steps and the eval-mode
loss and accuracy equal the single-process run (``max|a-b| <= 1e-9 max|ref| + 1e-12``).
Each of those runs saves a checkpoint at step 10; runs that load it under another plan and
world size and do steps 10..19 match the uninterrupted run likewise. A save that crashes
leaves the previous checkpoint loadable. Bad input gives named errors.

The single-process reference runs in a fresh process too (rank processes are forked; the
parent does no torch compute before forking).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

RTOL, ATOL = 1e-9, 1e-12
N_DATA, BATCH, STEPS, SAVE_AT, SEED = 40, 8, 20, 10, 7
BN_GROUP = 2          # samples per batch-norm group: whole on a rank at world 2 and 4
MAX_NORM = 0.5

MODEL = """
import torch
from torch import nn
import torch.nn.functional as F

WIDTH = {width}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, WIDTH, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(WIDTH)
        self.c2 = nn.Conv2d(WIDTH, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)))
        y = F.relu(self.c2(y))
        y = F.adaptive_avg_pool2d(y, 1).flatten(1)
        return self.fc(y)

def build_model():
    return Net()

def example_inputs(b):
    return (torch.randn(b, 3, 12, 12),)

def example_targets(b):
    return torch.randint(0, 5, (b,))

def loss_fn(out, y):
    return F.cross_entropy(out, y)
"""

# layer 0: conv+bn+relu, 1: conv+relu, 2: pool, 3: flatten, 4: linear
PLANS = {
    "spatial-w2": (2, ("spatial", "sample", "replicate"), {0: "spatial(1,2x1)", 1: "spatial(1,2x1)"}),
    "spatial-w4": (4, ("spatial", "sample", "replicate"), {0: "spatial(2,2x1)", 1: "spatial(2,2x1)"}),
    "chanfilt-w2": (2, None, {0: "filter(1,2)", 1: "channel(1,2)", 4: "filter(1,2)"}),
    "chanfilt-w4": (4, None, {0: "channel_filter(1,2,2)", 1: "channel_filter(1,2,2)", 4: "filter(2,2)"}),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from fakes import synthetic_profile

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan

    base = tmp_path_factory.mktemp("train")
    mfile = base / "net.py"
    mfile.write_text(textwrap.dedent(MODEL.format(width=8)))
    plans = {}
    for name, (world, kinds, force) in PLANS.items():
        # local batch-norm statistics over groups of BN_GROUP samples: the same function under
        # every plan and world size (a resumed run continues the same function)
        r = make_plan(mfile, PlanOptions(world_size=world, batch_size=BATCH, out_dir=str(base / name), kinds=kinds,
                                         batch_norm="local", bn_group=BN_GROUP),
                      PlanHooks(profile=synthetic_profile(), force=force))
        plans[name] = r.plan_path
    return {"base": base, "model": mfile, "plans": plans, "profile": synthetic_profile()}


def _plan_choices(path):
    from autopar.artifacts import load_plan
    return [d.choice for d in load_plan(path).layers]


def test_plans_are_what_the_tests_need(setup):
    sp2, sp4 = _plan_choices(setup["plans"]["spatial-w2"]), _plan_choices(setup["plans"]["spatial-w4"])
    assert sp2[0].startswith("spatial") and sp4[0] == "spatial(2,2x1)"   # samples x spatial at world 4
    assert any(c.startswith("sample") for c in sp2 + sp4)
    cf = _plan_choices(setup["plans"]["chanfilt-w2"]) + _plan_choices(setup["plans"]["chanfilt-w4"])
    assert {"filter(1,2)", "channel(1,2)", "channel_filter(1,2,2)"} <= set(cf)


# ---------------------------------------------------------------------------------------------
# what runs in the processes
# ---------------------------------------------------------------------------------------------
def _data():
    import torch
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N_DATA, 3, 12, 12, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (N_DATA,), generator=g)
    return x, y


class _DS:
    """A map-style data set (``torch.utils.data.Dataset`` protocol)."""

    def __init__(self):
        self.x, self.y = _data()

    def __len__(self):
        return N_DATA

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _schedule(step):
    return 1.0 / (1.0 + 0.2 * step)


def _optimizer(params):
    import torch
    return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)


def _model(mfile):
    import torch

    from autopar.modelfile import load_model_file
    torch.manual_seed(0)
    return load_model_file(mfile).build_model().double()


def _eval_metrics(loss_and_correct):
    return {"eval_loss": float(loss_and_correct[0]), "eval_correct": float(loss_and_correct[1])}


def _reference(rank, world, mfile):
    """One process, plain torch with batch norm over groups of BN_GROUP samples ("ghost" batch
    norm, the plans' statistics): the run every distributed run must reproduce."""
    from autopar.execute.validate import ghost_batch_norm
    with ghost_batch_norm(BN_GROUP):
        return _reference_steps(mfile)


def _reference_steps(mfile):
    import torch
    import torch.nn.functional as F
    model = _model(mfile)
    opt = _optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    x, y = _data()
    losses, norms, step = [], [], 0
    while step < STEPS:
        epoch = step // (N_DATA // BATCH)
        perm = torch.randperm(N_DATA, generator=torch.Generator().manual_seed(SEED + epoch))
        for k in range(N_DATA // BATCH):
            idx = perm[k * BATCH:(k + 1) * BATCH]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            sched.step()
            losses.append(float(loss))
            step += 1
    model.eval()
    with torch.no_grad():
        out = model(x[:BATCH])
        ev = (F.cross_entropy(out, y[:BATCH]), (out.argmax(1) == y[:BATCH]).sum())
    names = {id(p): n for n, p in model.named_parameters()}
    opt_state = {names[id(p)]: {k: v.tolist() for k, v in st.items()} for p, st in opt.state.items()}
    state = {k: v.detach().tolist() for k, v in model.state_dict().items()}   # lists: tensors do not
    # survive the queue once the process has exited
    return {"losses": losses, "norms": norms, "state": state, "opt_state": opt_state, **_eval_metrics(ev)}


def _train(rank, world, plan, mfile, ckpt_in, ckpt_out):
    """Steps (from the checkpoint's, if any) to STEPS under ``plan`` with autopar.train."""
    import torch

    import autopar
    from autopar import train
    dm = autopar.parallelize(_model(mfile), plan)
    opt = _optimizer(dm.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    loader = autopar.plan_loader(_DS(), dm, seed=SEED)
    start = 0
    if ckpt_in is not None:
        extra = autopar.load(ckpt_in, dm, opt)
        sched.load_state_dict(extra["scheduler"])
        start = extra["step"]
    losses, norms, step = {}, {}, 0
    per_epoch = len(loader)
    while step < STEPS:
        loader.batch_sampler.set_epoch(step // per_epoch)
        for inputs, target in loader:
            if step >= start:
                opt.zero_grad()
                loss = dm.loss(inputs, target)
                loss.backward()
                norms[step] = float(train.clip_grad_norm_(dm, MAX_NORM))
                opt.step()
                sched.step()
                losses[step] = loss.item()
            step += 1
            if step == SAVE_AT and ckpt_out is not None:
                autopar.save(ckpt_out, dm, opt, extra={"scheduler": sched.state_dict(), "step": step})
    dm.eval()
    x, y = _data()
    with torch.no_grad():
        xs, t = autopar.shard_batch(dm, x[:BATCH], y[:BATCH])
        out = dm(*xs)
        loss = dm.reduce_loss(torch.nn.functional.cross_entropy(out, t))
        correct = dm.reduce_sum((out.argmax(1) == t).sum())
    state = {k: v.tolist() for k, v in autopar.full_state_dict(dm).items()}
    opt_state = {q: {k: v.tolist() for k, v in st.items()}
                 for q, st in train.full_optimizer_state_dict(dm, opt)["state"].items()}
    if rank != 0:
        return None
    return {"losses": [losses[s] for s in sorted(losses)], "norms": [norms[s] for s in sorted(norms)],
            "state": state, "opt_state": opt_state, **_eval_metrics((loss, correct))}


def _close(a, b):
    import torch
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) <= RTOL * float(b.abs().max()) + ATOL


def _assert_matches(got, ref, first_step=0):
    assert _close(got["losses"], ref["losses"][first_step:]), (got["losses"], ref["losses"][first_step:])
    assert _close(got["norms"], ref["norms"][first_step:]), (got["norms"], ref["norms"][first_step:])
    assert max(ref["norms"][first_step:]) > MAX_NORM, "clipping never clipped: the test tests nothing"
    bad = [k for k in ref["state"] if not _close(got["state"][k], ref["state"][k])]
    assert set(got["state"]) == set(ref["state"]) and not bad, bad
    # the optimizer state (AdamW's exp_avg, exp_avg_sq, step), sharded with the weights
    assert set(got["opt_state"]) == set(ref["opt_state"])
    bad = [(q, k) for q, st in ref["opt_state"].items() for k in st
           if not _close(got["opt_state"][q][k], st[k])]
    assert not bad, bad
    assert abs(got["eval_loss"] - ref["eval_loss"]) <= RTOL * abs(ref["eval_loss"])
    assert got["eval_correct"] == ref["eval_correct"]


@pytest.fixture(scope="module")
def reference(setup):
    from autopar.runtime.launch import run_ranks
    return run_ranks(_reference, 1, args=(str(setup["model"]),), timeout_s=180)[0]


@pytest.fixture(scope="module")
def runs(setup):
    """Each plan's uninterrupted run (saving at step 10 into ckpt-<plan>), run once."""
    return {}


def _uninterrupted(setup, runs, name):
    from autopar.runtime.launch import run_ranks
    if name not in runs:
        world = PLANS[name][0]
        ck = setup["base"] / f"ckpt-{name}"
        runs[name] = run_ranks(_train, world, args=(str(setup["plans"][name]), str(setup["model"]), None, str(ck)),
                               timeout_s=300)[0]
    return runs[name]



@pytest.mark.dist
@pytest.mark.parametrize("name", list(PLANS))
def test_training_matches_one_process(name, setup, reference, runs):
    _assert_matches(_uninterrupted(setup, runs, name), reference)


@pytest.mark.dist
@pytest.mark.parametrize("saved, resumed", [("spatial-w2", "chanfilt-w4"), ("chanfilt-w4", "spatial-w2"),
                                            ("chanfilt-w2", "spatial-w4")])
def test_resume_under_another_plan_and_world(saved, resumed, setup, reference, runs):
    from autopar.runtime.launch import run_ranks
    _uninterrupted(setup, runs, saved)            # writes ckpt-<saved> at step 10
    ck = setup["base"] / f"ckpt-{saved}"
    world = PLANS[resumed][0]
    got = run_ranks(_train, world, args=(str(setup["plans"][resumed]), str(setup["model"]), str(ck), None),
                    timeout_s=300)[0]
    assert len(got["losses"]) == STEPS - SAVE_AT
    _assert_matches(got, reference, first_step=SAVE_AT)


# ---------------------------------------------------------------------------------------------
# atomic save
# ---------------------------------------------------------------------------------------------
def _crashing_save(rank, world, plan, mfile, ck):
    import torch
    import torch.distributed.checkpoint as dcp

    import autopar
    from autopar.train import checkpoint
    dm = autopar.parallelize(_model(mfile).float(), plan).double()    # .to() after parallelize
    opt = _optimizer(dm.parameters())
    xs, t = autopar.shard_batch(dm, _data()[0][:BATCH], _data()[1][:BATCH])
    dm.loss(xs, t).backward()
    opt.step()
    autopar.save(ck, dm, opt, extra={"step": 1})
    first = {k: v.clone() for k, v in autopar.full_state_dict(dm).items()}
    opt.step()                                  # change the weights, then crash while saving them
    real = dcp.save
    outcomes = []
    for where in ("during the write", "after the write, before the commit"):
        def crash(*a, **kw):
            if where == "during the write":
                raise RuntimeError("simulated crash")
            real(*a, **kw)
            raise RuntimeError("simulated crash")
        dcp.save = crash
        try:
            autopar.save(ck, dm, opt, extra={"step": 2})
        except RuntimeError as e:
            outcomes.append(str(e))
        finally:
            dcp.save = real
    dm2 = autopar.parallelize(_model(mfile), plan)
    opt2 = _optimizer(dm2.parameters())
    extra = autopar.load(ck, dm2, opt2)
    again = autopar.full_state_dict(dm2)
    same = all(torch.equal(again[k], first[k]) for k in first)
    stale = sorted(p.name for p in Path(ck).iterdir() if p.name.startswith("ckpt-"))
    autopar.save(ck, dm2, opt2, extra={"step": 3})           # a good save removes the stale data
    after = sorted(p.name for p in Path(ck).iterdir() if p.name.startswith("ckpt-"))
    # the single-process optimizer state dict round-trips into a fresh optimizer
    from autopar import train
    osd = train.full_optimizer_state_dict(dm2, opt2)
    opt3 = _optimizer(dm2.parameters())
    train.load_full_optimizer_state_dict(dm2, opt3, osd)
    osd3 = train.full_optimizer_state_dict(dm2, opt3)
    same_opt = all(torch.equal(osd3["state"][q][k], v) for q, st in osd["state"].items() for k, v in st.items())
    return {"outcomes": outcomes, "extra": extra, "same": same and same_opt, "has_state": len(opt2.state) > 0,
            "stale": len(stale), "after": len(after), "checkpoint": checkpoint.LATEST}


@pytest.mark.dist
def test_crash_during_save_leaves_previous_checkpoint_loadable(setup):
    from autopar.runtime.launch import run_ranks
    ck = setup["base"] / "ckpt-crash"
    r = run_ranks(_crashing_save, 2, args=(str(setup["plans"]["spatial-w2"]), str(setup["model"]), str(ck)),
                  timeout_s=180)[0]
    assert r["outcomes"] == ["simulated crash", "simulated crash"]
    assert r["extra"] == {"step": 1} and r["same"] and r["has_state"]
    assert r["stale"] >= 1 and r["after"] == 1   # the crash after the write left its data


# ---------------------------------------------------------------------------------------------
# bad input (no process group)
# ---------------------------------------------------------------------------------------------
def test_parallelize_outside_a_process_group_says_what_to_do(setup):
    import autopar
    from autopar.errors import AutoparError
    with pytest.raises(AutoparError) as e:
        autopar.parallelize(_model(setup["model"]), setup["plans"]["spatial-w2"])
    assert "torchrun --nproc-per-node 2" in str(e.value) and "init_distributed" in str(e.value)


def test_plan_for_another_world_size_says_what_to_do(setup):
    import autopar
    from autopar.errors import PlanFileError
    from autopar.runtime.comm import Comm
    with pytest.raises(PlanFileError) as e:
        autopar.parallelize(_model(setup["model"]), setup["plans"]["spatial-w2"], comm=Comm(0, 1))
    assert "world size 2" in str(e.value) and "--world-size 1" in str(e.value)


def test_changed_model_file_or_other_model_is_named(setup, tmp_path):
    import autopar
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.errors import PlanFileError
    from autopar.planner import make_plan
    from autopar.train import ModelMismatch
    f = tmp_path / "net.py"
    f.write_text(textwrap.dedent(MODEL.format(width=8)))
    r = make_plan(f, PlanOptions(world_size=1, batch_size=BATCH, out_dir=str(tmp_path / "w1")),
                  PlanHooks(profile=setup["profile"]))
    wide = tmp_path / "wide.py"
    wide.write_text(textwrap.dedent(MODEL.format(width=6)))
    with pytest.raises(ModelMismatch) as e:
        autopar.parallelize(_model(wide), r.plan_path)
    assert "c1.weight has shape (6, 3, 3, 3), expected (8, 3, 3, 3)" in str(e.value)
    f.write_text(f.read_text() + "\n# edited\n")
    with pytest.raises(PlanFileError) as e:
        autopar.parallelize(_model(wide), r.plan_path)
    assert "changed since" in str(e.value) and "re-plan" in str(e.value)


@pytest.mark.dist
def test_checkpoint_of_another_model_is_named(setup, tmp_path, runs):
    import autopar
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.train import ModelMismatch
    from autopar.train.checkpoint import check_checkpoint
    _uninterrupted(setup, runs, "spatial-w2")
    other = tmp_path / "other.py"
    other.write_text(textwrap.dedent(MODEL.format(width=6)))
    r = make_plan(other, PlanOptions(world_size=1, batch_size=BATCH, out_dir=str(tmp_path / "w1")),
                  PlanHooks(profile=setup["profile"]))
    dm = autopar.parallelize(_model(other), r.plan_path)
    with pytest.raises(ModelMismatch) as e:
        check_checkpoint(setup["base"] / "ckpt-spatial-w2", dm)
    msg = str(e.value)
    assert "another model" in msg and "c1.weight has shape (8, 3, 3, 3), expected (6, 3, 3, 3)" in msg
    with pytest.raises(ModelMismatch):
        autopar.load(setup["base"] / "ckpt-spatial-w2", dm)
    missing = tmp_path / "nothing"
    from autopar.train import CheckpointError
    with pytest.raises(CheckpointError):
        autopar.load(missing, dm)


def test_full_state_dict_round_trip_at_world_1(setup, tmp_path):
    import torch

    import autopar
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.train import ModelMismatch
    r = make_plan(setup["model"], PlanOptions(world_size=1, batch_size=BATCH, out_dir=str(tmp_path / "w1")),
                  PlanHooks(profile=setup["profile"]))
    model = _model(setup["model"])
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    dm = autopar.parallelize(model, r.plan_path)
    sd = autopar.full_state_dict(dm)
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    sd["fc.bias"] = sd["fc.bias"] + 1
    autopar.load_full_state_dict(dm, sd)
    assert torch.equal(autopar.full_state_dict(dm)["fc.bias"], ref["fc.bias"] + 1)
    del sd["fc.bias"]
    with pytest.raises(ModelMismatch, match="fc.bias missing"):
        autopar.load_full_state_dict(dm, sd)


# ---------------------------------------------------------------------------------------------
# data helper and eval mode: pure
# ---------------------------------------------------------------------------------------------
def _sharding(rank, world=4):
    from autopar.decomp.sharding import Partial, Shard, Sharding
    from autopar.train import BatchSharding
    return BatchSharding(batch_size=BATCH, input_shapes=((BATCH, 3, 12, 12),),
                         input_layouts=(Sharding.of((Shard(0), 2), (Shard(2), 2)),), target_layout=Sharding.of((Shard(0), 4)),
                         rank=rank, world=world)


def test_batch_sharding_covers_the_batch_once_per_replica():
    import torch
    from autopar.train import shard_batch
    x = torch.arange(BATCH * 3 * 12 * 12, dtype=torch.float64).reshape(BATCH, 3, 12, 12)
    y = torch.arange(BATCH)
    seen = torch.zeros_like(x)
    ys = []
    for r in range(4):
        sh = _sharding(r)
        (xl,), t = shard_batch(sh, x, y)
        seen[sh.input_slices(0)] += 1
        assert torch.equal(xl, x[sh.input_slices(0)])
        ys.extend(t.tolist())
        assert sh.samples_needed() == sorted(set(range(sh.input_slices(0)[0].start, sh.input_slices(0)[0].stop))
                                             | set(range(sh.target_samples().start, sh.target_samples().stop)))
    assert bool((seen == 1).all())                 # N2 x H2 at world 4: no replicas
    assert sorted(ys) == list(range(BATCH))        # target N4
    assert "spatial" in _sharding(1).describe()[0]


def test_sampler_epochs_seed_drop_last_and_collate():
    import torch
    from autopar.train.data import PlanSampler, _Collate
    ds = _DS()
    n = 43                                          # 3 samples dropped per epoch
    per_rank = [PlanSampler(n, _sharding(r), seed=SEED) for r in range(4)]
    assert len(per_rank[0]) == n // BATCH == 5
    s = per_rank[0]
    for epoch in (0, 1):
        s.set_epoch(epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        assert [s.global_batch(k) for k in range(len(s))] == [perm[k * BATCH:(k + 1) * BATCH] for k in range(5)]
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    assert list(s) != e0
    assert list(PlanSampler(n, _sharding(0), shuffle=False))[0] == [0, 1, 2, 3]
    # collate: this rank's blocks of the global batch, as shard_batch cuts them
    from autopar.train import shard_batch
    s.set_epoch(0)
    for r in range(4):
        sr = per_rank[r]
        sr.set_epoch(0)
        idx = next(iter(sr))
        batch = sr.global_batch(0)
        xs, t = _Collate(_sharding(r))([ds[i % N_DATA] for i in idx])
        want, wt = shard_batch(_sharding(r), ds.x[[i % N_DATA for i in batch]], ds.y[[i % N_DATA for i in batch]])
        assert torch.equal(xs[0], want[0]) and torch.equal(t, wt)


def test_eval_mode_turns_off_batch_statistics_and_dropout():
    from autopar.decomp.ir import OpSpec
    from autopar.train.api import _mode_spec
    bn = OpSpec(name="b", kind="batch_norm", target="aten.batch_norm.default",
                args=[{"v": "x"}, None, None, None, None, True, 0.1, 1e-5], kwargs={}, out_shape=[2],
                dtype="float32", inputs=["x"], in_shapes=[[2]], params={}, param_names={},
                attrs={"training": True})
    drop = OpSpec(name="d", kind="dropout", target="aten.dropout.default", args=[{"v": "x"}, 0.5, True],
                  kwargs={}, out_shape=[2], dtype="float32", inputs=["x"], in_shapes=[[2]], params={},
                  param_names={})
    assert _mode_spec(bn, False).args[5] is False and _mode_spec(bn, False).attrs["training"] is False
    assert _mode_spec(drop, False).args[2] is False
    assert bn.args[5] is True                       # the traced spec is not changed


def test_train_package_is_runtime_side():
    """``import autopar`` loads no torch; autopar.train loads no planning module (fresh interpreter)."""
    import json
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    code = ("import sys, json, autopar; a = 'torch' in sys.modules; import autopar.train; "
            "print(json.dumps([a, sorted(m for m in sys.modules if m.startswith(('autopar.cost', 'autopar.solve', "
            "'autopar.trace', 'autopar.calibrate', 'autopar.planner', 'autopar.codegen', 'pulp', 'highspy')))]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    torch_loaded, planning = json.loads(out.stdout.strip().splitlines()[-1])
    assert not torch_loaded and planning == []


@pytest.mark.dist
def test_example_script_trains_under_torchrun(root, tmp_path, profile):
    """strategies/examples/train_resnet2d.py, as the README runs it (one short epoch)."""
    import json
    import os
    import subprocess
    import sys

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    r = make_plan(root / "strategies/examples/resnet2d.py",
                  PlanOptions(world_size=2, out_dir=str(tmp_path / "plan")), PlanHooks(profile=profile))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2",
           str(root / "strategies/examples/train_resnet2d.py"), "--plan", str(r.plan_path), "--epochs", "1",
           "--train-samples", "48", "--eval-samples", "16", "--ckpt", str(tmp_path / "ckpt")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(s) for s in out.stdout.splitlines() if s.startswith("{")]
    assert lines[0]["world"] == 2 and lines[-1]["epoch"] == 0 and 0 <= lines[-1]["eval_accuracy"] <= 1
    assert (tmp_path / "ckpt" / "LATEST").is_file()


# ---------------------------------------------------------------------------------------------
# bf16 autocast (CPU + gloo here; the same check on CUDA + NCCL where there is a GPU)
# ---------------------------------------------------------------------------------------------
#: Stated tolerances under bf16 autocast, against the float32 single-process step: the loss
#: within BF16_LOSS_RTOL (relative), every parameter gradient within BF16_GRAD_RTOL of its
#: largest magnitude. bf16 keeps 8 significant bits: on this net one process's own autocast
#: gradients differ from its float32 ones by up to 0.09 of the max (measured, c1.weight), and a
#: plan adds its own rounding (partial sums of channel parallelism reduced in bf16; blocked
#: batch-norm statistics), measured up to 0.07 against one process's autocast.
BF16_LOSS_RTOL, BF16_GRAD_RTOL = 2e-3, 0.2


def _bf16_step(rank, world, plan, mfile, device):
    import torch
    import torch.nn.functional as F

    import autopar
    from autopar.modelfile import load_model_file
    dev = torch.device(device, rank % max(1, torch.cuda.device_count())) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = load_model_file(mfile).build_model().to(dev)
    x, y = _data()
    x, y = x[:BATCH].float(), y[:BATCH]
    dm = autopar.parallelize(model, plan)
    xs, t = autopar.shard_batch(dm, x, y)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        loss = dm.loss([v.to(dev) for v in xs], t.to(dev))
    loss.backward()
    grads = {k: v.cpu().tolist() for k, v in dm.full_grads().items()}
    if rank != 0:
        return None
    from autopar.execute.validate import ghost_batch_norm
    torch.manual_seed(0)
    ref = load_model_file(mfile).build_model().to(dev)
    with ghost_batch_norm(BN_GROUP):          # the plans' batch-norm statistics
        ref_loss = F.cross_entropy(ref(x.to(dev)), y.to(dev))
    ref_loss.backward()
    ref_loss = ref_loss.item()
    return {"loss": loss.item(), "grads": grads, "ref_loss": ref_loss,
            "ref_grads": {k: p.grad.cpu().tolist() for k, p in ref.named_parameters()}}


def _check_bf16(r):
    import torch
    assert abs(r["loss"] - r["ref_loss"]) <= BF16_LOSS_RTOL * abs(r["ref_loss"]), (r["loss"], r["ref_loss"])
    for k, ref in r["ref_grads"].items():
        a, b = torch.tensor(r["grads"][k]), torch.tensor(ref)
        assert float((a - b).abs().max()) <= BF16_GRAD_RTOL * float(b.abs().max()), k


@pytest.mark.dist
@pytest.mark.parametrize("name", ["spatial-w2", "chanfilt-w4"])
def test_bf16_autocast_within_stated_tolerance(name, setup):
    from autopar.runtime.launch import run_ranks
    world = PLANS[name][0]
    r = run_ranks(_bf16_step, world, args=(str(setup["plans"][name]), str(setup["model"]), "cpu"), timeout_s=180)[0]
    _check_bf16(r)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_bf16_autocast_on_cuda(setup):
    import torch

    from autopar.runtime.launch import run_ranks
    world = min(2, torch.cuda.device_count())
    name = "spatial-w2" if world == 2 else None
    if name is None:
        pytest.skip("needs 2 GPUs")
    r = run_ranks(_bf16_step, world, args=(str(setup["plans"][name]), str(setup["model"]), "cuda"),
                  backend="nccl", timeout_s=300)[0]
    _check_bf16(r)


# ---------------------------------------------------------------------------------------------
# dmodel.state_dict() with torch.distributed.checkpoint directly (the FSDP2 + DCP flow)
# ---------------------------------------------------------------------------------------------
def _dcp_flow(rank, world, plan, mfile, ck, mode):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    import autopar
    dm = autopar.parallelize(_model(mfile), plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)      # ShardedTensor's deprecation notice
        if mode == "save":
            with torch.no_grad():                           # a state no fresh model has
                for p in dm.parameters():
                    p.mul_(-2.0).add_(0.25)
            for b in dm.bufs.values():
                if b.is_floating_point():
                    b.add_(1.5)
            dcp.save(dm.state_dict(), checkpoint_id=ck)
        else:
            sd = dm.state_dict()
            dcp.load(sd, checkpoint_id=ck)
            dm.load_state_dict(sd)
    return {k: v.tolist() for k, v in autopar.full_state_dict(dm).items()}


@pytest.mark.dist
def test_state_dict_with_dcp_directly_moves_between_plans(setup):
    from autopar.runtime.launch import run_ranks
    ck = str(setup["base"] / "dcp-direct")
    saved = run_ranks(_dcp_flow, 2, args=(str(setup["plans"]["chanfilt-w2"]), str(setup["model"]), ck, "save"),
                      timeout_s=180)
    for name in ("spatial-w4", "chanfilt-w4"):
        got = run_ranks(_dcp_flow, 4, args=(str(setup["plans"][name]), str(setup["model"]), ck, "load"),
                        timeout_s=180)
        for r in range(4):
            assert got[r] == saved[0], (name, r)


# ---------------------------------------------------------------------------------------------
# gradient accumulation (FSDP2's set_requires_gradient_sync)
# ---------------------------------------------------------------------------------------------
def _accumulate(rank, world, plan, mfile):
    import torch.nn.functional as F

    import autopar
    x, y = _data()
    batches = [(x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH]) for k in range(3)]
    dm = autopar.parallelize(_model(mfile), plan)
    for k, (xb, yb) in enumerate(batches):
        dm.set_requires_gradient_sync(k == len(batches) - 1)
        xs, t = autopar.shard_batch(dm, xb, yb)
        (dm.loss(xs, t) / len(batches)).backward()
    grads = {q: g.tolist() for q, g in dm.full_grads().items()}
    if rank != 0:
        return None
    from autopar.execute.validate import ghost_batch_norm
    ref = _model(mfile)
    with ghost_batch_norm(BN_GROUP):          # the plans' batch-norm statistics
        for xb, yb in batches:
            (F.cross_entropy(ref(xb), yb) / len(batches)).backward()
    return grads, {q: p.grad.tolist() for q, p in ref.named_parameters()}


@pytest.mark.dist
def test_gradient_accumulation_without_sync_matches_one_process(setup):
    from autopar.runtime.launch import run_ranks
    grads, ref = run_ranks(_accumulate, 2, args=(str(setup["plans"]["chanfilt-w2"]), str(setup["model"])),
                           timeout_s=180)[0]
    bad = [q for q in ref if not _close(grads[q], ref[q])]
    assert not bad, bad


_HF_SMALL = {"AUTOPAR_HF_LAYERS": "2", "AUTOPAR_HF_EMBED": "16", "AUTOPAR_HF_HEADS": "4", "AUTOPAR_HF_SEQ": "8",
             "AUTOPAR_HF_VOCAB": "32"}


def _tied_state_dict(rank, world, plan):
    import torch as t

    import autopar
    from autopar.modelfile import load_model_file
    from autopar.train import full_state_dict, load_full_state_dict
    mf = load_model_file(Path(__file__).resolve().parents[1] / "strategies/examples/hf_gpt2.py")
    t.manual_seed(1)
    model = mf.build_model().double()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dm = autopar.parallelize(model, plan)
    got = full_state_dict(dm)
    fresh = mf.build_model().double()
    fresh.load_state_dict(got, strict=True)          # what a user exports must load back strictly
    other = {k: v + 0.25 if v.is_floating_point() else v for k, v in want.items()}
    load_full_state_dict(dm, other)                  # a single-process state_dict, alias and all
    back = full_state_dict(dm)
    return {"keys": sorted(got) == sorted(want), "values": all(t.equal(got[k], want[k]) for k in want),
            "round_trip": all(t.equal(back[k], other[k]) for k in other)}


@pytest.mark.dist
def test_full_state_dict_keeps_a_tied_weights_every_name(tmp_path, monkeypatch):
    """HF GPT-2's head is its embedding (one tensor, two names in state_dict()): under a plan at
    world 2, full_state_dict lists both names (so a fresh model loads it strictly) and
    load_full_state_dict takes a single-process state_dict with both."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.profile import load_profile
    from autopar.runtime.launch import run_ranks
    for k, v in _HF_SMALL.items():
        monkeypatch.setenv(k, v)
    root = Path(__file__).resolve().parents[1]
    prof = load_profile(root / "calibration/cpu-2core-gloo.json", check_machine=False)
    res = make_plan(root / "strategies/examples/hf_gpt2.py",
                    PlanOptions(world_size=2, batch_size=8, placement="block", trace_cache=False,
                                out_dir=str(tmp_path / "plan")), PlanHooks(profile=prof))
    for r in run_ranks(_tied_state_dict, 2, args=(str(res.plan_path),), timeout_s=180):
        assert r == {"keys": True, "values": True, "round_trip": True}, r
