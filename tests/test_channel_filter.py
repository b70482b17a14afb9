"""Channel / filter / channel+filter parallelism against one process, with real gloo ranks.

Each case is a chain of hand-built layers (conv or linear, mostly followed by batch norm and
ReLU), each under its own decomposition, with the generic ``redistribute`` between them (so the
chains exercise the free edges filter -> channel, channel -> channel, channel+filter ->
channel, and the real transitions sample -> filter, channel -> filter, channel -> sample).
Every rank computes the single-process reference itself (same seed), then the distributed run:
two SGD steps with momentum, gradients summed by ``GradSync`` over each parameter's gradient
group (the segmented allreduce). Compared, as full tensors assembled from the shards:

* output, loss, input gradient, every parameter gradient (after the segmented allreduce),
* every parameter after two SGD steps with momentum 0.9 (the second step uses the momentum
  buffers, which live on the local shards), batch-norm running statistics after two steps,
* bytes allreduced per step (GradSync) against the cost model's ``grad_sync_bytes``.

Tolerance (float32): elementwise ``|a - b| <= 1e-5 * (|b| + max|b|)``, i.e. rtol 1e-5 with an
absolute floor of 1e-5 of the tensor's largest entry (reassociated sums of channels).
Sizes include remainders (channels and filters that do not divide the parts).
"""

from __future__ import annotations

import pytest

try:
    from test_channel_filter_cost import ctx_for, make_layer
except ImportError:  # tests/ imported as a package
    from tests.test_channel_filter_cost import ctx_for, make_layer

from autopar.decomp.channel_filter import Channel, ChannelFilter, Filter
from autopar.decomp.sample import Sample

RTOL = 1e-5
LR, MOMENTUM = 0.1, 0.9


def chain(x_shape, kind, specs):
    """specs: (decomposition, filters, options) per layer -> (layers, decompositions)."""
    layers, decs = [], []
    name, shape = "x", list(x_shape)
    for i, (dec, f, opts) in enumerate(specs):
        lay = make_layer(i, kind, name, shape, f, **opts)
        layers.append(lay)
        decs.append(dec)
        name, shape = lay.output, lay.out_shape
    return layers, decs


BN = {}                                            # batch norm + ReLU, no bias
BIAS_RELU = {"bias": True, "bn": False}            # bias + ReLU
LAST = {"bias": True, "bn": False, "relu": False}  # bias only

CASES_W2 = {
    "conv2d": ([4, 6, 5, 5], "conv", [(Sample(2), 8, BN), (Filter(1, 2), 7, BN),
                                      (Channel(1, 2), 9, BN), (Channel(1, 2), 6, BIAS_RELU),
                                      (Sample(2), 3, LAST)]),
    "linear": ([4, 10], "linear", [(Channel(1, 2), 12, BN), (Filter(1, 2), 9, BN),
                                   (Channel(1, 2), 7, BIAS_RELU), (Filter(1, 2), 5, LAST)]),
    "conv1d": ([4, 5, 7], "conv", [(Filter(1, 2), 7, BN), (Channel(1, 2), 5, BIAS_RELU)]),
    "conv3d": ([2, 4, 4, 4, 4], "conv", [(Channel(1, 2), 6, BN), (Filter(1, 2), 5, LAST)]),
}
CASES_W4 = {
    "conv2d": ([8, 6, 5, 5], "conv", [(Sample(4), 8, BN), (Filter(2, 2), 10, BN),
                                      (Channel(2, 2), 9, BN), (ChannelFilter(1, 2, 2), 7, BN),
                                      (Channel(2, 2), 8, BIAS_RELU), (Filter(1, 4), 6, BN),
                                      (Channel(1, 4), 5, BIAS_RELU), (Sample(4), 3, LAST)]),
    "linear": ([8, 12], "linear", [(Filter(2, 2), 16, BN), (Channel(2, 2), 10, BN),
                                   (ChannelFilter(1, 2, 2), 9, BN), (Channel(2, 2), 8, BIAS_RELU),
                                   (Filter(1, 4), 7, BN), (Channel(1, 4), 6, BIAS_RELU),
                                   (Sample(4), 3, LAST)]),
    "conv1d": ([8, 6, 9], "conv", [(ChannelFilter(1, 2, 2), 8, BIAS_RELU),
                                   (ChannelFilter(1, 2, 2), 6, BN), (Filter(2, 2), 5, LAST)]),
}
CASES_W8 = {
    "conv2d": ([8, 8, 4, 4], "conv", [(ChannelFilter(2, 2, 2), 12, BN), (Channel(4, 2), 10, BN),
                                      (ChannelFilter(1, 4, 2), 9, BN),
                                      (ChannelFilter(1, 2, 4), 8, BIAS_RELU), (Sample(8), 3, LAST)]),
}


def _build(cases, world):
    out = []
    for name, (x_shape, kind, specs) in cases.items():
        layers, decs = chain(x_shape, kind, specs)
        for lay, dec in zip(layers, decs):
            why = dec.check(lay, ctx_for(world))
            assert why is None, (name, str(dec), why)
        out.append((name, x_shape, layers, decs))
    return out


# ---- what every rank runs -------------------------------------------------------------------
def _ref_forward(layers, x, P, B):
    import torch.nn.functional as F
    v = x
    for lay in layers:
        for op in lay.ops:
            if op.kind == "conv":
                a = op.attrs
                conv = getattr(F, f"conv{len(op.in_shapes[0]) - 2}d")
                v = conv(v, P[op.param_names["weight"]], P.get(op.param_names.get("bias")),
                         a["stride"], a["padding"], a["dilation"], a["groups"])
            elif op.kind == "linear":
                v = F.linear(v, P[op.param_names["weight"]], P.get(op.param_names.get("bias")))
            elif op.kind == "batch_norm":
                v = F.batch_norm(v, B[op.buffers["running_mean"]], B[op.buffers["running_var"]],
                                 P[op.param_names["weight"]], P[op.param_names["bias"]], True,
                                 op.attrs["momentum"], op.attrs["eps"])
            else:
                v = F.relu(v)
    return v


def _ratio(a, b) -> float:
    """max over elements of |a - b| / (RTOL * (|b| + max|b|)); <= 1 passes."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    tol = RTOL * (b.abs() + b.abs().max()) + 1e-300
    return float(((a - b).abs() / tol).max())


def _rank_main(rank, world, cases):
    import torch
    import torch.distributed as dist
    from autopar.runtime.comm import Comm, assemble, local_slice
    from autopar.runtime.redistribute import redistribute
    from autopar.runtime.gradsync import GradSync

    comm = Comm(rank, world)
    results = {}
    for name, x_shape, layers, decs in cases:
        # ---- identical full tensors on every rank -------------------------------------------
        g = torch.Generator().manual_seed(1234)
        full_p, full_b, shards, order = {}, {}, {}, []
        for lay, dec in zip(layers, decs):
            for op in lay.ops:
                for role, shape in op.params.items():
                    q = op.param_names[role]
                    if op.kind == "batch_norm":
                        t = (1.0 if role == "weight" else 0.0) + 0.2 * torch.randn(shape, generator=g)
                    else:
                        fan_in = max(1, torch.Size(op.params["weight"][1:]).numel())
                        t = torch.randn(shape, generator=g) / fan_in ** 0.5
                    full_p[q], shards[q] = t, dec.param_shard(op, role)
                    order.append(q)
                for role, q in op.buffers.items():
                    full_b[q] = (0.1 * torch.randn(op.params["weight"], generator=g) if role == "running_mean"
                                 else 1.0 + torch.rand(op.params["weight"], generator=g))
        x = torch.randn(x_shape, generator=g)
        out_shape = layers[-1].out_shape
        w_loss = torch.randn(out_shape, generator=g)

        # ---- single-process reference ----------------------------------------------------
        P = {q: t.clone().requires_grad_() for q, t in full_p.items()}
        B = {q: t.clone() for q, t in full_b.items()}
        xr = x.clone().requires_grad_()
        opt = torch.optim.SGD(list(P.values()), lr=LR, momentum=MOMENTUM)
        y_ref = _ref_forward(layers, xr, P, B)
        loss_ref = (y_ref * w_loss).sum()
        loss_ref.backward()
        ref = {"output": y_ref.detach(), "loss": loss_ref.detach(), "input grad": xr.grad.clone()}
        ref.update({f"grad {q}": P[q].grad.clone() for q in order})
        opt.step()
        opt.zero_grad()
        (_ref_forward(layers, xr, P, B) * w_loss).sum().backward()
        opt.step()
        ref.update({f"step2 {q}": P[q].detach().clone() for q in order})
        ref.update({f"step2 {q}": t for q, t in B.items()})

        # ---- distributed ----------------------------------------------------------------
        partitions = []
        for lay, dec in zip(layers, decs):
            partitions.extend(dec.partitions(lay, world))
        for q in order:
            partitions.append([shards[q].grad_group(r, world) for r in range(world)])
        comm.ensure_partitions(partitions)

        def shard_of(full, sh):
            b = sh.local_bounds(full.shape, rank, world)
            return full[tuple(slice(s, s + e) for s, e in b)]

        def full_of(local, sh, shape):
            if not sh.dims:
                return local.detach().clone()
            t = torch.zeros(shape)
            if rank == min(sh.grad_group(rank, world)):
                t[tuple(slice(s, s + e) for s, e in sh.local_bounds(shape, rank, world))] = local.detach()
            dist.all_reduce(t)
            return t

        PL = {q: shard_of(full_p[q], shards[q]).clone().requires_grad_() for q in order}
        BL = {q: t.clone() for q, t in full_b.items()}
        sync = GradSync(comm, [(PL[q], tuple(shards[q].grad_group(rank, world))) for q in order])
        in_lay = decs[0].in_placement(layers[0], "x")
        xl = local_slice(x, in_lay, comm).clone().requires_grad_()

        def forward():
            v, src = xl, in_lay
            for lay, dec in zip(layers, decs):
                dst = dec.in_placement(lay, lay.inputs[0])
                v = redistribute(v, src, dst, lay.in_shape(lay.inputs[0]), comm)
                for op in lay.ops:
                    v = dec.run(comm, lay, op, [v], {q: PL[q] for q in op.param_names.values()},
                                {q: BL[q] for q in op.buffers.values()})
                src = dec.out_placement(lay)
            return v, src

        opt = torch.optim.SGD(list(PL.values()), lr=LR, momentum=MOMENTUM)
        y, out_lay = forward()
        loss = (y * local_slice(w_loss, out_lay, comm)).sum() / out_lay.replicas(world)
        loss.backward()
        sync.finish()
        got = {"output": assemble(y, out_lay, out_shape, comm, "value"),
               "input grad": assemble(xl.grad, in_lay, x_shape, comm, "sum")}
        total = loss.detach().clone()
        dist.all_reduce(total)
        got["loss"] = total
        got.update({f"grad {q}": full_of(PL[q].grad, shards[q], full_p[q].shape) for q in order})
        opt.step()
        opt.zero_grad()
        y, out_lay = forward()
        ((y * local_slice(w_loss, out_lay, comm)).sum() / out_lay.replicas(world)).backward()
        sync.finish()
        opt.step()
        for q in order:   # optimizer state follows the local shard
            assert opt.state[PL[q]]["momentum_buffer"].shape == PL[q].shape
        got.update({f"step2 {q}": full_of(PL[q], shards[q], full_p[q].shape) for q in order})
        for lay, dec in zip(layers, decs):
            for op in lay.ops:
                for q in op.buffers.values():
                    sh = dec.param_shard(op, "weight")
                    got[f"step2 {q}"] = full_of(shard_of(BL[q], sh), sh, full_b[q].shape)

        res = {k: _ratio(got[k], ref[k]) for k in ref}
        # segmented allreduce: bytes GradSync sends per step == the cost model's volume
        ctx = ctx_for(world)
        predicted = sum(dec.cost(lay, ctx).grad_sync_bytes for lay, dec in zip(layers, decs))
        res["_bytes"] = (sync.bytes_per_step, predicted)
        sync.remove()
        results[name] = res
    return results


def _check(results, world):
    for name, res in results[0].items():
        got, predicted = res.pop("_bytes")
        assert got == predicted, (world, name, got, predicted)   # rank 0 holds block 0
        for r, rr in enumerate(results):
            rr[name].pop("_bytes", None)
            bad = {k: v for k, v in rr[name].items() if not v <= 1.0}
            assert not bad, f"world {world} case {name} rank {r}: tolerance ratios {bad}"


@pytest.mark.dist
@pytest.mark.parametrize("world, cases", [(2, CASES_W2), (4, CASES_W4), (8, CASES_W8)],
                         ids=["world2", "world4", "world8"])
def test_equivalence_with_one_process(world, cases):
    from autopar.runtime.launch import run_ranks
    built = _build(cases, world)
    results = run_ranks(_rank_main, world, args=(built,), timeout_s=180)
    _check(results, world)
