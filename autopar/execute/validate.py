"""The validation step of ``autopar execute``: one training step of the distributed model
against the single-process model, every tensor compared.

The same synthetic batch on every rank, sliced to the input layout; forward, the local loss
share, backward, gradient sync; the output, the loss, the input gradients and every parameter
gradient assembled, then one SGD-with-momentum step and every parameter (and floating buffer)
after it. Rank 0 computes the same with the single-process model and compares each tensor:
``max|a-b| <= rtol * max|ref| + atol`` (``DEFAULT_TOL``).
"""

from __future__ import annotations

import math

from ..artifacts import Check

#: (rtol, atol) of each tensor's max magnitude. In float64 a decomposition must agree to
#: rounding (it is the same function); in float32 a ReLU whose input sits within rounding of 0
#: can flip, so ill-conditioned models differ by more than rounding: validate in float64 by
#: default and time in float32.
DEFAULT_TOL = {"float64": (1e-9, 1e-12), "float32": (2e-5, 1e-7)}
RULE = "max|a-b| <= rtol*max|ref| + atol per tensor"


def compare(name: str, got, ref, rtol: float, atol: float) -> Check:
    """One tensor against its single-process reference."""
    got = got.detach().double()
    ref = ref.detach().double()
    if tuple(got.shape) != tuple(ref.shape):
        return Check(tensor=name, passed=False, max_abs_diff=math.inf, max_abs_ref=0.0, rel=math.inf,
                     note=f"shape {tuple(got.shape)} != {tuple(ref.shape)}")
    diff = float((got - ref).abs().max()) if got.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    ok = diff <= rtol * scale + atol
    return Check(tensor=name, passed=bool(ok), max_abs_diff=diff, max_abs_ref=scale,
                 rel=diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))


def validation_step(dm, mf, xs, ys, loss_fn, comm, dtype, seed: int,
                    lr: float, momentum: float, rtol: float, atol: float) -> list[Check]:
    """Run one step of ``dm`` (already in the validation ``dtype``) on the full batch ``xs``/``ys``
    and, on the mesh's rank 0, compare every tensor with the single-process model (built with ``seed``,
    converted to ``dtype``).
    Collective: every rank calls it. Returns the checks (empty on ranks other than 0)."""
    import torch

    from ..runtime.comm import assemble

    device = comm.device
    local = dm.shard_inputs(xs)
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in local]
    out = dm(*leaves)
    loss_r = dm.local_loss(out, ys, loss_fn)
    loss_r.backward()
    dm.finish_grads()
    out_shape = dm.graph.value_shape(dm.graph.output)
    out_full = assemble(out.detach(), dm.loss_layout(), out_shape, comm, "value")
    loss_t = loss_r.detach().clone().reshape(1).to(device)
    comm.all_reduce_(loss_t)
    in_grads = {}
    for gi, leaf in zip(dm.graph.inputs, leaves):
        if leaf.grad is not None:
            in_grads[gi.name] = assemble(leaf.grad, dm.input_layout(gi.name), gi.shape, comm, "sum")
    grads = dm.full_grads()
    opt = torch.optim.SGD(dm.parameters(), lr=lr, momentum=momentum)
    opt.step()
    after = dm.full_params()
    full_bufs = dm.full_buffers()
    checks: list[Check] = []
    if comm.rank != 0:
        return checks
    torch.manual_seed(seed)
    ref = mf.build_model().to(device=device, dtype=dtype)
    ref.train()
    rx = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    rout = ref(*rx)
    rloss = loss_fn(rout, ys) if ys is not None else loss_fn(rout)
    rloss.backward()
    checks.append(compare("output", out_full, rout, rtol, atol))
    checks.append(compare("loss", loss_t.reshape(()), rloss, rtol, atol))
    for gi, x in zip(dm.graph.inputs, rx):
        if x.grad is not None and gi.name in in_grads:
            checks.append(compare(f"input_grad:{gi.name}", in_grads[gi.name], x.grad, rtol, atol))
    for name, p in ref.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        checks.append(compare(f"grad:{name}", grads[name], g, rtol, atol))
    ropt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    ropt.step()
    for name, p in ref.named_parameters():
        checks.append(compare(f"param_after_step:{name}", after[name], p, rtol, atol))
    for name, b in ref.named_buffers():
        if b.is_floating_point() and name in full_bufs:
            checks.append(compare(f"buffer:{name}", full_bufs[name], b, rtol, atol))
    return checks


def worst(failures: list[Check]) -> Check:
    """The failed check with the largest relative difference (NaN counts as the worst)."""
    return max(failures, key=lambda c: c.rel if c.rel == c.rel else math.inf)

