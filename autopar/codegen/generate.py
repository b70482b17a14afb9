"""Write the generated module for a plan.

The module is not stand-alone torch.distributed code: it subclasses
``autopar.runtime.DistModel`` and needs autopar (and its plan.json) at run time. Its
``forward`` is the traced program written out, one ``self.op(name, *inputs)`` line per traced
op and one ``self.move(value, src_placement, dst_placement)`` line per transition, each commented
with the layer, its module, its decomposition and the op's source line, so a reader sees where
data moves. The collectives, parameter shards, gradient buckets and each decomposition's
arithmetic are in ``autopar.runtime`` and ``autopar.decomp``, not in the module; a plan that
is pure data parallelism runs the user's own module instead (``runtime.native``). It runs
under ``torchrun --nproc-per-node N`` (its ``main``) and under ``autopar execute`` (its
``build``).
"""

from __future__ import annotations

from ..artifacts import Plan
from ..decomp.program import LayerHeader, MoveStep, input_layout, loss_move, program
from ..decomp.program import var as _var


def generate_sharded_module(plan: Plan) -> str:
    """The module of a sharded plan (plan.json ``runtime.sharded``, run on torch's engines): a
    readable ``parallelize(model, mesh)`` calling, in torchtitan's order, DTensor's
    ``parallelize_module`` with each tensor-parallel module's style (a (dp, tp) plan), then
    ``fully_shard`` per unit and on the root, each line commented with the unit's decision;
    data-parallel units on an HSDP mesh of shard size 1; a unit the plan checkpoints (``ac``) gets
    ``checkpoint_unit`` (its forward under ``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)``) after tensor parallelism and before its ``fully_shard``, torchtitan's
    order (``runtime.fsdp.checkpoint_unit``, written out). A ZeRO-1 plan instead gets
    ``replicate(model)`` (DDP) and a ``make_optimizer`` building torch's ``ZeroRedundancyOptimizer``.
    Needs torch only (and autopar's model-file loader under torchrun)."""
    rec = dict(plan.runtime.extra)["sharded"]
    world = plan.world_size
    units = rec["units"]
    tp = int(rec["mesh"].get("tp", 1))
    styles = dict(rec.get("tp_styles") or {})
    zero1 = rec.get("engine") == "ddp_zero"

    def call(target: str, d, comment: str) -> str:
        if d is None:
            return f"    fully_shard({target}, mesh=replicate)  # {comment}: data parallel (gradients all-reduced)"
        raf = d["level"] == 3 and d["reshard_after_forward"]
        ac = (f"    checkpoint_unit({target})  # {comment}: activation checkpointing (keeps its input, "
              "recomputes its forward in backward)\n") if d.get("ac") else ""
        what = {3: "ZeRO-3: parameters, gradients, optimizer state sharded" + (
                    ", gathered again for backward" if raf else ", kept gathered forward -> backward"),
                2: "ZeRO-2: gradients and optimizer state sharded, parameters whole through the step",
                1: "ZeRO-1: optimizer state sharded (whole gradient across micro-batches)"}[d["level"]]
        return (f"{ac}    fully_shard({target}, mesh=dp, reshard_after_forward={raf})  "
                f"# {comment}: {what} over {d['data_axis']} ({d['dp']} ranks)")
    body, imports = [], ["from torch.distributed.device_mesh import DeviceMesh"]
    if zero1:      # torch's ZeRO-1: DDP over the whole module, the optimizer partitioned (make_optimizer)
        imports = ["from torch.distributed._composable import replicate",
                   "from torch.distributed.optim import ZeroRedundancyOptimizer"]
        body.append(f"    # ZeRO-1 over {rec['mesh']['dp']} ranks: parameters and gradients whole, gradients all-reduced "
                    "(DDP); the optimizer state partitioned by make_optimizer")
        body.append("    replicate(model, process_group=dp.get_group(), gradient_as_bucket_view=True)")
    else:
        imports.append("from torch.distributed.fsdp import fully_shard")
        if any(d is not None and d.get("ac") for d in units.values()):
            imports.append(AC_HELPER)
        if styles:
            imports.append("from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, "
                           "parallelize_module")
            body.append(f"    # 1. tensor parallelism over {tp} ranks (DTensor), Megatron's split of each MLP / attention")
            body.append('    parallelize_module(model, mesh["tp"], {')
            for m, st in styles.items():
                body.append(f"        {m!r}: {'ColwiseParallel' if st == 'colwise' else 'RowwiseParallel'}(),")
            body.append("    })")
            body.append("    # 2. sharding over the data axis (FSDP2), each unit, then the root")
        if any(d is None for d in units.values()) or rec.get("root") is None:
            body.append('    replicate = DeviceMesh(dp.device_type, dp.mesh.reshape(-1, 1), '
                        'mesh_dim_names=("replicate", "shard"))')
        for u, d in units.items():
            body.append(call(f"model.get_submodule({u!r})", d, u))
        body.append(call("model", rec.get("root"), "the root (every parameter no unit holds)"))
    pred = plan.predicted
    mesh_doc = (f"a 2-D DeviceMesh ({world // tp}, {tp}) named (dp, tp): the data axis, then the tensor axis "
                "inside a node" if tp > 1 else f"a 1-D DeviceMesh of {world} ranks: the data axis")
    return _fill(SHARDED_TEMPLATE, {"IMPORTS": "\n".join(imports), "MESH_DOC": mesh_doc,
                 "DP": 'mesh["dp"]' if tp > 1 else "mesh", "TP": str(tp),
                 "ENGINE": "torch's ZeRO-1 (DDP + ZeroRedundancyOptimizer)" if zero1 else
                 ("DTensor tensor parallelism, then FSDP2" if tp > 1 else "torch's FSDP2"),
                 "OPTIM": ("ZeroRedundancyOptimizer(model.parameters(), optimizer_class, "
                           "process_group=mesh.get_group(), **defaults)") if zero1 else
                 "optimizer_class(model.parameters(), **defaults)",
                 "VERSION": plan.autopar_version, "MODEL": plan.model.path, "SHA": plan.model.sha256[:12],
                 "BATCH": str(plan.model.batch_size), "WORLD": str(world),
                 "STEP_MS": f"{pred.step_time_s * 1e3:.3f}",
                 "MEM_MIB": f"{pred.memory_per_rank_bytes / 2**20:.2f}", "PLAN_FILE": plan.plan_file,
                 "REASON": plan.runtime.reason, "GENERATED": plan.generated, "BODY": "\n".join(body)})


AC_HELPER = '''from torch.utils.checkpoint import checkpoint


def checkpoint_unit(module):
    """Activation checkpointing of one unit: its forward keeps only its inputs and runs again in
    backward; FSDP2's hooks (fully_shard, applied after) stay outside it. Parameter names unchanged."""
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    module.forward = forward
    return module'''


SHARDED_TEMPLATE = '''"""Generated by autopar @VERSION@ -- do not edit; re-plan instead.

Sharded data parallelism on @ENGINE@ for @MODEL@ (sha256 @SHA@), batch @BATCH@, @WORLD@ ranks:
``parallelize(model, mesh)`` applies the plan to the user's untouched module; each rank then feeds its
data axis' block of the batch (dim 0; the ranks of a tensor group feed the same block) and
back-propagates its block's mean loss (gradients are averaged over the data axis).

Predicted:  step @STEP_MS@ ms, memory @MEM_MIB@ MiB per rank
Plan:       @PLAN_FILE@ (@REASON@)

Run with torchrun:   torchrun --nproc-per-node @WORLD@ @GENERATED@ --steps 5
or through autopar:  autopar execute @PLAN_FILE@
"""

from __future__ import annotations

import os
import sys

@IMPORTS@

PLAN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "@PLAN_FILE@")


TP = @TP@


def parallelize(model, mesh):
    """Apply the plan to ``model`` in place over ``mesh`` (@MESH_DOC@)."""
    dp = @DP@
@BODY@
    return model


def make_optimizer(model, mesh, optimizer_class, **defaults):
    """The optimizer the plan asks for over ``model``'s parameters."""
    return @OPTIM@


def main(argv):
    """Train a few steps (SGD) on the model file's synthetic batch, under torchrun."""
    import argparse

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.artifacts import load_plan
    from autopar.modelfile import load_model_file
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = load_plan(PLAN_FILE, world)
    mf = load_model_file(plan.model_file(PLAN_FILE), env=plan.model_env())
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = (init_device_mesh(device, (world // TP, TP), mesh_dim_names=("dp", "tp")) if TP > 1
            else init_device_mesh(device, (world,), mesh_dim_names=("dp",)))
    model = parallelize(mf.build_model().to(device), mesh)
    opt = make_optimizer(model, mesh, torch.optim.SGD, lr=0.01, momentum=0.9)
    x, y = mf.example_inputs(plan.model.batch_size)[0], mf.example_targets(plan.model.batch_size)
    parts, me = world // TP, rank // TP          # this rank's block of the batch (its data axis coordinate)
    for step in range(a.steps):
        opt.zero_grad()
        loss = mf.loss_fn()(model(x.chunk(parts)[me].to(device)), y.chunk(parts)[me].to(device))
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0's block)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


def generate_stages_module(plan: Plan) -> str:
    """The module of a pipeline-stage plan (plan.json ``runtime.stages``, run by torch's schedules):
    its docstring lays out what runs where -- each stage's blocks and ranks, how they use them
    (dp x tp of whole blocks, or the stage plan's per-layer choices), the schedule, the values
    crossing each cut -- and its ``main`` trains through ``autopar.parallelize`` (whose module
    builds the stages, the process groups and torch's schedule object); needs autopar and the
    plan at run time."""
    rec = dict(plan.runtime.extra)
    layout, sched = rec["stages"], rec["stages"]["schedule"]
    sp = rec.get("stage_plan")
    lines = []
    for st in layout["stages"]:
        lo, hi = st["layers"]
        how = (f"every rank runs its layers of the stage plan on these {len(st['ranks'])} ranks"
               if st.get("data") == "plan" else
               f"dp {st['dp']}{' (FSDP2)' if st.get('data') == 'fsdp' else ''} x tp {st['tp']} of whole blocks")
        lines.append(f"  stage {st['index']}: blocks [{lo}, {hi}) on ranks {st['ranks']}: {how}")
    if sp:
        count: dict[str, int] = {}
        for c in sp.get("choices", ()):
            count[c] = count.get(c, 0) + 1
        lines.append(f"  stage plan (the model on {sp['world_size']} ranks, one microbatch): "
                     + ", ".join(f"{c} x {n}" for c, n in sorted(count.items())))
    for c in rec.get("cuts") or ():
        vals = ", ".join(f"{v['name']} {tuple(v['shape'])} {v['steps_str']}" for v in c["values"])
        lines.append(f"  cut {c['cut']} (stage {c['from_stage']} -> {c['to_stage']}): {vals}")
    return _fill(STAGES_TEMPLATE, {
        "LAYOUT": "\n".join(lines), "VERSION": plan.autopar_version, "MODEL": plan.model.path,
        "SHA": plan.model.sha256[:12], "BATCH": str(plan.model.batch_size), "WORLD": str(plan.world_size),
        "SCHEDULE": f"{sched['torch_class']}, {sched['microbatches']} microbatches, {sched.get('virtual', 1)} chunk(s) per rank",
        "STEP_MS": f"{plan.predicted.step_time_s * 1e3:.3f}", "PLAN_FILE": plan.plan_file, "GENERATED": plan.generated})


def _fill(template: str, values: dict[str, str]) -> str:
    """``template`` with each ``@KEY@`` replaced by ``values[KEY]``."""
    for k, v in values.items():
        template = template.replace("@" + k + "@", v)
    return template


STAGES_TEMPLATE = '''"""Generated by autopar @VERSION@ -- do not edit; re-plan instead.

Pipeline stages for @MODEL@ (sha256 @SHA@), batch @BATCH@, @WORLD@ ranks, run by torch's own
schedule (torch.distributed.pipelining: @SCHEDULE@):
@LAYOUT@

``autopar.parallelize(model, PLAN_FILE)`` builds this rank's stage modules, the process groups and
the schedule object; ``dmodel.loss(x, y)`` runs one step of the schedule on the whole batch (every
rank passes the same) and returns the loss on every rank, gradients in ``.grad``.

Predicted:  step @STEP_MS@ ms
Plan:       @PLAN_FILE@

Run with torchrun:   torchrun --nproc-per-node @WORLD@ @GENERATED@ --steps 5
or through autopar:  autopar execute @PLAN_FILE@
"""

from __future__ import annotations

import os
import sys

from autopar.runtime import run_generated

PLAN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "@PLAN_FILE@")


def build(model):
    """This rank's stages of ``model`` (the user's, built alike on every rank) under the plan."""
    import autopar
    return autopar.parallelize(model, PLAN_FILE)


if __name__ == "__main__":
    sys.exit(run_generated(None, PLAN_FILE, sys.argv[1:]))
'''


def generate_module(plan: Plan) -> str:
    if plan.runtime is not None and plan.runtime.expected == "fsdp" and "sharded" in dict(plan.runtime.extra):
        return generate_sharded_module(plan)
    if plan.runtime is not None and plan.runtime.expected == "stages" and "stages" in dict(plan.runtime.extra):
        return generate_stages_module(plan)
    graph = plan.graph()
    world = plan.world_size
    decs = {d.layer: d.decomposition() for d in plan.layers}

    lines: list[str] = []
    ins = ", ".join(_var(i.name) for i in graph.inputs)
    lines.append(f"    def forward(self, {ins}):")
    lines.append("        self.update_buffers()")
    for gi in graph.inputs:
        lines.append(f"        # input {gi.name} {tuple(gi.shape)} arrives as placement {input_layout(graph, decs, gi.name)}")
    ops = {op.name: op for lay in graph.layers for op in lay.ops}
    for st in program(graph, decs):
        if isinstance(st, LayerHeader):
            lay, dec = graph.layers[st.layer], decs[st.layer]
            kinds = "+".join(op.kind for op in lay.ops)
            lines.append(f"        # -- layer {lay.index}: {lay.module or '(root)'}  {kinds}  "
                         f"{tuple(lay.out_shape)}  -> {dec}  [{dec.out_placement(lay)}]")
        elif isinstance(st, MoveStep):
            lines.append(f"        {st.out} = self.move({st.src_var}, {st.value!r}, {st.src.to_json(world)}, "
                         f"{st.dst.to_json(world)}, layer={st.layer})  # transition {st.src} -> {st.dst}")
        else:
            op = ops[st.name]
            args = ", ".join([repr(op.name), *st.args])
            where = f"  # {op.target}" + (f"  {op.source}" if op.source else "")
            lines.append(f"        {st.out} = self.op({args}){where}")
    lm = loss_move(graph, decs, world)
    if lm is not None:
        lines.append(f"        # the loss is computed with samples split: {lm.src} -> {lm.dst}")
        lines.append(f"        {lm.out} = self.move({lm.src_var}, {lm.value!r}, {lm.src.to_json(world)}, {lm.dst.to_json(world)})")
    # the structure the user's model returns (a tensor, or e.g. a ModelOutput holding it)
    lines.append(f"        return self.structured({_var(graph.output)})")

    pred = plan.predicted
    header = f'''"""Generated by autopar {plan.autopar_version} -- do not edit; re-plan instead.

The traced program of the model as the plan splits it: one ``self.op`` per traced op and one
``self.move`` per layout transition, run by ``autopar.runtime.DistModel`` (which holds the
parameter shards, the process groups, the collectives and the gradient sync); needs autopar
and {plan.plan_file} at run time.

Model:      {plan.model.path} (sha256 {plan.model.sha256[:12]}), batch {plan.model.batch_size}
World size: {world} (ranks per node {plan.mesh.ranks_per_node}, placement {plan.placement()})
Predicted:  step {pred.step_time_s * 1e3:.3f} ms, memory {pred.memory_per_rank_bytes / 2**20:.1f} MiB per rank
Plan:       {plan.plan_file} (decisions, predictions and the layer graph)

Run with torchrun:   torchrun --nproc-per-node {world} {plan.generated} --steps 5
or through autopar:  autopar execute {plan.plan_file}
"""

from __future__ import annotations

import os
import sys

from autopar.runtime import DistModel, run_generated

PLAN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), {plan.plan_file!r})


class PlannedModel(DistModel):
'''
    footer = '''

def build(model=None, comm=None):
    """The distributed model for this rank (the user's model is built with the plan's seed)."""
    from autopar.runtime import build_planned
    return build_planned(PlannedModel, PLAN_FILE, model=model, comm=comm)


if __name__ == "__main__":
    sys.exit(run_generated(PlannedModel, PLAN_FILE, sys.argv[1:]))
'''
    return header + "\n".join(lines) + "\n" + footer
