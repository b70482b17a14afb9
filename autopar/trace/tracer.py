"""Trace a model without allocating it and build its layer graph.

The model is built under ``torch.device("meta")`` and its forward recorded on meta inputs by
the pre-dispatch recorder (``trace.recorder``), which writes the graph ``torch.export``
(non-strict) gives without importing ``torch._dynamo``: nothing is allocated, so a 1x1x512^3
input traces in well under a second. What the recorder does not reproduce (a model returning
a structure, whose training step is exported; a constant made from data) goes to
``torch.export``; where export fails, ``make_fx`` (fx proxy-tensor tracing, pre-dispatch) is
tried; where both fail the TraceError names the operation and the user's source line.

Each call_function node becomes an ``OpSpec`` with global shapes; its kind, normalised
attributes and analytic FLOPs come from the one op family that matches it (``autopar.ops``).
Ops no family matches get kind ``other`` (they run replicated) and their targets are listed in
``LayerGraphData.unregistered``. An op returning several tensors (split, chunk, unbind,
var_mean, max pooling with indices) is read through its ``getitem`` nodes: each used output
becomes the single-output call its family names (a split piece is a ``slice``).

Ops are grouped into layers (``autopar.decomp.ir``): an op joins its producer's layer when its
family says it is layout-transparent (batch norm, activation, dropout, an elementwise op with
one activation operand of the output's shape), consumes only that layer's output, and is that
output's only consumer.
"""

from __future__ import annotations

import math
import operator
import re
import time
from pathlib import Path
from typing import Any

from ..decomp.ir import BUFFER_UPDATE, OTHER, GraphInput, Layer, LayerGraphData, OpSpec
from ..errors import ModelFileError, TraceError
from ..modelfile import ModelFile, split_output
from ..ops import MULTI_OUTPUT, classify, family_of
from .graph_items import mark_graph_items
from . import recorder  # ``recorder.record`` looked up at each call: tests replace it


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def _full_args(node) -> list[Any]:
    """Positional arguments with schema defaults filled in (kw-only ones left to kwargs)."""
    args = list(node.args)
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return args
    for i, a in enumerate(schema.arguments):
        if a.kwarg_only:
            break
        if i >= len(args):
            if a.name in node.kwargs:
                args.append(node.kwargs[a.name])
            elif a.has_default_value():
                args.append(a.default_value)
            else:
                break
    return args


def _source(node) -> str:
    st = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', st)
    for f, line in reversed(frames):
        if "/torch/" not in f and "/autopar/" not in f:
            return f"{Path(f).name}:{line}"
    return ""


def _module(node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, typ = list(stack.values())[-1]
    typ = getattr(typ, "__module__", "") + "." + getattr(typ, "__qualname__", str(typ)) if not isinstance(typ, str) else typ
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("_modules['", "").replace("']", "")
    if node.meta.get("autopar_step"):
        path = path[len(_STEP_PREFIX):] if path.startswith(_STEP_PREFIX) else ("" if path == "model" else path)
    return path, typ


def _classify(name: str, n_act: int, node) -> str:
    """The kind of the one op family matching aten op ``name`` (``autopar.ops.classify``),
    ``other`` when none does."""
    fam = classify("aten." + name, n_act, node)
    return fam.kind if fam is not None else OTHER


def _attrs_and_flops(spec: OpSpec) -> tuple[dict, float, float]:
    """(attributes, forward FLOPs, backward FLOPs) of a traced op from its family."""
    fam = family_of(spec.kind)
    attrs = fam.attrs(spec)
    spec.attrs = attrs
    fwd, bwd = fam.flops(spec)
    return attrs, float(fwd), float(bwd)


def export_graph(mf: ModelFile, batch_size: int, dtype=None):
    """(graph module, signature maps, input names, tracer used) traced on meta tensors
    (``dtype``: the model and its floating inputs converted first, see ``_symbolic_casts``)."""
    import torch

    try:
        with torch.device("meta"):
            model = mf.build_model()
            inputs = mf.example_inputs(batch_size)
    except Exception as e:
        raise ModelFileError(f"build_model()/example_inputs() failed on the meta device: "
                             f"{e.__class__.__name__}: {e}",
                             "create tensors without fixed devices or data (torch.randn(...), not torch.tensor(data))") from None
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(f"build_model() returned {type(model).__name__}, not an nn.Module",
                             "return the torch.nn.Module to parallelize")
    model.train()
    if dtype is not None:
        model.to(dtype)
        inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                       for x in inputs)
    # The recorder gives export's graph without importing torch._dynamo (``trace.recorder``);
    # what it does not reproduce falls back to export below.
    returns_tensor = None
    try:
        gm, params, buffers, user_inputs = recorder.record(model, inputs)
        return gm, _canonical(params, model), _canonical(buffers, model), user_inputs, RECORDER
    except recorder.NotOneTensor:
        returns_tensor = False
    except recorder.Unsupported:
        pass
    if returns_tensor is False or not _returns_tensor(model, inputs):
        gm, params, buffers, user_inputs, tracer = export_step(mf, model, inputs, batch_size, dtype)
        return gm, _canonical(params, model), _canonical(buffers, model), user_inputs, tracer
    try:
        ep = torch.export.export(model, inputs, strict=False)
        sig = ep.graph_signature
        params = _canonical(dict(sig.inputs_to_parameters), model)
        buffers = _canonical(dict(sig.inputs_to_buffers), model)
        user_inputs = list(sig.user_inputs)
        return ep.graph_module, params, buffers, user_inputs, "torch.export"
    except Exception as export_error:
        first_error = export_error
    # Fallback: fx proxy-tensor tracing (make_fx), functional over params and buffers.
    try:
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.func import functional_call
        pnames = [n for n, _ in model.named_parameters()]
        bnames = [n for n, _ in model.named_buffers()]
        pvals = [p for _, p in model.named_parameters()]
        bvals = [b for _, b in model.named_buffers()]

        def f(*flat):
            ps = dict(zip(pnames, flat[:len(pnames)]))
            bs = dict(zip(bnames, flat[len(pnames):len(pnames) + len(bnames)]))
            return functional_call(model, {**ps, **bs}, tuple(flat[len(pnames) + len(bnames):]))

        gm = make_fx(f, pre_dispatch=True)(*pvals, *bvals, *inputs)
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        params = {phs[i].name: pnames[i] for i in range(len(pnames))}
        buffers = {phs[len(pnames) + i].name: bnames[i] for i in range(len(bnames))}
        user_inputs = [n.name for n in phs[len(pnames) + len(bnames):]]
        return gm, params, buffers, user_inputs, "make_fx"
    except Exception:
        raise _trace_error(first_error) from None


def _canonical(names: dict[str, str], model) -> dict[str, str]:
    """Tied parameters and buffers (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``)
    under the one name ``named_parameters()`` / ``named_buffers()`` gives them, the name the
    runtime shards and the validation compares."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for named in (model.named_parameters, model.named_buffers):
        for q, t in named(remove_duplicate=False):
            alias[q] = first.setdefault(id(t), q)
    return {k: alias.get(v, v) for k, v in names.items()}


def _returns_tensor(model, inputs) -> bool:
    """Whether ``model`` returns a plain tensor (one eager forward on meta tensors, nothing
    allocated); True when that run fails, so that export names the failing line."""
    import torch
    try:
        with torch.no_grad():
            return isinstance(model(*inputs), torch.Tensor)
    except Exception:
        return True


STEP_TRACER = "torch.export (training step)"
RECORDER = "pre-dispatch recorder"
_STEP_PREFIX = "model."


def export_step(mf: ModelFile, model, inputs: tuple, batch_size: int, dtype=None):
    """Export the training step ``loss_fn(model(*inputs), targets)`` of a model returning a
    structure (a ``ModelOutput``, a cache object, any non-tensor output) and keep what the loss
    reads of the model's output.

    The step module returns ``(loss, *tensor leaves of the output)``; the loss is fed the
    output's structure with every non-tensor, non-constant leaf (a ``DynamicCache``) dropped
    (``modelfile.split_output``), as the distributed model returns it. The one tensor leaf the
    loss depends on becomes the graph's output; the loss's own ops and the targets are removed
    (the runtime computes each rank's share of the loss with the user's ``loss_fn`` on its
    block of that tensor). Same return as ``export_graph``."""
    import torch
    import torch.utils._pytree as pytree


    loss_fn = mf.loss_fn()
    with torch.device("meta"):
        targets = mf.example_targets(batch_size)
    if dtype is not None and isinstance(targets, torch.Tensor) and targets.is_floating_point():
        targets = targets.to(dtype)
    found: dict[str, Any] = {}

    class _Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, xs, y):
            spec, leaves, paths = split_output(self.model(*xs))
            found["paths"] = [p for p, v in zip(paths, leaves) if isinstance(v, torch.Tensor)]
            out = pytree.tree_unflatten(leaves, spec)
            loss = loss_fn(out, y) if y is not None else loss_fn(out)
            return (loss, *[v for v in leaves if isinstance(v, torch.Tensor)])

    step = _Step()
    step.train()
    try:
        ep = torch.export.export(step, (tuple(inputs), targets), strict=False)
    except Exception as e:
        raise _step_error(e, loss_fn) from None
    gm = ep.graph_module
    sig = ep.graph_signature
    strip = lambda q: q[len(_STEP_PREFIX):] if q.startswith(_STEP_PREFIX) else q  # noqa: E731
    params = {k: strip(v) for k, v in sig.inputs_to_parameters.items()}
    buffers = {k: strip(v) for k, v in sig.inputs_to_buffers.items()}
    user_inputs = list(sig.user_inputs)
    model_inputs, target_inputs = user_inputs[:len(inputs)], set(user_inputs[len(inputs):])
    nodes = {n.name: n for n in gm.graph.nodes}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    user_outs = [nodes[o] if isinstance(o, str) else o for o in sig.user_outputs]
    loss, leaves = user_outs[0], user_outs[1:]
    if not isinstance(loss, torch.fx.Node):
        raise TraceError("the loss does not depend on the model's output", "return a loss computed from the output")
    feeding = _ancestors(loss) | {loss}
    read = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.fx.Node) and leaf in feeding]
    paths = found.get("paths", [f"output[{i}]" for i in range(len(leaves))])
    if len(read) != 1:
        raise TraceError(f"the loss reads {len(read)} tensors of the model's output"
                         f"{' (' + ', '.join(paths[i] for i in read) + ')' if read else ''}; "
                         "autopar plans a training step whose loss reads one",
                         "compute the loss from one output tensor (e.g. output.logits)")
    keep = leaves[read[0]]
    needed = _ancestors(keep) | {keep}
    # the loss's own ops (ancestors of the loss the kept tensor does not need) and the targets
    drop = [n for n in gm.graph.nodes if n.op == "call_function" and n in feeding and n not in needed]
    out_node.args = (keep,)
    for n in reversed(drop):
        if not n.users:                        # (a value the model also uses elsewhere stays)
            gm.graph.erase_node(n)
    for n in list(gm.graph.nodes):
        if n.op == "placeholder" and n.name in target_inputs and not n.users:
            gm.graph.erase_node(n)
    for n in gm.graph.nodes:
        n.meta["autopar_step"] = True        # module paths lose the step's "model." prefix
    return gm, params, buffers, model_inputs, STEP_TRACER


def _ancestors(node) -> set:
    seen: set = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _step_error(e: Exception, loss_fn) -> TraceError:
    """The TraceError of a training step that does not export: a failure inside ``loss_fn``
    names the loss and its line; any other is the model's (``_trace_error``)."""
    import traceback
    code = getattr(loss_fn, "__code__", None)
    tb = traceback.extract_tb(e.__traceback__)
    in_loss = [f for f in tb if code is not None and f.filename == code.co_filename and f.name == code.co_name]
    if not in_loss:
        return _trace_error(e)
    f = in_loss[-1]
    msg = str(e).strip().splitlines()
    return TraceError(f"the loss does not trace: {e.__class__.__name__}: {msg[0] if msg else ''} "
                      f"at {Path(f.filename).name}:{f.lineno} ({f.line})",
                      "write loss_fn with torch operations on the model's output (no .item()/.tolist(), "
                      "no data-dependent Python control flow), reading one output tensor such as output.logits")


def _trace_error(e: Exception) -> TraceError:
    import traceback
    msg = str(e).strip().splitlines()
    tb = traceback.extract_tb(e.__traceback__)
    user = [f for f in tb if "/torch/" not in f.filename and "/autopar/" not in f.filename]
    where = f" at {Path(user[-1].filename).name}:{user[-1].lineno} ({user[-1].line})" if user else ""
    m = re.search(r"File \"([^\"]+)\", line (\d+)", str(e))
    if not where and m and "/torch/" not in m.group(1):
        where = f" at {Path(m.group(1)).name}:{m.group(2)}"
    op = re.search(r"(aten\.[\w.]+|torch\.[\w.]+)", str(e))
    return TraceError(f"the model does not trace: {e.__class__.__name__}: {msg[0] if msg else ''}"
                      f"{' (operation ' + op.group(1) + ')' if op else ''}{where}",
                      "avoid data-dependent Python control flow and .item()/.tolist() in forward, "
                      "or rewrite the named line with torch operations")


def trace_model(mf: ModelFile, batch_size: int) -> LayerGraphData:
    """Trace ``mf`` at ``batch_size`` on meta tensors and group its ops into layers."""
    import torch

    gm, param_of, buffer_of, user_inputs, tracer = export_graph(mf, batch_size)
    ops: list[OpSpec] = []
    buffer_updates: list[OpSpec] = []
    inputs: list[GraphInput] = []
    act: dict[str, list[int]] = {}     # activation value -> global shape
    output_name = None
    multi: dict[str, Any] = {}         # ops returning several tensors (``MULTI_OUTPUT``)
    unregistered: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name not in user_inputs and node.name not in param_of and node.name not in buffer_of:
                const = _lifted_constant(node)   # a tensor made inside forward (an empty KV cache)
                if const is not None:
                    ops.append(const)
                    act[const.name] = list(const.out_shape)
                continue
            if node.name in user_inputs:
                val = node.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    raise TraceError(f"model input {node.name} is not a tensor", "pass tensors from example_inputs")
                inputs.append(GraphInput(node.name, list(val.shape), _dtype_name(val.dtype)))
                act[node.name] = list(val.shape)
            continue
        if node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            outs = [o for o in outs if o is not None]
            if len(outs) != 1:
                raise TraceError(f"the model returns {len(outs)} outputs; autopar plans models with one output tensor",
                                 "return one tensor from forward (e.g. the logits)")
            output_name = outs[0].name
            continue
        if node.op != "call_function":
            raise TraceError(f"unsupported graph node {node.op} {node.target}", "report this model to the autopar developers")
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)) and _base(node) in MULTI_OUTPUT:
            multi[node.name] = node          # read through its getitems, one slice each
            continue
        if node.target is operator.getitem and getattr(node.args[0], "name", None) in multi:
            if not node.users:
                continue                     # an unused piece: no op, no dead layer
            node = _getitem_as_call(node, multi[node.args[0].name])
        if val is None and not node.users and _base(node).startswith("_assert"):
            continue                         # a run-time check of metadata (dtype, shape): no value
        if not isinstance(val, torch.Tensor):
            raise TraceError(f"operation {node.target} returns {type(val).__name__}, not one tensor"
                             f"{' at ' + _source(node) if _source(node) else ''}",
                             "use single-output operations (of the ops returning several tensors, autopar "
                             f"reads {', '.join(sorted(MULTI_OUTPUT))})")
        target = str(node.target)
        name = target.split(".", 1)[1] if target.startswith("aten.") else target

        def ref(a):
            if hasattr(a, "op") and hasattr(a, "name"):
                if a.name in param_of:
                    return {"p": param_of[a.name]}
                if a.name in buffer_of:
                    return {"b": buffer_of[a.name]}
                return {"v": a.name}
            if isinstance(a, (list, tuple)):
                return [ref(x) for x in a]
            if isinstance(a, torch.dtype):
                return {"dtype": _dtype_name(a)}
            if isinstance(a, (torch.device, torch.memory_format, torch.layout)):
                return None
            if isinstance(a, float) and not math.isfinite(a):
                return {"float": repr(a)}     # JSON has no inf/nan (a -inf causal mask)
            return a

        full = _full_args(node)
        args = [ref(a) for a in full]
        if target == "aten.to.device":       # the traced device is meta: follow the run's device
            target, name, args = "aten.to.dtype", "to.dtype", [args[0]] + args[2:]
        kwargs = {k: ref(v) for k, v in node.kwargs.items()
                  if not any(k == a.name for a in getattr(getattr(node.target, "_schema", None), "arguments", [])
                             if not a.kwarg_only)}
        kwargs = _unambiguous(node, {k: v for k, v in kwargs.items() if v is not None})
        act_inputs = []

        def collect(a):
            if hasattr(a, "op") and hasattr(a, "name"):
                if a.name in act and a.name not in act_inputs:
                    act_inputs.append(a.name)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    collect(x)
        for a in full:
            collect(a)
        for v in node.kwargs.values():
            collect(v)
        pnames: dict[str, str] = {}
        pshapes: dict[str, list[int]] = {}
        bnames: dict[str, str] = {}
        schema_args = getattr(getattr(node.target, "_schema", None), "arguments", [])
        for i, a in enumerate(full):
            if hasattr(a, "name") and (a.name in param_of or a.name in buffer_of):
                role = schema_args[i].name if i < len(schema_args) else f"arg{i}"
                role = {"input": "input", "self": "self"}.get(role, role)
                if a.name in param_of:
                    pnames[role] = param_of[a.name]
                    pshapes[role] = list(a.meta["val"].shape)
                else:
                    bnames[role] = buffer_of[a.name]
        module, mtype = _module(node)
        if not act_inputs and (name.endswith("_.Tensor") or name.split(".")[0].endswith("_")) and bnames:
            kind = BUFFER_UPDATE
        else:
            kind = _classify(name, len(act_inputs), node)
        in_shapes = [act[v] for v in act_inputs]
        spec = OpSpec(name=node.name, kind=kind, target=target, args=args, kwargs=kwargs,
                      out_shape=list(val.shape), dtype=_dtype_name(val.dtype), inputs=act_inputs,
                      in_shapes=in_shapes, params=pshapes, param_names=pnames, buffers=bnames,
                      module=module, module_type=mtype, source=_source(node))
        spec.attrs, spec.flops_fwd, spec.flops_bwd = _attrs_and_flops(spec)
        if kind == OTHER and act_inputs:
            unregistered.append(target)
        if kind == BUFFER_UPDATE:
            buffer_updates.append(spec)
            continue
        if not act_inputs:
            # made from constants or parameters only (position ids from arange, a causal mask):
            # an ordinary op with no activation input, computed whole on every rank (only
            # ``replicate`` can take it; the consumer's layout slices it locally, no traffic)
            spec.attrs = {**spec.attrs, "constant": True}
        ops.append(spec)
        act[node.name] = list(val.shape)
    _drop_symbolic_casts(ops, mf, batch_size)
    if output_name is None or output_name not in act:
        raise TraceError("the model's output is not computed from its inputs", "return a tensor computed from the inputs")
    data = group_layers(ops, inputs, output_name, batch_size, mf.name)
    _mark_tied(data)
    data.buffer_updates = buffer_updates
    data.tracer = tracer
    data.unregistered = unregistered
    return mark_graph_items(data)


def _lifted_constant(node) -> OpSpec | None:
    """A tensor constant that ``forward`` creates from data (``torch.tensor([])``, e.g. the
    empty key/value tensors a ``DynamicCache`` starts from), lifted by export to an input. An
    empty one is remade on every rank by ``aten.empty`` (an op with no activation input, run
    whole on every rank); the values of a non-empty one are unknown on meta tensors: a
    TraceError names the line that uses it. None when nothing uses it."""
    import torch
    if not node.users:
        return None
    val = node.meta.get("val")
    user = next(iter(node.users))
    where = _source(user)
    if not isinstance(val, torch.Tensor) or val.numel() != 0:
        raise TraceError(f"a tensor constant with data is created inside forward"
                         f"{' (used at ' + where + ')' if where else ''}; its values are unknown when "
                         "tracing on meta tensors",
                         "register it as a buffer in __init__ (self.register_buffer) or build it with "
                         "torch.arange/torch.full/torch.ones")
    spec = OpSpec(name=node.name, kind=OTHER, target="aten.empty.memory_format",
                  args=[list(val.shape)], kwargs={"dtype": {"dtype": _dtype_name(val.dtype)}, "pin_memory": False},
                  out_shape=list(val.shape), dtype=_dtype_name(val.dtype), inputs=[], in_shapes=[],
                  params={}, param_names={}, buffers={}, module=_module(user)[0],
                  module_type=_module(user)[1], source=where)
    spec.kind = _classify("empty.memory_format", 0, None)
    spec.attrs, spec.flops_fwd, spec.flops_bwd = _attrs_and_flops(spec)
    spec.attrs = {**spec.attrs, "constant": True}
    return spec


_CASTS = ("aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten._to_copy.default")


def _drop_symbolic_casts(ops: list[OpSpec], mf: ModelFile, batch_size: int) -> None:
    """Turn casts that only follow the model's own dtype into identities, in place.

    Traced in float32, ``x.to(x.device)`` and ``h.to(input_dtype)`` record ``dtype=float32``
    like an explicit ``h.to(torch.float32)`` (Llama's RMSNorm) does; run in float64 (the
    validation) the first two must stay float64, the last must round to float32 as the user's
    model does. A cast that is a no-op in the float32 trace is therefore looked up in a second
    trace of the model in float64 (the same node names; only when such casts exist): one that
    casts to float64 there follows the model's dtype and becomes ``aten.alias`` (a widening
    cast back to the model's dtype is exact, and the next op with a parameter or activation
    of the model's dtype promotes to it as the user's model computes); otherwise (or when the
    node is not found) the traced cast is kept."""
    noop = [op for op in ops if op.target in _CASTS and op.inputs and op.in_shapes
            and op.dtype in ("float32",) and _in_dtype(op, ops) == op.dtype]
    if not noop:
        return
    import torch
    try:
        gm = export_graph(mf, batch_size, dtype=torch.float64)[0]
    except Exception:
        return                                  # keep every cast as traced
    nodes = {n.name: n for n in gm.graph.nodes}
    explicit: dict[str, str] = {}              # kept cast -> its source value
    for op in noop:
        n = nodes.get(op.name)
        if n is None or str(n.target) not in _CASTS or not n.args:
            continue
        out, src = n.meta.get("val"), getattr(n.args[0], "meta", {}).get("val")
        if isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out.dtype == torch.float64:
            op.target, op.args, op.kwargs = "aten.alias.default", [{"v": op.inputs[0]}], {}
            op.kind = _classify("alias.default", 1, None)
            op.attrs, op.flops_fwd, op.flops_bwd = _attrs_and_flops(op)
        elif getattr(n.args[0], "name", None) == op.inputs[0]:
            explicit[op.name] = op.inputs[0]
    # A no-op ``x.to(torch.float32)`` returns ``x`` itself, so the float32 trace records later
    # uses of ``x`` (a residual) as uses of the cast; the float64 trace shows which they are.
    for op in ops:
        n = nodes.get(op.name)
        if n is None or not any(v in explicit for v in op.inputs):
            continue
        reads = {a.name for a in n.all_input_nodes}
        swap = {v: explicit[v] for v in op.inputs if v in explicit and v not in reads and explicit[v] in reads}
        if swap:
            _rewire(op, swap)


def _rewire(op: OpSpec, swap: dict[str, str]) -> None:
    """Make ``op`` read value ``swap[v]`` where it read ``v`` (inputs, shapes, argument refs)."""
    def sub(a):
        if isinstance(a, dict):
            return {"v": swap[a["v"]]} if set(a) == {"v"} and a["v"] in swap else {k: sub(x) for k, x in a.items()}
        if isinstance(a, list):
            return [sub(x) for x in a]
        return a
    op.args, op.kwargs = sub(op.args), sub(op.kwargs)
    inputs, shapes = [], []
    for v, sh in zip(op.inputs, op.in_shapes):
        v = swap.get(v, v)
        if v not in inputs:
            inputs.append(v)
            shapes.append(sh)
    op.inputs, op.in_shapes = inputs, shapes


def _in_dtype(op: OpSpec, ops: list[OpSpec]) -> str | None:
    for o in ops:
        if o.name == op.inputs[0]:
            return o.dtype
    return None


_REF_KEYS = ("v", "p", "b", "dtype", "float")


def _unambiguous(node, kwargs: dict) -> dict:
    """Keyword arguments that cannot be read as one reference: ``{"dtype": {"dtype": "float64"}}``
    (``x.to(dtype=...)``) has the shape of a dtype reference, so the runtime would substitute the
    whole dict. A kw-only argument left at its plain default (``non_blocking=False``) is added
    to tell them apart."""
    if len(kwargs) != 1 or next(iter(kwargs)) not in _REF_KEYS:
        return kwargs
    for a in getattr(getattr(node.target, "_schema", None), "arguments", []):
        if a.kwarg_only and a.name not in kwargs and a.has_default_value() \
                and isinstance(a.default_value, (bool, int, float)):
            return {**kwargs, a.name: a.default_value}
    return kwargs


def _mark_tied(data: LayerGraphData) -> None:
    """Mark, in ``attrs["tied"]``, the roles of parameters that ops of several layers use (tied
    weights: GPT-2's and Llama's output head is the token embedding's weight). The runtime
    holds one sharding per parameter, so the ILP makes every layer using it hold it the same
    way (``cost.table.tied_choice_sets``, ``solve.ilp._add_tied``)."""
    users: dict[str, set[int]] = {}
    for lay in data.layers:
        for op in lay.ops:
            for q in op.param_names.values():
                users.setdefault(q, set()).add(lay.index)
    tied = {q for q, layers in users.items() if len(layers) > 1}
    for lay in data.layers:
        for op in lay.ops:
            roles = sorted(r for r, q in op.param_names.items() if q in tied)
            if roles:
                op.attrs = {**op.attrs, "tied": roles}


def _base(node) -> str:
    t = str(node.target)
    return t.split(".")[1] if t.startswith("aten.") else t


def _resolve(target: str):
    """'aten.slice.Tensor' -> torch.ops.aten.slice.Tensor."""
    import torch
    obj = torch.ops
    for p in target.split("."):
        obj = getattr(obj, p)
    return obj


def _getitem_as_call(item, src):
    """``getitem(src, i)`` of a several-output op as the one single-output call its family
    names (``OpFamily.getitem``: a split piece is a slice), a stand-in node with the getitem's
    name and value; a TraceError for a used output no single call expresses."""
    from types import SimpleNamespace
    fam = MULTI_OUTPUT[_base(src)]
    index = int(item.args[1])
    x = src.args[0]
    x_shape = list(x.meta["val"].shape) if hasattr(x, "meta") and "val" in x.meta else []
    call = fam.getitem(_base(src), _full_args(src), dict(src.kwargs), index, x_shape)
    if call is None:
        raise TraceError(f"output {index} of {src.target} is used but autopar reads only "
                         f"{src.target} through single-output ops{' at ' + _source(src) if _source(src) else ''}",
                         "compute that value with a separate single-output operation")
    target, args, kwargs = call
    meta = {**src.meta, "val": item.meta.get("val")}
    return SimpleNamespace(op="call_function", name=item.name, target=_resolve(target),
                           args=tuple(args), kwargs=kwargs, meta=meta, users=item.users)


def _transparent(op: OpSpec) -> bool:
    """Whether ``op`` may fold into its producer's layer (``OpFamily.is_transparent``)."""
    return family_of(op.kind).is_transparent(op)


def group_layers(ops: list[OpSpec], inputs: list[GraphInput], output: str, batch_size: int,
                 model_name: str) -> LayerGraphData:
    consumers: dict[str, int] = {}
    for op in ops:
        for v in op.inputs:
            consumers[v] = consumers.get(v, 0) + 1
    consumers[output] = consumers.get(output, 0) + 1
    layers: list[Layer] = []
    layer_of_value: dict[str, int] = {}
    for op in ops:
        if _transparent(op):
            v = op.inputs[0]
            li = layer_of_value.get(v)
            if li is not None and layers[li].output == v and consumers.get(v, 0) == 1:
                lay = layers[li]
                lay.ops.append(op)
                lay.output = op.name
                layer_of_value[op.name] = li
                continue
        lay = Layer(index=len(layers), name=op.name, ops=[op], inputs=list(op.inputs),
                    output=op.name, module=op.module)
        layers.append(lay)
        layer_of_value[op.name] = lay.index
    return LayerGraphData(layers=layers, inputs=inputs, output=output, batch_size=batch_size,
                          model_name=model_name)
