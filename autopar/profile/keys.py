"""Keys of the profile's exact tables: a convolution or linear shape (``shape_key``, over
``normalize_spec``) and any other op on its local shapes (``op_spec``, ``op_key``). Pure:
canonical strings of plain dicts, no torch. Measured by ``calibrate.kernels.measure_exact``
and ``calibrate.exact_ops``; read by ``cost.primitives``."""

from __future__ import annotations

import json

from ..ops import family_of


def _tuple(v, n: int, name: str) -> list[int]:
    if v is None:
        raise ValueError(f"{name} is required")
    if isinstance(v, int):
        return [int(v)] * n
    v = [int(a) for a in v]
    if len(v) == 1 and n > 1:
        v = v * n
    if len(v) != n:
        raise ValueError(f"{name} has {len(v)} entries, expected {n}")
    return v


def normalize_spec(spec: dict) -> dict:
    """Fill defaults (stride 1, padding 0, dilation 1, groups 1, float32) and canonical types."""
    op = spec.get("op")
    if op == "conv":
        x = [int(a) for a in spec["x"]]
        w = [int(a) for a in spec["w"]]
        d = len(x) - 2
        if d < 1 or len(w) != len(x):
            raise ValueError(f"conv spec needs x [N,C,*spatial] and w [F,C/g,*k] of equal rank: {spec}")
        pad = spec.get("padding", 0)
        out = {"op": "conv", "x": x, "w": w,
               "stride": _tuple(spec.get("stride", 1), d, "stride"),
               "padding": pad if isinstance(pad, str) else _tuple(pad, d, "padding"),
               "dilation": _tuple(spec.get("dilation", 1), d, "dilation"),
               "groups": int(spec.get("groups", 1))}
        if x[1] != w[1] * out["groups"]:
            raise ValueError(f"conv spec: C={x[1]} != w[1]*groups={w[1]}*{out['groups']}")
    elif op == "linear":
        x = [int(a) for a in spec["x"]]
        w = [int(a) for a in spec["w"]]
        if len(w) != 2 or x[-1] != w[1]:
            raise ValueError(f"linear spec needs x [..., K] and w [O, K]: {spec}")
        out = {"op": "linear", "x": x, "w": w}
    else:
        raise ValueError(f"shape spec op must be 'conv' or 'linear', got {op!r}")
    out["dtype"] = str(spec.get("dtype", "float32")).replace("torch.", "")
    return out


def shape_key(spec: dict) -> str:
    """Canonical string of a shape spec (a pure function of the spec; defaults filled in).

    e.g. ``conv2d x=8x3x32x32 w=16x3x3x3 s=1,1 p=1,1 d=1,1 g=1`` or ``linear x=64x512 w=10x512``;
    `` dtype=...`` is appended only for non-float32 specs.
    """
    s = normalize_spec(spec)
    dims = lambda v: "x".join(str(a) for a in v)  # noqa: E731
    commas = lambda v: v if isinstance(v, str) else ",".join(str(a) for a in v)  # noqa: E731
    if s["op"] == "conv":
        key = (f"conv{len(s['x']) - 2}d x={dims(s['x'])} w={dims(s['w'])} s={commas(s['stride'])} "
               f"p={commas(s['padding'])} d={commas(s['dilation'])} g={s['groups']}")
    else:
        key = f"linear x={dims(s['x'])} w={dims(s['w'])}"
    if s["dtype"] != "float32":
        key += f" dtype={s['dtype']}"
    return key


def op_spec(op, in_shapes, out_shape) -> dict | None:
    """The spec of ``op`` run on local ``in_shapes`` -> ``out_shape``; None when its op family
    is not measured this way (``OpFamily.exact_measured`` false: views, convolutions and
    linear layers, which ``kernels.measure_exact`` measures, ops with integer inputs, and
    unregistered ops). Parameters take their local shapes from the family (``local_params``:
    a batch norm's follow its input's channels)."""
    fam = family_of(op.kind)
    if fam.free or not fam.exact_measured:
        return None
    params = fam.local_params(op, in_shapes)
    return {"op": "generic", "kind": op.kind, "target": op.target, "args": op.args, "kwargs": op.kwargs,
            "inputs": list(op.inputs), "in_shapes": [list(map(int, s)) for s in in_shapes],
            "out_shape": list(map(int, out_shape)), "params": params, "param_names": op.param_names,
            "buffers": op.buffers, "dtype": op.dtype, "attrs": op.attrs}


def op_key(spec: dict) -> str:
    """Canonical key: target, local shapes, attributes, and the non-tensor arguments."""
    def strip(a):
        if isinstance(a, dict) and len(a) == 1 and next(iter(a)) in ("v", "p", "b"):
            return next(iter(a))
        if isinstance(a, list):
            return [strip(x) for x in a]
        return a
    shapes = ";".join("x".join(map(str, s)) for s in spec["in_shapes"])
    extra = json.dumps({"args": strip(spec["args"]), "kwargs": strip(spec["kwargs"])},
                       sort_keys=True, separators=(",", ":"), default=str)
    return f"op {spec['target']} in={shapes} out={'x'.join(map(str, spec['out_shape']))} {extra}"
