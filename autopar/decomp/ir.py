"""The layer graph's value types: ops (one traced aten call each) grouped into layers.

An *op* is one call of the traced program (a convolution, a batch norm, a ReLU, an add...).
A *layer* is what the planner decides for: an anchor op plus the layout-transparent ops that
follow it in a chain (batch norm, activations, dropout), so that ``conv -> bn -> relu`` is one
choice. Every layer's ops run under the one decomposition chosen for the layer. Edges between
layers carry one activation tensor each; residual and skip edges are kept.

Values in op arguments are JSON-able: ``{"v": name}`` an activation, ``{"p": qualname}`` a
parameter, ``{"b": qualname}`` a buffer, anything else a literal (lists, numbers, strings,
None). Shapes are global (single-process) shapes. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..ops import BUFFER_UPDATE, OTHER  # noqa: F401  (re-exported kinds)
from ..ops import FAMILIES as _FAMILIES
from ..ops import KindSet as _KindSet

# Op kinds: the ``kind`` strings of the op families (``autopar.ops``, one module per family);
# aliases kept so that ``from autopar.decomp.ir import CONV`` goes on working. An op no family
# matches is ``OTHER`` and can only run replicated.
CONV, LINEAR, BATCH_NORM, UNARY, BINARY, POOL, ADAPTIVE_POOL, MEAN, FLATTEN, VIEW, DROPOUT, CAT, \
    LAYER_NORM, GROUP_NORM, RMS_NORM, MATMUL, SOFTMAX, ATTENTION, EMBEDDING, GATHER, SCATTER, \
    SUM, VAR, PERMUTE, SQUEEZE, EXPAND, SLICE, STACK, CROSS_ENTROPY, MSE_LOSS = (
        _FAMILIES[k].kind for k in (
            "conv", "linear", "batch_norm", "unary", "binary", "pool", "adaptive_pool", "mean",
            "flatten", "view", "dropout", "cat", "layer_norm", "group_norm", "rms_norm", "matmul",
            "softmax", "attention", "embedding", "gather", "scatter", "sum", "var", "permute",
            "squeeze", "expand", "slice", "stack", "cross_entropy", "mse_loss"))

#: Ops that keep the layout of their input and can be folded into the preceding layer
#: (a live view of the registry: ``OpFamily.transparent``).
TRANSPARENT = _KindSet(lambda f: f.transparent)
#: Ops that may own parameters whose gradients must be synchronised (``OpFamily.parametric``).
PARAMETRIC = _KindSet(lambda f: f.parametric)
#: Every registered kind (every op but ``OTHER``).
REGISTERED = _KindSet(lambda f: True)


@dataclass
class OpSpec:
    """One traced call: ``out = target(*args, **kwargs)`` with global shapes."""

    name: str                       # unique value name of the output (from the traced graph)
    kind: str                       # an op family's kind (``autopar.ops``) or "other"
    target: str                     # e.g. "aten.conv2d.default"
    args: list[Any]                 # JSON-able, with {"v"|"p"|"b": name} references
    kwargs: dict[str, Any]
    out_shape: list[int]
    dtype: str                      # e.g. "float32"
    inputs: list[str]               # activation value names consumed, in argument order
    in_shapes: list[list[int]]      # their global shapes
    params: dict[str, list[int]]    # role ("weight", "bias", ...) -> shape of the parameter
    param_names: dict[str, str]     # role -> qualified name in the user's model
    buffers: dict[str, str] = field(default_factory=dict)  # role -> qualified buffer name
    attrs: dict[str, Any] = field(default_factory=dict)    # normalised attributes (stride, ...)
    module: str = ""                # owning module path ("layer1.0.conv1"), "" for the root
    module_type: str = ""           # e.g. "torch.nn.modules.conv.Conv2d"
    source: str = ""                # "file.py:123" where the op was written, when known
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0

    @property
    def out_numel(self) -> int:
        return math.prod(self.out_shape)

    @property
    def param_numel(self) -> int:
        return sum(math.prod(s) for s in self.params.values())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(obj: dict[str, Any]) -> "OpSpec":
        return OpSpec(**obj)


DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
               "bool": 1, "uint8": 1, "int8": 1}


@dataclass
class Layer:
    """A planning unit: an anchor op and the transparent ops folded after it, or a sub-graph
    (``autopar.trace.units``: an attention block, a message-passing step, a branch) with
    several inputs and outputs, decided as one."""

    index: int
    name: str                       # anchor (first) op name
    ops: list[OpSpec]
    inputs: list[str]               # activation values entering the layer from outside
    output: str                     # the main value leaving the layer (last op's output)
    module: str = ""
    side_outputs: list[str] = field(default_factory=list)  # other values leaving a sub-graph
                                                           # unit (consumed outside it)

    @property
    def outputs(self) -> list[str]:
        """Every value leaving the layer, in op order: ``[output]`` for a chain layer."""
        if not self.side_outputs:
            return [self.output]
        leave = set(self.side_outputs) | {self.output}
        return [op.name for op in self.ops if op.name in leave]

    @property
    def anchor(self) -> OpSpec:
        return self.ops[0]

    @property
    def kind(self) -> str:
        return self.anchor.kind

    @property
    def out_shape(self) -> list[int]:
        return self.ops[-1].out_shape

    @property
    def dtype(self) -> str:
        return self.ops[-1].dtype

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 4)

    @property
    def param_numel(self) -> int:
        return sum(op.param_numel for op in self.ops)

    @property
    def flops_fwd(self) -> float:
        return sum(op.flops_fwd for op in self.ops)

    @property
    def flops_bwd(self) -> float:
        return sum(op.flops_bwd for op in self.ops)

    def in_shape(self, value: str) -> list[int]:
        for op in self.ops:
            for v, s in zip(op.inputs, op.in_shapes):
                if v == value:
                    return s
        raise KeyError(value)

    def value_shape(self, value: str) -> list[int]:
        """Global shape of a value produced or consumed inside the layer."""
        for op in self.ops:
            if op.name == value:
                return op.out_shape
        return self.in_shape(value)

    def to_json(self) -> dict[str, Any]:
        d = {"index": self.index, "name": self.name, "module": self.module,
             "inputs": self.inputs, "output": self.output,
             "ops": [op.to_json() for op in self.ops]}
        if self.side_outputs:
            d["side_outputs"] = list(self.side_outputs)
        return d

    @staticmethod
    def from_json(obj: dict[str, Any]) -> "Layer":
        return Layer(index=obj["index"], name=obj["name"], module=obj.get("module", ""),
                     inputs=list(obj["inputs"]), output=obj["output"],
                     ops=[OpSpec.from_json(o) for o in obj["ops"]],
                     side_outputs=list(obj.get("side_outputs", [])))


@dataclass
class GraphInput:
    name: str
    shape: list[int]
    dtype: str


@dataclass
class LayerGraphData:
    """The JSON-able part of a layer graph (the networkx view is built by ``trace.graph``)."""

    layers: list[Layer]
    inputs: list[GraphInput]
    output: str                     # name of the model's output value
    batch_size: int
    model_name: str = ""
    buffer_updates: list[OpSpec] = field(default_factory=list)  # buffer-only ops (BN counters)
    tracer: str = ""
    unregistered: list[str] = field(default_factory=list)  # targets no op family matched, one
                                                           # entry per op (run replicated)

    def __post_init__(self) -> None:
        mark_input_grads(self.layers)

    def producer(self) -> dict[str, int]:
        """value name -> index of the layer it leaves (graph inputs are absent)."""
        return {v: lay.index for lay in self.layers for v in lay.outputs}

    def edges(self) -> list[tuple[int, int, str]]:
        """(producer layer, consumer layer, value) for every activation edge between layers."""
        prod = self.producer()
        out = []
        for lay in self.layers:
            for v in lay.inputs:
                if v in prod:
                    out.append((prod[v], lay.index, v))
        return out

    def value_shape(self, value: str) -> list[int]:
        return self._value(value)[0]

    def value_dtype(self, value: str) -> str:
        """The traced dtype of a graph input or op output, without ``torch.`` (e.g. "float32")."""
        return str(self._value(value)[1]).replace("torch.", "")

    def _value(self, value: str) -> tuple[list[int], str]:
        for gi in self.inputs:
            if gi.name == value:
                return gi.shape, gi.dtype
        for lay in self.layers:
            for op in lay.ops:
                if op.name == value:
                    return op.out_shape, op.dtype
        raise KeyError(value)

    def to_json(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "batch_size": self.batch_size,
                "output": self.output,
                "tracer": self.tracer,
                "inputs": [asdict(i) for i in self.inputs],
                "layers": [lay.to_json() for lay in self.layers],
                "buffer_updates": [op.to_json() for op in self.buffer_updates],
                "unregistered": list(self.unregistered)}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> "LayerGraphData":
        return LayerGraphData(layers=[Layer.from_json(x) for x in obj["layers"]],
                              inputs=[GraphInput(**i) for i in obj["inputs"]],
                              output=obj["output"], batch_size=int(obj["batch_size"]),
                              model_name=obj.get("model_name", ""),
                              buffer_updates=[OpSpec.from_json(o) for o in obj.get("buffer_updates", [])],
                              tracer=obj.get("tracer", ""),
                              unregistered=list(obj.get("unregistered", [])))


#: ``OpSpec.attrs`` key set to False on an op none of whose activation inputs carries a gradient
INPUT_GRAD = "input_grad"


def mark_input_grads(layers: list[Layer]) -> None:
    """Stamp ``attrs["input_grad"] = False`` on every op none of whose activation inputs
    carries a gradient in training, and clear it elsewhere. The model's inputs carry none (a
    training step never differentiates its data; ``execute``'s validation step does, and is not
    timed); an op's floating output carries one when the op has parameters or an input that
    carries one. Such an op computes no input gradient: a first convolution or linear layer has
    no data-gradient phase (its input gradient is the costliest phase of a 3-D CNN's first
    layer), and a parameter-free op on the data (a pad, a gather of the input) has no backward
    at all (``cost.primitives.op_compute_s``). Called by ``LayerGraphData`` on construction, so
    traced, cached and planned graphs alike carry it (the layer signature reads it)."""
    carries: set[str] = set()
    for lay in layers:
        for op in lay.ops:
            grad_in = any(v in carries for v in op.inputs)
            if (grad_in or op.params) and not op.dtype.startswith(("int", "uint", "bool")):
                carries.add(op.name)
            if grad_in and INPUT_GRAD in op.attrs:
                op.attrs = {k: v for k, v in op.attrs.items() if k != INPUT_GRAD}
            elif not grad_in and takes_input_grad(op):
                op.attrs = {**op.attrs, INPUT_GRAD: False}


def takes_input_grad(op: OpSpec) -> bool:
    """Whether ``op`` computes a gradient for its inputs (``mark_input_grads``)."""
    return op.attrs.get(INPUT_GRAD) is not False


def has_backward(op: OpSpec) -> bool:
    """Whether ``op`` is in the backward pass at all: it takes an input gradient or has
    parameters (an op on the data without parameters has no autograd node)."""
    return takes_input_grad(op) or bool(op.params)


def batch_free_layers(graph) -> frozenset[int]:
    """Indices of the layers no graph input reaches (computed from constants and weights
    only): every rank computes them whole, in the module as in a ``replicate`` layer."""
    batched = {gi.name for gi in graph.inputs}
    free = set()
    for lay in graph.layers:
        if lay.ops and not any(v in batched for v in lay.inputs) and not any(
                v in batched for op in lay.ops for v in op.inputs):
            free.add(lay.index)
        else:
            batched.update(lay.outputs)
            batched.update(op.name for op in lay.ops)
    return frozenset(free)


def not_data_parallel(graph, decisions, world: int) -> str | None:
    """None when every layer of the plan ``decisions`` (layer index -> decomposition) is
    ``sample(world)``, or ``replicate`` where no input reaches it (``batch_free_layers``): the
    layer half of what lets a plan run the user's module (``runtime.native``); else which layer
    is not."""
    free = batch_free_layers(graph)
    for lay in graph.layers:
        dec = decisions[lay.index]
        if dec.kind == "replicate" and lay.index in free:
            continue   # made from constants and weights only (position ids and their embedding,
                       # masks): the module computes it whole too, its weights' gradients are the
                       # rank's share, summed like every other weight's
        if dec.kind != "sample" or getattr(dec, "parts", None) != world:
            return f"layer {lay.index} ({lay.name}) is {dec}, not sample({world})"
    return None
