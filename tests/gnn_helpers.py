"""Shared by tests/test_gnn.py and tests/test_pyg.py: small GNN sizes, forcing the graph
decompositions on every layer that takes them, and validating a plan through the path
``autopar execute`` uses (float64, every tensor against one process)."""

from __future__ import annotations

import contextlib
import os

import pytest

SMALL = {"AUTOPAR_GNN_NODE_EMBED": "8", "AUTOPAR_GNN_OUT": "4", "AUTOPAR_GNN_NODES": "6",
         "AUTOPAR_GNN_EDGES": "10", "AUTOPAR_GNN_GRAPHS": "4"}


@contextlib.contextmanager
def small_sizes():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in SMALL.items():
            mp.setenv(k, v)
        yield


def trace(root, model: str, batch: int = 4):
    from autopar.modelfile import load_model_file
    from autopar.trace.tracer import trace_model
    return trace_model(load_model_file(root / f"strategies/examples/{model}.py"), batch)


def kinds_of(layer) -> set[str]:
    return {k for op in layer.ops for _, k in (op.attrs.get("items") or {}).values()}


def forced(graph, profile, world: int, mode: str, want: str | None = None,
           extra: dict[int, str] | None = None) -> dict[int, str]:
    """layer -> decomposition: ``edges`` on every layer with edge values that takes it,
    ``nodes`` on the node-only layers (mode "nodes" or "mix"), ``sample`` on every layer that
    takes it (mode "graphs"); ``want`` (e.g. "(2,2)") picks among the candidates, and a layer
    that takes the kind but not the ``want`` split fails the test (it would otherwise test
    another split than it names)."""
    from autopar.decomp import REGISTRY, CostContext
    ctx = CostContext(profile=profile, world=world, ranks_per_node=4, batch_size=graph.batch_size)
    out: dict[int, str] = {}
    for lay in graph.layers:
        ks = kinds_of(lay)
        if mode == "graphs":
            kind = "sample"
        elif "edge" in ks and mode in ("edges", "mix"):
            kind = "edges"
        elif "node" in ks and "edge" not in ks and mode in ("nodes", "mix"):
            kind = "nodes"
        else:
            continue
        legal = [c for c in REGISTRY[kind].candidates(lay, ctx) if c.check(lay, ctx) is None]
        pick = [c for c in legal if want is None or str(c).endswith(want)]
        if legal and not pick:
            pytest.fail(f"forced({mode!r}, want={want!r}): layer {lay.index} ({lay.module or lay.name}) "
                        f"offers {[str(c) for c in legal]}, not {kind}{want}")
        if pick:
            out[lay.index] = str(pick[0])
    out.update(extra or {})
    return out


def plan_and_validate(root, tmp_path, profile, model: str, world: int, force: dict[int, str],
                      batch: int = 4):
    """Plan with ``force`` pinned, execute one validation step (float64); the plan and run."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan
    r = make_plan(root / f"strategies/examples/{model}.py",
                  PlanOptions(world_size=world, batch_size=batch, out_dir=str(tmp_path / "plan"),
                              max_candidates=64),
                  PlanHooks(profile=profile, force=force))
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=240,
                                                 ddp=False), out_dir=tmp_path / "run", progress=lambda s: None)
    return r, run


def assert_validated(run, params: set[str]):
    assert run.validation.passed, run.validation.failures
    assert run.validation.dtype == "float64"
    names = {c.tensor for c in run.validation.checks}
    assert "loss" in " ".join(names) or any(n.startswith("loss") for n in names), names
    missing = {f"grad:{p}" for p in params} - names
    assert not missing, missing
