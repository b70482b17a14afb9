"""The training API returns what the user's model returns (issue 38, item 1b).

A model may return a tensor, a tuple, a dict or a Hugging Face ``ModelOutput``, and its model
file's ``loss_fn`` reads the output accordingly (``out.logits``, ``out[0]``, ``out["logits"]``).
Under each runtime at world 2 -- the native data-parallel path (the user's module on each rank's
samples), the op-by-op runtime (the same data-parallel plan with ``AUTOPAR_NATIVE=0``) and a
tensor-parallel plan (filter then channel split of the two linear layers, op by op) -- for
every structure, in float64 against one process (``max|a-b| <= 1e-9 max|ref| + 1e-12``):

* ``dmodel(x)`` returns the same type as the model, holding the same constants, whose tensor is
  this rank's block of the single-process output;
* ``dmodel.loss(inputs, target)`` (the model file's loss, fed that structure) is the
  single-process loss and its backward gives every single-process gradient.

Before the fix ``dmodel.loss`` fed the loss the output's first tensor: ``out.logits`` raised
AttributeError, ``out["logits"]`` an IndexError, and ``out[0]`` silently read one row.
"""

from __future__ import annotations

import textwrap

import pytest

RTOL, ATOL = 1e-9, 1e-12
BATCH, WORLD = 4, 2

MODEL = """
import torch
from torch import nn
import torch.nn.functional as F
{imports}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(x)))
        return {ret}

def build_model():
    return Net()

def example_inputs(b):
    return (torch.randn(b, 6),)

def example_targets(b):
    return torch.randint(0, 4, (b,))

def loss_fn(out, y):
    return F.cross_entropy({read}, y)
"""

#: structure -> (imports, what forward returns, what the loss reads)
STRUCTURES = {
    "tensor": ("", "y", "out"),
    "tuple": ("", "(y, 3)", "out[0]"),
    "dict": ("", '{"logits": y, "scale": 2.0}', 'out["logits"]'),
    "model_output": ("from transformers.modeling_outputs import CausalLMOutput", "CausalLMOutput(logits=y)",
                     "out.logits"),
}
RUNTIMES = ("native", "op_by_op", "tensor_parallel")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("transformers")
    from fakes import synthetic_profile

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan

    base = tmp_path_factory.mktemp("outputs")
    out = {}
    for name, (imports, ret, read) in STRUCTURES.items():
        mfile = base / f"{name}.py"
        mfile.write_text(textwrap.dedent(MODEL.format(imports=imports, ret=ret, read=read)))
        dp = make_plan(mfile, PlanOptions(world_size=WORLD, batch_size=BATCH, out_dir=str(base / f"{name}-dp"),
                                          kinds=["sample"]), PlanHooks(profile=synthetic_profile()))
        tp = make_plan(mfile, PlanOptions(world_size=WORLD, batch_size=BATCH, out_dir=str(base / f"{name}-tp")),
                       PlanHooks(profile=synthetic_profile(), force={0: "filter(1,2)", 1: "channel(1,2)"}))
        assert [d.choice for d in tp.plan.layers] == ["filter(1,2)", "channel(1,2)"]
        assert {d.choice for d in dp.plan.layers} <= {"sample(2)", "replicate"}
        out[name] = {"model": str(mfile), "native": str(dp.plan_path), "op_by_op": str(dp.plan_path),
                     "tensor_parallel": str(tp.plan_path)}
    return out


def _summary(out):
    """(type name, the constants, the tensor) of a model output."""
    import torch
    import torch.utils._pytree as pytree
    leaves = pytree.tree_leaves(out) if not isinstance(out, torch.Tensor) else [out]
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    consts = [v for v in leaves if not isinstance(v, torch.Tensor)]
    keys = list(out.keys()) if isinstance(out, dict) else None
    return type(out).__qualname__, keys, consts, tensors


def _run(rank, world, cases, runtime):
    """Each structure's dmodel(x), loss and gradients under ``runtime``; the single process's on rank 0."""
    import os

    import torch

    import autopar
    from autopar.modelfile import load_model_file
    g = torch.Generator().manual_seed(5)
    x = torch.randn(BATCH, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (BATCH,), generator=g)
    res = {}
    for name, case in cases.items():
        mf = load_model_file(case["model"])
        torch.manual_seed(0)
        model = mf.build_model().double()
        if runtime == "op_by_op":
            os.environ["AUTOPAR_NATIVE"] = "0"
        try:
            dm = autopar.parallelize(model, case[runtime])
        finally:
            os.environ.pop("AUTOPAR_NATIVE", None)
        assert dm.native == (runtime == "native"), (runtime, dm.native_off_reason)
        xs, t = autopar.shard_batch(dm, x, y)
        kind, keys, consts, tensors = _summary(dm(*xs))
        rows = autopar.train.BatchSharding.of(dm).target_samples()
        loss = dm.loss(xs, t)
        loss.backward()
        grads = {q: v.tolist() for q, v in dm.full_grads().items()}
        res[name] = {"type": kind, "keys": keys, "consts": consts, "n_tensors": len(tensors),
                     "out": tensors[0].detach().tolist(), "rows": (rows.start, rows.stop),
                     "loss": loss.item(), "grads": grads}
        if rank == 0:
            torch.manual_seed(0)
            ref = mf.build_model().double()
            rout = ref(x)
            rloss = mf.loss_fn()(rout, y)
            rloss.backward()
            kind, keys, consts, tensors = _summary(rout)
            res[name]["ref"] = {"type": kind, "keys": keys, "consts": consts, "out": tensors[0].detach().tolist(),
                                "loss": rloss.item(), "grads": {q: p.grad.tolist() for q, p in ref.named_parameters()}}
    return res


def _close(a, b):
    import torch
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) <= RTOL * float(b.abs().max()) + ATOL


@pytest.mark.dist
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_training_api_returns_what_the_model_returns(runtime, setup):
    from autopar.runtime.launch import run_ranks
    got = run_ranks(_run, WORLD, args=(setup, runtime), timeout_s=240)
    ref = {name: got[0][name]["ref"] for name in STRUCTURES}
    assert ref["model_output"]["type"] == "CausalLMOutput" and ref["dict"]["keys"] == ["logits", "scale"]
    for name in STRUCTURES:
        want = ref[name]
        for rank, res in enumerate(got):
            r = res[name]
            assert (r["type"], r["keys"], r["consts"]) == (want["type"], want["keys"], want["consts"]), (name, rank)
            s, e = r["rows"]
            assert _close(r["out"], want["out"][s:e]), (name, rank)     # this rank's block of the output
            assert abs(r["loss"] - want["loss"]) <= RTOL * abs(want["loss"]), (name, rank, r["loss"], want["loss"])
            bad = [q for q in want["grads"] if not _close(r["grads"][q], want["grads"][q])]
            assert set(r["grads"]) == set(want["grads"]) and not bad, (name, rank, bad)
