"""autopar: measure the machine, price every way to split every layer, solve, generate, run, prove.

Data flow (one sub-package per stage, each reading one artifact and writing the next)::

    calibrate -> trace -> cost -> solve -> codegen -> execute -> report
    (profile)   (layer graph) (cost table) (plan.json) (generated module) (run.json) (report.md)

``decomp`` holds the decompositions (value types + one registry); ``runtime`` is what generated
code imports and stays free of solver and tracing imports.
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
