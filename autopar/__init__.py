"""autopar: measure the machine, price every way to split every layer, solve, generate, run.

``autopar execute`` checks a plan with one float64 training step against one process on the
same synthetic batch and seed (the output, the loss, the input gradients, every parameter
gradient, and every parameter after one SGD-with-momentum step, each within a stated
tolerance), then times it against torch DDP: a check of that step, not a proof for every input.

Data flow (one sub-package per stage, each reading one artifact and writing the next)::

    calibrate -> trace -> cost -> solve -> codegen -> execute -> report
    (profile)   (layer graph) (cost table) (plan.json) (generated module) (run.json) (report.md)

``profile`` is the pure profile model (``calibrate`` measures into it, ``cost`` prices with it);
``decomp`` holds the decompositions' plan-time halves (value types, layouts, legality, cost
formulas; one registry); ``runtime`` is what generated code imports, with the decompositions'
run-time halves in ``runtime.layers``, and stays free of solver and tracing imports. The import
contract between these sides is checked from the source by ``tests/test_layering.py``.
"""

__version__ = "0.1.0"

#: names exported lazily from ``autopar.train`` (``import autopar`` stays free of torch)
_TRAIN = ("parallelize", "init_distributed", "plan_loader", "shard_batch", "clip_grad_norm_",
          "save", "load", "full_state_dict", "load_full_state_dict")


def __getattr__(name: str):
    if name in _TRAIN:
        from . import train
        return getattr(train, name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
