"""The validation step of ``autopar execute``: one training step of the distributed model
against the single-process model, every tensor compared.

The same synthetic batch on every rank, sliced to the input layout; forward, the local loss
share, backward, gradient sync; the output, the loss, the input gradients and every parameter
gradient assembled, then one SGD-with-momentum step and every parameter (and floating buffer)
after it. Rank 0 computes the same with the single-process model and compares each tensor:
``max|a-b| <= rtol * max|ref| + atol`` (``DEFAULT_TOL``).

The reference computes the plan's batch-norm statistics (``decomp.bn``): global, the model as
it is; local, the model with every training batch norm over groups of G consecutive samples
("ghost" batch norm, ``ghost_batch_norm``, written independently of the distributed runtime).

Every replica is validated, not only the rank whose block is assembled: each rank compares its
own gradient, parameter (after the step) and buffer blocks with the assembled tensors
(``replica:`` checks, the largest difference over the ranks). A tensor that is not compared is
listed as a passed check whose note says ``skipped`` and why.
"""

from __future__ import annotations

import contextlib
import math

from ..artifacts import Check
from ..runtime.model import output_tensor
from ..decomp.base import ParamShard
from ..runtime.comm import assemble

#: (rtol, atol) of each tensor's max magnitude. In float64 a decomposition must agree to
#: rounding (it is the same function); in float32 a ReLU whose input sits within rounding of 0
#: can flip, so ill-conditioned models differ by more than rounding: validate in float64 by
#: default and time in float32.
DEFAULT_TOL = {"float64": (1e-9, 1e-12), "float32": (2e-5, 1e-7)}
RULE = "max|a-b| <= rtol*max|ref| + atol per tensor"


class Float32Inside:
    """Detector of a model that computes in float32 inside a float64 run: a ``TorchFunctionMode``
    that notes every float64 tensor cast to float32 (``.to(torch.float32)``, ``.float()``,
    ``.type(torch.float32)``) and the innermost module whose forward made it (forward pre-hooks
    keep the stack). Hugging Face's ``LlamaRMSNorm`` does so: such a model meets float32
    rounding wherever a plan changes the summation order, so its float64 validation holds it to
    float32 tolerances (``validation_step``). ``modules``: the class names seen, in order."""

    def __init__(self, model) -> None:
        self.model = model
        self.modules: list[str] = []

    def __enter__(self):
        import torch
        from torch.overrides import TorchFunctionMode

        stack: list[str] = []
        seen = self.modules
        T = torch.Tensor

        def casts_to_f32(func, args, kwargs) -> bool:
            if not args or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.float64:
                return False
            if func is T.float:
                return True
            if func in (T.to, T.type):
                wants = [a for a in args[1:] if isinstance(a, torch.dtype)] + \
                        [v for k, v in kwargs.items() if k == "dtype"]
                return torch.float32 in wants
            return False

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if casts_to_f32(func, args, kwargs):
                    name = stack[-1] if stack else "the model"
                    if name not in seen:
                        seen.append(name)
                return func(*args, **kwargs)

        def pre(mod, _args):
            stack.append(type(mod).__name__)

        def post(mod, _args, _out):
            if stack:
                stack.pop()

        self._hooks = []
        for m in self.model.modules():
            self._hooks.append(m.register_forward_pre_hook(pre))
            self._hooks.append(m.register_forward_hook(post))
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        return False


def precision_note(modules: list[str]) -> str:
    """The validation note of a float64 run whose model computes in float32 inside."""
    return f"the model computes in float32 inside ({', '.join(modules)}): float32 tolerances"


def effective_tolerances(dtype_name: str, rtol: float, atol: float, f32_modules: list[str]
                         ) -> tuple[float, float]:
    """(rtol, atol) the validation holds a run to: a float64 run of a model that computes in
    float32 inside (``Float32Inside``) at least the float32 ones, else as given."""
    if dtype_name == "float64" and f32_modules:
        rt, at = DEFAULT_TOL["float32"]
        return max(rtol, rt), max(atol, at)
    return rtol, atol


def max_abs_diff(a, b) -> float:
    """max |a - b| with equal elements counted as 0 (equal infinities: a ``-inf`` causal mask
    held by both sides is no difference)."""
    if not a.numel():
        return 0.0
    a, b = a.double(), b.double()
    d = (a - b).abs()
    return float(d.masked_fill(a == b, 0.0).max())


def max_abs_finite(t) -> float:
    """max |t| over the finite elements (the scale of the relative tolerance)."""
    import torch
    if not t.numel():
        return 0.0
    a = t.detach().double().abs()
    return float(a.masked_fill(~torch.isfinite(a), 0.0).max())


def compare(name: str, got, ref, rtol: float, atol: float) -> Check:
    """One tensor against its single-process reference."""
    got = got.detach().double()
    ref = ref.detach().double()
    if tuple(got.shape) != tuple(ref.shape):
        return Check(tensor=name, passed=False, max_abs_diff=math.inf, max_abs_ref=0.0, rel=math.inf,
                     note=f"shape {tuple(got.shape)} != {tuple(ref.shape)}")
    diff = max_abs_diff(got, ref)
    scale = max_abs_finite(ref)
    ok = diff <= rtol * scale + atol
    return Check(tensor=name, passed=bool(ok), max_abs_diff=diff, max_abs_ref=scale,
                 rel=diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))


@contextlib.contextmanager
def ghost_batch_norm(group: int | None):
    """Within this block every training ``torch.nn.functional.batch_norm`` (what
    ``nn.BatchNorm*`` calls) normalises each group of ``group`` consecutive samples with the
    group's own statistics, and updates the running statistics once with the mean over the
    groups of the group means and unbiased variances. ``group`` None: unchanged."""
    import torch
    import torch.nn.functional as F

    if group is None:
        yield
        return
    orig = F.batch_norm

    def bn(input, running_mean, running_var, weight=None, bias=None, training=False,
           momentum=0.1, eps=1e-5):
        if not training or input.shape[0] <= group:
            return orig(input, running_mean, running_var, weight, bias, training, momentum, eps)
        chunks = input.split(group, 0)
        out = torch.cat([orig(c, None, None, weight, bias, True, 0.0, eps) for c in chunks])
        if running_mean is not None and running_var is not None:
            dims = [0] + list(range(2, input.dim()))
            with torch.no_grad():
                mean = torch.stack([c.mean(dims) for c in chunks]).mean(0)
                var = torch.stack([c.var(dims, unbiased=True) for c in chunks]).mean(0)
                m = 0.1 if momentum is None else momentum
                running_mean.mul_(1 - m).add_(mean, alpha=m)
                running_var.mul_(1 - m).add_(var, alpha=m)
        return out

    F.batch_norm = bn
    try:
        yield
    finally:
        F.batch_norm = orig


def replica_diffs(dm, grads, after, full_bufs, comm, out_local=None, out_full=None) -> dict[str, float]:
    """Collective: per tensor, the largest ``max|local - assembled block|`` over every rank of
    the mesh (its own gradient, parameter after the step, and floating buffer blocks against
    the assembled ones, which come from the lowest rank of each group)."""
    import torch
    import torch.distributed as dist

    names, diffs = [], []
    world, rank = comm.world, comm.rank

    def of_rank0(sh, full):
        """A whole tensor is assembled from each rank's own copy: compare with mesh rank 0's."""
        if sh.dims:
            return full
        z = full.detach().clone() if rank == 0 else torch.zeros_like(full)
        return comm.all_reduce_(z)

    if out_local is not None:        # the output block of every replica, not only the one assembled
        ref0 = of_rank0(ParamShard(), out_full)
        b = dm.loss_layout().local_bounds(ref0.shape, rank, world)
        sl = tuple(slice(s, s + e) for s, e in b)
        names.append("replica:output")
        diffs.append(max_abs_diff(out_local, ref0[sl]))

    for safe, p in dm.params.items():
        qual = dm.qualname[safe]
        sh = dm.shards.get(qual, ParamShard())
        sl = sh.index(after[qual].shape, rank, world)
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        for kind, mine, full in (("grad", g, grads[qual]), ("param_after_step", p.detach(), after[qual])):
            full = of_rank0(sh, full)
            names.append(f"replica:{kind}:{qual}")
            diffs.append(max_abs_diff(mine, full[sl]))
    owner = {}
    for lay in dm.graph.layers:
        dec = dm.decisions[lay.index]
        for op in lay.ops:
            if op.buffers and "weight" in op.param_names:
                for q in op.buffers.values():
                    owner[q] = dec.param_shard(op, "weight")
    for q, buf in dm.bufs.items():
        if q not in full_bufs:
            continue
        sh = owner.get(q, ParamShard())
        sl = sh.index(buf.shape, rank, world)
        full = of_rank0(sh, full_bufs[q])
        names.append(f"replica:buffer:{q}")
        diffs.append(max_abs_diff(buf[sl], full[sl]))
    t = torch.tensor(diffs, dtype=torch.float64, device=comm.device)
    if world > 1 and t.numel():
        comm.all_reduce_(t, dist.ReduceOp.MAX)
    return dict(zip(names, t.tolist()))


def validation_step(dm, mf, xs, ys, loss_fn, comm, dtype, seed: int,
                    lr: float, momentum: float, rtol: float, atol: float,
                    precision: dict | None = None) -> list[Check]:
    """Run one step of ``dm`` (already in the validation ``dtype``) on the full batch ``xs``/``ys``
    and, on the mesh's rank 0, compare every tensor with the single-process model (built with ``seed``,
    converted to ``dtype``).
    A float64 run whose reference model casts to float32 inside (``Float32Inside``, e.g.
    ``LlamaRMSNorm``) is compared at float32 tolerances; ``precision`` (a dict, filled on rank 0)
    receives ``rtol``, ``atol`` and, when so, ``float32_inside`` (the module names) and ``note``;
    ``precision["tolerances_given"]`` (``--rtol`` given) keeps ``rtol``/``atol`` as they are.
    Collective: every rank calls it. Returns the checks (empty on ranks other than 0)."""
    import torch


    device = comm.device
    local = dm.shard_inputs(xs)
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in local]
    out = dm(*leaves)
    loss_r = dm.local_loss(out, ys, loss_fn)
    loss_r.backward()
    dm.finish_grads()
    out_shape = dm.graph.value_shape(dm.graph.output)
    out_full = assemble(output_tensor(out).detach(), dm.loss_layout(), out_shape, comm, "value")
    loss_t = loss_r.detach().clone().reshape(1).to(device)
    comm.all_reduce_(loss_t)
    in_grads = {}
    for gi, leaf in zip(dm.graph.inputs, leaves):
        if leaf.grad is not None:
            in_grads[gi.name] = dm.assemble_input_grad(gi.name, leaf.grad)
    grads = dm.full_grads()
    opt = torch.optim.SGD(dm.parameters(), lr=lr, momentum=momentum)
    opt.step()
    after = dm.full_params()
    full_bufs = dm.full_buffers()
    replicas = replica_diffs(dm, grads, after, full_bufs, comm, output_tensor(out).detach(), out_full)
    checks: list[Check] = []
    if comm.rank != 0:
        return checks
    torch.manual_seed(seed)
    ref = mf.build_model().to(device=device, dtype=dtype)
    ref.train()
    rx = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    stats = getattr(dm, "bn_stats", None)
    detector = Float32Inside(ref)
    with ghost_batch_norm(stats.group if stats is not None and stats.local else None), detector:
        rout = ref(*rx)
        rloss = loss_fn(rout, ys) if ys is not None else loss_fn(rout)
    rloss.backward()
    given = precision is not None and precision.get("tolerances_given", False)
    if not given:
        rtol, atol = effective_tolerances(str(dtype).replace("torch.", ""), rtol, atol, detector.modules)
    if precision is not None:
        precision.update(rtol=rtol, atol=atol)
        if str(dtype) == "torch.float64" and detector.modules:
            note = precision_note(detector.modules)
            precision.update(float32_inside=list(detector.modules),
                             note=note.replace("float32 tolerances", f"the given tolerances (rtol {rtol:g}) kept")
                             if given else note)
    checks.append(compare("output", out_full, output_tensor(rout), rtol, atol))
    checks.append(compare("loss", loss_t.reshape(()), rloss, rtol, atol))
    for gi, x in zip(dm.graph.inputs, rx):
        if x.grad is not None and gi.name in in_grads:
            checks.append(compare(f"input_grad:{gi.name}", in_grads[gi.name], x.grad, rtol, atol))
        else:
            checks.append(skipped(f"input_grad:{gi.name}", f"input of dtype {x.dtype} has no gradient"))
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
        elif name in dm.bufs:      # integer buffers (num_batches_tracked): exactly equal
            checks.append(compare(f"buffer:{name}", dm.bufs[name], b, 0.0, 0.0))
        else:
            checks.append(skipped(f"buffer:{name}", "the distributed model holds no such buffer"))
    for name, d in replicas.items():
        ref_name = name.split(":", 1)[1]
        if ref_name == "output":
            full = out_full
        else:
            kind, qual = ref_name.split(":", 1)
            full = {"grad": grads, "param_after_step": after, "buffer": full_bufs}[kind][qual]
        scale = max_abs_finite(full)
        checks.append(Check(tensor=name, passed=bool(d <= rtol * scale + atol), max_abs_diff=d,
                            max_abs_ref=scale, rel=d / scale if scale > 0 else (0.0 if d == 0 else math.inf),
                            note="every rank's block against the assembled tensor"))
    return checks


def skipped(name: str, why: str) -> Check:
    """A tensor not compared, listed so that the report says so."""
    return Check(tensor=name, passed=True, max_abs_diff=0.0, max_abs_ref=0.0, rel=0.0, note=f"skipped: {why}")


def worst(failures: list[Check]) -> Check:
    """The failed check with the largest relative difference (NaN counts as the worst)."""
    return max(failures, key=lambda c: c.rel if c.rel == c.rel else math.inf)

