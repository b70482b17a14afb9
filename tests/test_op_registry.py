"""The op registry: every family matches its aten ops on small traced models, one family per
op, kinds of the example CNNs unchanged, several-output ops read through their getitems, a
toy family added by one file plus one import line, and sample blocks of the new families
computing the single-process function."""

import collections
import subprocess
import sys
import textwrap

import pytest

from autopar.decomp.base import CostContext
from autopar.decomp.common import batch_dim_ok
from autopar.decomp.ir import LayerGraphData
from autopar.modelfile import load_model_file
from autopar.ops import FAMILIES, classify, describe_unregistered, family_of, unregister_family
from autopar.trace.tracer import trace_model

ATTENTION = """
import torch
from torch import nn
import torch.nn.functional as F

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.ln = nn.LayerNorm(16)
        self.rms = nn.RMSNorm(16)
        self.qkv = nn.Linear(16, 48)
        self.o = nn.Linear(16, 16)
        self.gn = nn.GroupNorm(2, 4)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, ids):
        x = self.rms(self.ln(self.emb(ids)))
        q, k, v = self.qkv(x).split(16, dim=-1)
        B, L, _ = q.shape
        q = q.view(B, L, 2, 8).transpose(1, 2)
        k = k.view(B, L, 2, 8).transpose(1, 2)
        v = v.view(B, L, 2, 8).permute(0, 2, 1, 3)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        p = torch.softmax(torch.einsum("bhld,bhmd->bhlm", q, k), -1)
        a = a + torch.matmul(p, v)
        a = a.transpose(1, 2).reshape(B, L, 16)
        c1, c2 = a.chunk(2, dim=-1)
        x = x + self.o(torch.cat([c2, c1], -1))
        g = self.gn(x.reshape(B, 4, L, 4)).reshape(B, L, 16)
        s = torch.stack([x, g], 2).sum(2)
        return s.unsqueeze(1).squeeze(1) @ self.w + x.mean(-1, keepdim=True)

def build_model():
    return Block()

def example_inputs(batch_size):
    return (torch.randint(0, 50, (batch_size, 6)),)
"""

LOSS = """
import torch
from torch import nn
import torch.nn.functional as F

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 5)

    def forward(self, x, y):
        z = self.l(x)
        b = torch.bmm(z.unsqueeze(2), z.unsqueeze(1)).flatten(1)
        return F.cross_entropy(z, y) + b.mean()

def build_model():
    return M()

def example_inputs(batch_size):
    return (torch.randn(batch_size, 8), torch.randint(0, 5, (batch_size,)))
"""

GNN = """
import torch
from torch import nn

class Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x, src, dst):
        m = self.l(x).index_select(0, src)
        out = torch.zeros_like(x).index_add(0, dst, m)
        idx = dst.unsqueeze(-1).expand(-1, 8)
        out = out + torch.zeros_like(x).scatter_add(0, idx, m)
        out = out + torch.zeros_like(x).scatter_reduce(0, idx, m, "amax", include_self=False)
        return out + torch.gather(out, 1, torch.remainder(idx[: x.shape[0]], 8))

def build_model():
    return Step()

def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 8), torch.randint(0, batch_size, (3 * batch_size,), generator=g),
            torch.randint(0, batch_size, (3 * batch_size,), generator=g))
"""

MULTI = """
import torch
from torch import nn
import torch.nn.functional as F

class M(nn.Module):
    def forward(self, x):
        a, b, c = x.split([2, 3, 3], dim=1)
        d, e = x.chunk(2, dim=-1)
        r0, r1, r2, r3 = x.unbind(2)
        v, mu = torch.var_mean(x, dim=1, keepdim=True)
        y, _ = F.max_pool2d(x, 2, return_indices=True)
        s = (a.sum(1) + b.sum(1) + c.sum(1)).sum(-1) + (d * e).sum(-1).sum(1)
        s = s + r0.sum(1) + r1.sum(1) + r2.sum(1) - r3.sum(1)
        return s + ((x - mu) / (v + 1)).sum((1, 3)) + y.sum((1, 3)).repeat(1, 2)

def build_model():
    return M()

def example_inputs(batch_size):
    return (torch.randn(batch_size, 8, 4, 4),)
"""

TOY = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 6)

    def forward(self, x):
        return torch.logit(torch.sigmoid(self.l(x)), eps=1e-6)

def build_model():
    return M()

def example_inputs(batch_size):
    return (torch.randn(batch_size, 6),)
"""


def _model(tmp_path, body, name):
    p = tmp_path / f"{name}.py"
    p.write_text(textwrap.dedent(body))
    return load_model_file(p)


def _ops(g):
    return [op for lay in g.layers for op in lay.ops]


def _interpret(g, model, inputs, batch_parts: int = 1):
    """Run the traced graph op by op with ``runtime.ops.call_local`` (as Sample's ``run``
    does); with ``batch_parts`` > 1, on the first block of samples with local view sizes."""
    from autopar.runtime.ops import call_local
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    vals = {}
    for gi, t in zip(g.inputs, inputs):
        vals[gi.name] = t[: t.shape[0] // batch_parts] if batch_parts > 1 else t
    for op in _ops(g):
        local = None
        if batch_parts > 1:
            local = [op.out_shape[0] // batch_parts] + list(op.out_shape[1:])
        vals[op.name] = call_local(op, [vals[v] for v in op.inputs], params, buffers,
                                   local_out_shape=local)
    return vals[g.output]


def _build(mf, batch):
    import torch
    torch.manual_seed(0)
    model = mf.build_model()
    torch.manual_seed(1)
    return model, mf.example_inputs(batch)


def test_attention_block_families_and_sample_blocks(tmp_path):
    import torch
    mf = _model(tmp_path, ATTENTION, "attn")
    g = trace_model(mf, 4)
    by = collections.defaultdict(set)
    for op in _ops(g):
        by[op.target.split(".")[1]].add(op.kind)
    expect = {"embedding": "embedding", "layer_norm": "layer_norm", "rms_norm": "rms_norm",
              "linear": "linear", "slice": "slice", "view": "view", "transpose": "permute",
              "permute": "permute", "scaled_dot_product_attention": "attention",
              "einsum": "matmul", "softmax": "softmax", "matmul": "matmul", "cat": "cat",
              "reshape": "view", "group_norm": "group_norm", "stack": "stack", "sum": "sum",
              "unsqueeze": "squeeze", "squeeze": "squeeze", "mean": "mean", "add": "binary"}
    for base, kind in expect.items():
        assert by[base] == {kind}, (base, by[base])
    assert g.unregistered == [] and all(op.kind != "other" for op in _ops(g))
    ops = {op.target.split(".")[1]: op for op in _ops(g)}
    sdpa = ops["scaled_dot_product_attention"]
    assert sdpa.flops_fwd == 4 * 4 * 2 * 6 * 6 * 8 and sdpa.attrs["is_causal"]
    assert family_of("attention").independent_dims(sdpa) == {0, 1}
    assert ops["einsum"].flops_fwd == 2 * 4 * 2 * 6 * 6 * 8
    assert family_of("matmul").independent_dims(ops["einsum"]) == {0, 1}   # l is not in k
    assert ops["embedding"].flops_fwd == 4 * 6 * 16
    assert family_of("layer_norm").independent_dims(ops["layer_norm"]) == {0, 1}
    assert family_of("softmax").independent_dims(ops["softmax"]) == {0, 1, 2}
    # split/chunk pieces are slices of their input
    slices = [op for op in _ops(g) if op.kind == "slice"]
    assert [op.out_shape for op in slices] == [[4, 6, 16]] * 3 + [[4, 6, 8]] * 2
    # every op runs on blocks of samples, and the blocks compute the single-process function
    assert all(batch_dim_ok(lay) is None for lay in g.layers)
    model, inputs = _build(mf, 4)
    with torch.no_grad():
        full = model(*inputs)
        assert torch.allclose(_interpret(g, model, inputs), full, atol=1e-5)
        assert torch.allclose(_interpret(g, model, inputs, batch_parts=2), full[:2], atol=1e-5)


def test_cross_entropy_and_bmm(tmp_path, profile):
    g = trace_model(_model(tmp_path, LOSS, "loss"), 4)
    ops = {op.target.split(".")[1]: op for op in _ops(g)}
    ce = ops["cross_entropy_loss"]
    assert ce.kind == "cross_entropy" and ce.attrs["reduction"] == "mean"
    assert ce.flops_fwd == 4 * 4 * 5
    assert family_of("cross_entropy").independent_dims(ce) == {0}
    assert ops["bmm"].kind == "matmul" and ops["bmm"].flops_fwd == 2 * 4 * 5 * 5 * 1
    # a mean loss has a scalar output: sample splitting leaves it to the replicated layer
    lay = next(lay for lay in g.layers if ce in lay.ops)
    assert "scalar" in batch_dim_ok(lay)
    ctx = CostContext(profile=profile, world=1, ranks_per_node=1)
    from autopar.cost import primitives as prim
    f, b, src = prim.op_compute_s(ce, ce.in_shapes, ce.out_shape, ctx)
    assert src == "fit" and f > 0 and b > f


def test_gnn_step_families(tmp_path, profile):
    import torch
    mf = _model(tmp_path, GNN, "gnn")
    g = trace_model(mf, 5)
    kinds = {op.target.split(".")[1]: op.kind for op in _ops(g)}
    assert kinds["index_select"] == kinds["gather"] == "gather"
    assert kinds["index_add"] == kinds["scatter_add"] == kinds["scatter_reduce"] == "scatter"
    assert kinds["expand"] == "expand" and kinds["zeros_like"] == "unary"
    ops = {op.target.split(".")[1]: op for op in _ops(g)}
    # an activation index cannot be cut into sample blocks: never independent
    assert family_of("gather").independent_dims(ops["index_select"]) == frozenset()
    assert family_of("scatter").independent_dims(ops["index_add"]) == frozenset()
    assert family_of("scatter").independent_dims(ops["scatter_add"]) == {1}
    assert ops["index_add"].flops_fwd == 15 * 8 and ops["scatter_add"].flops_fwd == 15 * 8
    ctx = CostContext(profile=profile, world=1, ranks_per_node=1)
    from autopar.cost import primitives as prim
    for name in ("index_select", "index_add", "scatter_add", "gather"):
        op = ops[name]
        f, b, src = prim.op_compute_s(op, op.in_shapes, op.out_shape, ctx)
        t = profile.kernel_time_s("gather_scatter", family_of(op.kind).local_flops(op, op.in_shapes, op.out_shape),
                                  family_of(op.kind).local_bytes(op, op.in_shapes, op.out_shape))
        assert f == pytest.approx(t) and b == pytest.approx(2 * t) and src == "fit"
    del profile.kernels["gather_scatter"]          # an older profile: the fallback class
    f, _, _ = prim.op_compute_s(ops["gather"], ops["gather"].in_shapes, ops["gather"].out_shape, ctx)
    assert f > 0
    model, inputs = _build(mf, 5)
    with torch.no_grad():
        assert torch.allclose(_interpret(g, model, inputs), model(*inputs), atol=1e-5)


def test_several_output_ops_read_as_single_output_calls(tmp_path):
    import torch
    mf = _model(tmp_path, MULTI, "multi")
    g = trace_model(mf, 4)
    targets = collections.Counter(op.target for op in _ops(g))
    assert targets["aten.slice.Tensor"] == 5 and targets["aten.select.int"] == 4
    assert targets["aten.var.dim"] == 1 and targets["aten.mean.dim"] == 1
    assert targets["aten.max_pool2d.default"] == 1
    assert {op.kind for op in _ops(g) if op.target == "aten.var.dim"} == {"var"}
    model, inputs = _build(mf, 4)
    with torch.no_grad():
        assert torch.allclose(_interpret(g, model, inputs), model(*inputs), atol=1e-5)


def test_toy_family_is_one_file_and_one_import(tmp_path, profile):
    unregister_family("toy_logit")
    sys.modules.pop("toys.toy_op", None)
    mf = _model(tmp_path, TOY, "toy")
    before = trace_model(mf, 4)
    logit = [op for op in _ops(before) if op.target == "aten.logit.default"]
    assert [op.kind for op in logit] == ["other"]
    assert before.unregistered == ["aten.logit.default"]
    assert describe_unregistered(before.unregistered) == "replicated because not registered: aten.logit.default"
    assert describe_unregistered(["b", "a", "b"]) == "replicated because not registered: a, b (x2)"
    assert LayerGraphData.from_json(before.to_json()).unregistered == ["aten.logit.default"]
    try:
        import toys.toy_op  # noqa: F401  (the one import line)
        g = trace_model(mf, 4)
        (op,) = [op for op in _ops(g) if op.target == "aten.logit.default"]
        assert op.kind == "toy_logit" and g.unregistered == []
        from autopar.decomp.ir import PARAMETRIC, REGISTERED, TRANSPARENT
        assert "toy_logit" in REGISTERED and "toy_logit" not in PARAMETRIC | TRANSPARENT
        assert (op.flops_fwd, op.flops_bwd) == (3 * 24, 4 * 24)
        from autopar.cost import primitives as prim
        ctx = CostContext(profile=profile, world=1, ranks_per_node=1)
        f, b, src = prim.op_compute_s(op, op.in_shapes, op.out_shape, ctx)
        t = profile.kernel_time_s("elementwise", 3 * 24, 2 * 24 * 4)
        assert (f, b, src) == (pytest.approx(t), pytest.approx(2 * t), "fit")
        assert prim.saved_bytes(op, op.in_shapes, op.out_shape) == 24 * 4
        lay = next(lay for lay in g.layers if op in lay.ops)
        assert batch_dim_ok(lay) is None
    finally:
        unregister_family("toy_logit")
        sys.modules.pop("toys.toy_op", None)
    from autopar.decomp.ir import REGISTERED
    assert "toy_logit" not in REGISTERED


def test_registry_has_one_family_per_op():
    from autopar.profile import OP_CLASSES
    assert len(FAMILIES) >= 25
    for kind, fam in FAMILIES.items():
        assert fam.kind == kind
        assert fam.kernel_class in OP_CLASSES or fam.fallback_class in OP_CLASSES, kind
        for base in fam.aten:
            for n_act in (1, 2, 3):
                found = classify(f"aten.{base}.default", n_act)   # raises on two matches
                assert found is None or found.kind == kind or base == "linear"
    assert classify("aten.linear.default", 1).kind == "linear"
    assert classify("aten.linear.default", 2).kind == "matmul"
    assert classify("aten.logit.default", 1) is None


def test_example_cnn_kinds_unchanged(root):
    g = trace_model(load_model_file(root / "strategies/examples/resnet2d.py"), 8)
    kinds = collections.Counter((op.kind, op.target) for op in _ops(g))
    assert kinds == {("conv", "aten.conv2d.default"): 15, ("batch_norm", "aten.batch_norm.default"): 15,
                     ("unary", "aten.relu.default"): 13, ("binary", "aten.add.Tensor"): 6,
                     ("pool", "aten.max_pool2d.default"): 1,
                     ("adaptive_pool", "aten.adaptive_avg_pool2d.default"): 1,
                     ("flatten", "aten.flatten.using_ints"): 1, ("linear", "aten.linear.default"): 1}
    assert g.unregistered == []


def test_registry_modules_import_no_torch():
    code = "import sys, autopar.ops, autopar.decomp.ir; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _spec(kind, target, args, in_shapes, out_shape, attrs=None, params=None):
    from autopar.decomp.ir import OpSpec
    inputs = [f"x{i}" for i in range(len(in_shapes))]
    op = OpSpec(name="y", kind=kind, target=target, args=args, kwargs={}, out_shape=out_shape,
                dtype="float32", inputs=inputs, in_shapes=in_shapes, params=params or {},
                param_names={r: r for r in (params or {})})
    op.attrs = attrs if attrs is not None else family_of(kind).attrs(op)
    return op


def test_independent_dims_of_hand_made_ops():
    v = lambda i: {"v": f"x{i}"}  # noqa: E731
    view = _spec("view", "aten.view.default", [v(0), [4, 6, 2, 8]], [[4, 6, 16]], [4, 6, 2, 8])
    assert family_of("view").independent_dims(view) == {0, 1}
    merge = _spec("view", "aten.view.default", [v(0), [24, 16]], [[4, 6, 16]], [24, 16])
    # dim 1 was dim 2; dim 0 holds whole rows of dim-0 blocks of the input (the batch merged
    # with the next dim): independent, the alignment checked by decomp.common.batch_dim_ok
    assert family_of("view").independent_dims(merge) == frozenset({0})
    mixed = _spec("view", "aten.view.default", [v(0), [6, 4, 16]], [[4, 6, 16]], [6, 4, 16])
    assert family_of("view").independent_dims(mixed) == frozenset({2})   # rows regrouped
    exp = _spec("expand", "aten.expand.default", [v(0), [-1, 8]], [[4, 1]], [4, 8])
    assert family_of("expand").independent_dims(exp) == {0}
    # a literal size equal to the input's extent does not broadcast: independent there (the
    # runtime rewrites it to the block's extent, ``call_local``); a broadcast dim never is
    named = _spec("expand", "aten.expand.default", [v(0), [4, 8]], [[4, 1]], [4, 8])
    assert family_of("expand").independent_dims(named) == {0}
    bcast = _spec("expand", "aten.expand.default", [v(0), [4, 8]], [[1, 8]], [4, 8])
    assert family_of("expand").independent_dims(bcast) == {1}
    sq = _spec("squeeze", "aten.squeeze.default", [v(0)], [[4, 1, 3]], [4, 3])
    assert family_of("squeeze").independent_dims(sq) == frozenset()
    tr = _spec("permute", "aten.transpose.int", [v(0), 1, 2], [[4, 2, 6, 8]], [4, 6, 2, 8])
    assert family_of("permute").independent_dims(tr) == {0, 3}
    bn = _spec("batch_norm", "aten.batch_norm.default",
               [v(0), {"p": "w"}, {"p": "b"}, None, None, True, 0.1, 1e-5, True],
               [[4, 3, 5, 5]], [4, 3, 5, 5], params={"weight": [3], "bias": [3]})
    assert family_of("batch_norm").independent_dims(bn) == {1}
    assert family_of("batch_norm").synced_dims(bn) == {0, 2, 3}
    bcast = _spec("binary", "aten.add.Tensor", [v(0), v(1)], [[4, 3], [3]], [4, 3])
    assert family_of("binary").independent_dims(bcast) == frozenset()   # x1 has no batch dim
    other = _spec("other", "aten.logit.default", [v(0)], [[4, 3]], [4, 3])
    assert family_of("other").independent_dims(other) == frozenset()


def test_sample_legality_follows_the_families(profile):
    from autopar.decomp.ir import Layer
    from autopar.decomp.sample import Sample
    v = lambda i: {"v": f"x{i}"}  # noqa: E731
    ctx = CostContext(profile=profile, world=2, ranks_per_node=2)
    ln = _spec("layer_norm", "aten.layer_norm.default", [v(0), [16], {"p": "w"}, None, 1e-5, True],
               [[4, 6, 16]], [4, 6, 16], params={"weight": [16]})
    lay = lambda op: Layer(index=0, name="y", ops=[op], inputs=list(op.inputs), output="y")  # noqa: E731
    assert Sample(2).check(lay(ln), ctx) is None
    whole = _spec("layer_norm", "aten.layer_norm.default", [v(0), [4, 6, 16], None, None, 1e-5, True],
                  [[4, 6, 16]], [4, 6, 16])
    assert "does not run unchanged" in Sample(2).check(lay(whole), ctx)
    other = _spec("other", "aten.logit.default", [v(0)], [[4, 3]], [4, 3])
    assert "other" in Sample(2).check(lay(other), ctx)
    mean0 = _spec("mean", "aten.mean.dim", [v(0), [0], False], [[4, 3]], [3])
    assert Sample(2).check(lay(mean0), ctx)


def test_used_output_no_single_call_expresses_is_a_named_error(tmp_path):
    from autopar.errors import TraceError
    body = """
    import torch
    import torch.nn.functional as F
    class M(torch.nn.Module):
        def forward(self, x):
            y, idx = F.max_pool2d(x, 2, return_indices=True)
            return y + idx.float()
    def build_model():
        return M()
    def example_inputs(batch_size):
        return (torch.randn(batch_size, 2, 4, 4),)
    """
    with pytest.raises(TraceError, match="output 1 of aten.max_pool2d_with_indices"):
        trace_model(_model(tmp_path, body, "idx"), 2)
