"""Record a model's forward as pre-dispatch ATen ops on meta tensors, without ``torch.export``.

``torch.export`` (and ``make_fx``, which it runs) import ``torch._dynamo`` (1-2 s on a cold
process) and track every op through fx proxies and fake tensors (about 1.2 s for ResNet-50);
autopar needs neither: the model is on the meta device and its shapes are static. This
recorder runs the forward once under a dispatch mode on the ``PreDispatch`` key, the level
``torch.export``'s training IR is taken at (``aten.conv2d``, ``aten.batch_norm``, in-place
``add_`` of a buffer), and writes each op into a ``torch.fx.Graph`` with the metadata the
tracer reads of an exported graph: ``val`` (the meta output), ``nn_module_stack`` (from module
call hooks: ``{key: (qualified path, "module.Class")}``, the root first) and ``stack_trace``
(the ``forward`` frames, as export keeps them). Nodes are named as ``make_fx`` names them, and
an op nothing uses stays (export keeps a causal mask that ``is_causal`` makes unused), so the
layer graph is the one ``torch.export`` gives (``benchmarks/compare_traces.py`` compares every shipped example).

Anything the recorder does not reproduce exactly raises ``Unsupported`` and the tracer falls
back to ``torch.export``: a forward that does not return one tensor (the training-step trace
handles those), a tensor that is neither an input, a parameter, a buffer nor an op's output (a
constant made from data), an op returning anything but a tensor or a tuple of tensors, a
change of grad mode or autocast inside forward, higher-order ops, an exception in forward.

Two things keep a cold trace cheap: batch norm's meta output is written directly
(``_LIKE_INPUT``) instead of running its Python decomposition, and torch's
``_disable_dynamo`` wrappers, which Python meta kernels pass through, run their function
directly while recording (``_dynamo_not_imported``) instead of importing ``torch._dynamo``.
"""

from __future__ import annotations

import operator
import sys
import weakref
from typing import Any


class Unsupported(Exception):
    """The recorder cannot reproduce ``torch.export``'s graph of this model: use export."""


class NotOneTensor(Unsupported):
    """The forward ran and returned something other than one tensor (a ``ModelOutput``): the
    training step is to be exported (``tracer.export_step``), no second forward needed to
    find that out."""


def record(model, inputs: tuple):
    """(graph holder with ``.graph``, parameter map, buffer map, user input names) of
    ``model(*inputs)``, the return of ``tracer.export_graph``; ``Unsupported`` otherwise."""
    import inspect

    import torch
    import torch.fx as fx
    from torch._subclasses.schema_check_mode import SchemaCheckMode
    from torch.utils._python_dispatch import TorchDispatchMode

    graph = fx.Graph()
    # id(tensor) -> (weak reference to it, the node whose value it is). No strong reference is
    # kept: a factory op's output held elsewhere reaches the caller as a new tensor object
    # (``make_variable`` shallow-copies a shared one), which the recorder would not know. The
    # node's ``val`` is a detached alias (same shape, dtype and storage) for the same reason.
    node_of: dict[int, tuple[Any, fx.Node]] = {}

    def track(t, node) -> None:
        node_of[id(t)] = (weakref.ref(t), node)

    params: dict[str, str] = {}
    buffers: dict[str, str] = {}

    def placeholder(name: str, t) -> fx.Node:
        n = graph.placeholder(name)
        n.name = name                     # export keeps the argument's name, even a builtin's
        n.meta["val"] = t
        track(t, n)
        return n

    def pname(prefix: str, q: str) -> str:
        return prefix + q.replace(".", "_")

    named_p = list(model.named_parameters())
    named_b = list(model.named_buffers())
    for q, p in named_p:
        n = placeholder(pname("p_", q), p)
        params[n.name] = q
    for q, b in named_b:
        n = placeholder(pname("b_", q), b)
        buffers[n.name] = q
    try:
        sig = inspect.signature(model.forward)
        arg_names = [k for k, v in sig.parameters.items()
                     if v.kind in (v.POSITIONAL_ONLY, v.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        raise Unsupported("no signature") from None
    if len(arg_names) < len(inputs) or any(not isinstance(x, torch.Tensor) for x in inputs):
        raise Unsupported("inputs are not one tensor per positional argument")
    user_inputs = []
    for name, x in zip(arg_names, inputs):
        if id(x) in node_of:
            raise Unsupported("an input is also a parameter or another input")
        user_inputs.append(placeholder(name, x).name)

    # module call stack, from global hooks: (path, "module.Class") per open call
    names = {id(m): q for q, m in model.named_modules(remove_duplicate=False)}
    stack: list[tuple[str, tuple[str, str]]] = []

    def pre_hook(mod, args):
        q = names.get(id(mod))
        if q is None:
            raise Unsupported(f"module {type(mod).__name__} called in forward is not a submodule")
        key = "L__self__" + ("" if q == "" else q)
        stack.append((key, (q, f"{type(mod).__module__}.{type(mod).__qualname__}")))

    def post_hook(mod, args, out):
        stack.pop()

    here = sys._getframe()
    grad0 = torch.is_grad_enabled()

    def stack_trace() -> str:
        """The ``forward`` frames between the recorder and the op, outermost first, in export's
        format (export records only frames of functions named ``forward``; ``tracer._source``
        reads the innermost one outside torch and autopar)."""
        frames = []
        f = sys._getframe(2)
        while f is not None and f is not here:
            co = f.f_code
            if co.co_name == "forward":
                frames.append(f'File "{co.co_filename}", line {f.f_lineno}, in forward')
            f = f.f_back
        frames.reverse()
        return "\n".join(frames)

    def arg(a):
        if isinstance(a, torch.Tensor):
            ref, n = node_of.get(id(a), (None, None))
            if ref is None or ref() is not a:
                raise Unsupported(f"a tensor made outside the traced ops (a constant with data): {tuple(a.shape)} {a.dtype}")
            return n
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        return a

    # Only FunctionalTensorMode, ProxyTorchDispatchMode (whose import pulls in torch._dynamo)
    # and SchemaCheckMode may sit on the PreDispatch key: the recorder derives from the last and
    # overrides everything it does.
    class _Recorder(SchemaCheckMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False              # nothing is compiled here: no torch._dynamo import

        def __init__(self):
            TorchDispatchMode.__init__(self, torch._C.DispatchKey.PreDispatch)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not isinstance(func, torch._ops.OpOverload):
                raise Unsupported(f"higher-order op {func}")
            if torch.is_grad_enabled() != grad0 or torch.is_autocast_enabled():
                raise Unsupported("grad mode or autocast changed inside forward")
            try:
                fargs, fkwargs = arg(args), arg(kwargs)
            except Unsupported as e:
                raise Unsupported(f"{func}: {e}") from None
            like = _LIKE_INPUT.get(func.name())
            out = torch.empty_like(args[0]) if like is not None and like(args) else func(*args, **kwargs)
            name = graph._target_to_str(func.overloadpacket.__name__)
            node = graph.create_node("call_function", func, fargs, fkwargs, name=name)
            node.meta["val"] = out.detach() if isinstance(out, torch.Tensor) else out
            node.meta["nn_module_stack"] = dict(stack)
            node.meta["stack_trace"] = stack_trace()
            if isinstance(out, torch.Tensor):
                track(out, node)
            elif isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
                for i, o in enumerate(out):
                    g = graph.create_node("call_function", operator.getitem, (node, i), {},
                                          name="getitem")
                    g.meta["val"] = o.detach()
                    g.meta["nn_module_stack"] = node.meta["nn_module_stack"]
                    g.meta["stack_trace"] = node.meta["stack_trace"]
                    track(o, g)
            elif out is not None:
                raise Unsupported(f"{func} returns {type(out).__name__}")
            return out

    from torch.nn.modules import module as _m
    h1 = _m.register_module_forward_pre_hook(pre_hook)
    h2 = _m.register_module_forward_hook(post_hook)
    try:
        with _no_backend_kernels(torch), _dynamo_not_imported(torch), torch._C._EnablePythonDispatcher(), \
                _Recorder():
            out = model(*inputs)
    except Unsupported:
        raise
    except Exception as e:
        raise Unsupported(f"{type(e).__name__}: {e}") from None
    finally:
        h1.remove()
        h2.remove()
    if not isinstance(out, torch.Tensor):
        raise NotOneTensor(f"the forward returns {type(out).__name__}")
    ref, out_node = node_of.get(id(out), (None, None))
    if ref is None or ref() is not out:
        raise Unsupported("the output is not computed by a traced op")
    graph.output((out_node,))
    from types import SimpleNamespace
    return SimpleNamespace(graph=graph), params, buffers, user_inputs


# Ops whose output is a tensor like their first argument (same shape, dtype, layout) and whose
# meta kernel is a slow Python decomposition: batch norm's (``torch._decomp``, 5 ms a call,
# a quarter of ResNet-50's recording). On meta tensors the op computes nothing and its
# running-statistics update changes nothing, so ``empty_like(input)`` is its exact meta output.
# Value: a check of the arguments for the case this holds in (4-D or 5-D or any input with
# batch norm's own argument list).
_LIKE_INPUT = {
    "aten::batch_norm": lambda args: len(args) == 9 and all(
        a is None or a.shape == (args[0].shape[1],) for a in args[1:5]),
}


class _dynamo_not_imported:
    """Run torch's ``_disable_dynamo``-wrapped functions directly while recording.

    Meta kernels written in Python (``torch._refs``: batch norm, relu, ...) go through
    elementwise wrappers marked ``torch._disable_dynamo``, whose first call imports
    ``torch._dynamo`` (1-2 s on a cold process) only to run the function outside a
    compilation. Nothing is compiled while recording, so each such wrapper found is given,
    for the duration, its own function as the "disabled" one (the attribute it caches it in);
    afterwards the attribute is removed again and the wrappers behave as before."""

    def __init__(self, torch) -> None:
        self.torch = torch
        self.set: list = []

    def __enter__(self):
        import gc
        if "torch._dynamo" in sys.modules:
            return self
        code = self.torch._compile._disable_dynamo(lambda: None).__code__
        for f in gc.get_referrers(code):
            cells = dict(zip(getattr(getattr(f, "__code__", None), "co_freevars", ()), f.__closure__ or ()))
            cell = cells.get("fn")
            fn = cell.cell_contents if cell is not None else None
            if fn is not None and getattr(fn, "__dynamo_disable", None) is None:
                try:
                    setattr(fn, "__dynamo_disable", fn)    # (a string: no name mangling)
                except (AttributeError, TypeError):
                    continue
                self.set.append(fn)
        return self

    def __exit__(self, *exc):
        for fn in self.set:
            if getattr(fn, "__dynamo_disable", None) is fn:
                delattr(fn, "__dynamo_disable")


class _no_backend_kernels:
    """mkldnn, nnpack and cudnn switched off while recording, as ``torch.export`` switches them
    off (``_ignore_backend_decomps``): ``aten.batch_norm`` records ``cudnn_enabled=False``."""

    def __init__(self, torch) -> None:
        self.b, self.c = torch.backends, torch.compiler

    def __enter__(self):
        self.saved = [m.set_flags(False) for m in (self.b.mkldnn, self.b.nnpack, self.b.cudnn)]
        # and, as export does, torch.compiler.is_compiling() / is_exporting() are True: a model
        # (PyG's MessagePassing) that takes another path when traced takes it here too
        self.flags = (self.c._is_compiling_flag, self.c._is_exporting_flag)
        self.c._is_compiling_flag = self.c._is_exporting_flag = True

    def __exit__(self, *exc):
        for m, flags in zip((self.b.mkldnn, self.b.nnpack, self.b.cudnn), self.saved):
            m.set_flags(*flags)
        self.c._is_compiling_flag, self.c._is_exporting_flag = self.flags
