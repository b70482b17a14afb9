"""Trace a model without allocating it and build its layer graph.

The model is built under ``torch.device("meta")`` and traced with ``torch.export`` (non-strict)
on meta inputs: nothing is allocated, so a 1x1x512^3 input traces in well under a second. Where
export fails, ``make_fx`` (fx proxy-tensor tracing, pre-dispatch) is tried; where both fail the
TraceError names the operation and the user's source line.

Each call_function node becomes an ``OpSpec`` with global shapes, normalised attributes and
analytic FLOPs; ops are grouped into layers (``autopar.decomp.ir``): an op joins its producer's
layer when it is layout-transparent (batch norm, activation, dropout, an elementwise op with one
activation operand), consumes only that layer's output, and is that output's only consumer.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

from ..decomp.ir import (ADAPTIVE_POOL, BATCH_NORM, BINARY, BUFFER_UPDATE, CAT, CONV, DROPOUT,
                         FLATTEN, LINEAR, MEAN, OTHER, POOL, UNARY, VIEW, GraphInput, Layer,
                         LayerGraphData, OpSpec)
from ..errors import TraceError
from ..modelfile import ModelFile

UNARY_OPS = {"relu", "relu_", "gelu", "sigmoid", "tanh", "silu", "silu_", "hardtanh", "hardtanh_",
             "leaky_relu", "leaky_relu_", "elu", "hardswish", "hardsigmoid", "softplus", "clone",
             "contiguous", "neg", "exp", "abs", "sqrt", "rsqrt", "square", "mish", "relu6", "alias",
             "detach", "_to_copy", "to", "sin", "cos", "log", "reciprocal"}
BINARY_OPS = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "maximum", "minimum", "pow"}
POOL_OPS = {"max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d"}


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


def _expand(v, n):
    if isinstance(v, (list, tuple)):
        v = list(v)
        if len(v) == 1:
            return [int(v[0])] * n
        if len(v) == 0:
            return None
        return [int(x) for x in v]
    return [int(v)] * n


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
    return path, typ


def _classify(name: str, n_act: int, node) -> str:
    base = name.split(".")[0]
    if base in ("conv1d", "conv2d", "conv3d"):
        return CONV
    if base == "convolution":
        return CONV if not node.args[6] else OTHER
    if base == "linear":
        return LINEAR
    if base == "batch_norm":
        return BATCH_NORM
    if base in POOL_OPS:
        return POOL
    if base in ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"):
        return ADAPTIVE_POOL
    if base == "mean":
        return MEAN
    if base == "flatten":
        return FLATTEN
    if base in ("view", "reshape", "_unsafe_view"):
        return VIEW
    if base in ("dropout", "feature_dropout"):
        return DROPOUT
    if base == "cat":
        return CAT
    if base in UNARY_OPS and n_act == 1:
        return UNARY
    if base in BINARY_OPS and n_act in (1, 2):
        return BINARY
    return OTHER


def _conv_padding(pad, k, dil, nsp):
    if isinstance(pad, str):
        if pad == "valid":
            return [0] * nsp
        if pad == "same":
            eff = [d * (kk - 1) for kk, d in zip(k, dil)]
            if all(e % 2 == 0 for e in eff):
                return [e // 2 for e in eff]
            return "same"
    return _expand(pad, nsp)


def _attrs_and_flops(kind: str, name: str, args: list[Any], in_shapes, out_shape, params) -> tuple[dict, float, float]:
    out_numel = math.prod(out_shape) if out_shape else 1
    in_numel = sum(math.prod(s) for s in in_shapes)
    if kind == CONV:
        w = params["weight"]
        nsp = len(w) - 2
        if name.startswith("convolution"):
            stride, pad, dil, groups = args[3], args[4], args[5], args[8]
        else:
            stride, pad, dil, groups = args[3], args[4], args[5], args[6]
        dil = _expand(dil, nsp)
        attrs = {"stride": _expand(stride, nsp), "dilation": dil,
                 "padding": _conv_padding(pad, w[2:], dil, nsp), "groups": int(groups),
                 "transposed": False}
        fl = 2.0 * out_shape[0] * w[0] * math.prod(out_shape[2:]) * w[1] * math.prod(w[2:])
        return attrs, fl, 2 * fl
    if kind == LINEAR:
        w = params["weight"]
        m = math.prod(in_shapes[0][:-1])
        fl = 2.0 * m * w[0] * w[1]
        return {}, fl, 2 * fl
    if kind == BATCH_NORM:
        return {"training": bool(args[5]), "momentum": float(args[6]) if args[6] is not None else 0.1,
                "eps": float(args[7])}, 8.0 * out_numel, 12.0 * out_numel
    if kind == POOL:
        nsp = len(out_shape) - 2
        k = _expand(args[1], nsp)
        stride = _expand(args[2], nsp) or k
        attrs = {"pool": "max" if name.startswith("max") else "avg", "kernel": k, "stride": stride,
                 "padding": _expand(args[3], nsp) if len(args) > 3 else [0] * nsp}
        if attrs["pool"] == "max":
            attrs["dilation"] = _expand(args[4], nsp) if len(args) > 4 else [1] * nsp
            attrs["ceil_mode"] = bool(args[5]) if len(args) > 5 else False
        else:
            attrs["dilation"] = [1] * nsp
            attrs["ceil_mode"] = bool(args[4]) if len(args) > 4 else False
            attrs["count_include_pad"] = bool(args[5]) if len(args) > 5 else True
        return attrs, float(in_numel), 2.0 * in_numel
    if kind == ADAPTIVE_POOL:
        return {"output_size": list(args[1]) if isinstance(args[1], (list, tuple)) else [args[1]],
                "pool": "avg"}, float(in_numel), float(in_numel)
    if kind == MEAN:
        dims = args[1] if len(args) > 1 and args[1] is not None else list(range(len(in_shapes[0])))
        dims = [d % len(in_shapes[0]) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        return {"dims": dims, "keepdim": bool(args[2]) if len(args) > 2 else False}, float(in_numel), float(in_numel)
    if kind == FLATTEN:
        return {"start_dim": int(args[1]) if len(args) > 1 else 0,
                "end_dim": int(args[2]) if len(args) > 2 else -1}, 0.0, 0.0
    if kind == DROPOUT:
        return {"p": float(args[1]), "train": bool(args[2])}, float(out_numel), float(out_numel)
    if kind == CAT:
        return {"dim": int(args[1]) if len(args) > 1 else 0}, 0.0, 0.0
    if kind == VIEW:
        return {}, 0.0, 0.0
    return {}, float(out_numel), 2.0 * out_numel


def export_graph(mf: ModelFile, batch_size: int):
    """(graph module, signature maps, input names, tracer used) traced on meta tensors."""
    import torch

    try:
        with torch.device("meta"):
            model = mf.build_model()
            inputs = mf.example_inputs(batch_size)
    except Exception as e:
        from ..errors import ModelFileError
        raise ModelFileError(f"build_model()/example_inputs() failed on the meta device: "
                             f"{e.__class__.__name__}: {e}",
                             "create tensors without fixed devices or data (torch.randn(...), not torch.tensor(data))") from None
    if not isinstance(model, torch.nn.Module):
        from ..errors import ModelFileError
        raise ModelFileError(f"build_model() returned {type(model).__name__}, not an nn.Module",
                             "return the torch.nn.Module to parallelize")
    model.train()
    try:
        ep = torch.export.export(model, inputs, strict=False)
        sig = ep.graph_signature
        params = dict(sig.inputs_to_parameters)
        buffers = dict(sig.inputs_to_buffers)
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
    for node in gm.graph.nodes:
        if node.op == "placeholder":
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
        if not isinstance(val, torch.Tensor):
            raise TraceError(f"operation {node.target} returns {type(val).__name__}, not one tensor"
                             f"{' at ' + _source(node) if _source(node) else ''}",
                             "use single-output operations (e.g. max_pool2d without return_indices)")
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
            return a

        full = _full_args(node)
        args = [ref(a) for a in full]
        kwargs = {k: ref(v) for k, v in node.kwargs.items()
                  if not any(k == a.name for a in getattr(getattr(node.target, "_schema", None), "arguments", [])
                             if not a.kwarg_only)}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
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
        if not act_inputs:
            kind = BUFFER_UPDATE if (name.endswith("_.Tensor") or name.split(".")[0].endswith("_")) and bnames else OTHER
        else:
            kind = _classify(name, len(act_inputs), node)
        in_shapes = [act[v] for v in act_inputs]
        attrs, ffwd, fbwd = _attrs_and_flops(kind, name, full, in_shapes, list(val.shape), pshapes)
        spec = OpSpec(name=node.name, kind=kind, target=target, args=args, kwargs=kwargs,
                      out_shape=list(val.shape), dtype=_dtype_name(val.dtype), inputs=act_inputs,
                      in_shapes=in_shapes, params=pshapes, param_names=pnames, buffers=bnames,
                      attrs=attrs, module=module, module_type=mtype, source=_source(node),
                      flops_fwd=ffwd, flops_bwd=fbwd)
        if kind == BUFFER_UPDATE:
            buffer_updates.append(spec)
            continue
        if not act_inputs:
            raise TraceError(f"operation {target} computes a tensor from parameters or constants only"
                             f"{' at ' + spec.source if spec.source else ''}",
                             "autopar plans ops on activations; move parameter-only computation out of forward")
        ops.append(spec)
        act[node.name] = list(val.shape)
    if output_name is None or output_name not in act:
        raise TraceError("the model's output is not computed from its inputs", "return a tensor computed from the inputs")
    data = group_layers(ops, inputs, output_name, batch_size, mf.name)
    data.buffer_updates = buffer_updates
    data.tracer = tracer
    return data


def _transparent(op: OpSpec) -> bool:
    if op.kind in (BATCH_NORM, UNARY, DROPOUT):
        return len(op.inputs) == 1
    if op.kind == BINARY:
        return len(op.inputs) == 1 and op.in_shapes[0] == op.out_shape
    return False


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
