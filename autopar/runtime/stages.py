"""Run a model cut into pipeline stages (``autopar.decomp.stages.StageLayout``) with torch's own
schedules (``torch.distributed.pipelining``: ``PipelineStage`` + ``Schedule*``): autopar builds
the stage modules, the process groups and the schedule object, and writes no scheduler.

Which models: *sequential block models*, read as ``pre -> blocks[0..L) -> post`` where the
layers of the layout are the blocks: the plain GPT of ``strategies/examples/gpt.py``
(``tok``/``pos`` embeddings, ``blocks``, ``ln`` + ``head``), Hugging Face GPT-2
(``transformer.wte``/``wpe``/``drop``, ``transformer.h``, ``transformer.ln_f`` + ``lm_head``),
Hugging Face Llama (``model.embed_tokens``, ``model.layers`` each with its rotary tables and
causal mask made again from its input, ``model.norm`` + ``lm_head``), and any module offering ``pipeline_parts() -> (pre, blocks, post)``. Stage 0 runs ``pre`` and
the last stage ``post``. Several values may cross a cut: a block returning a tuple passes every
element to the next block (and over the cut, point to point, each with its gradient).

Ranks: stage s holds ``stage.ranks`` laid ``dp x tp`` (row-major, tp fastest). The rank at
(d, t) of every stage forms one *pipeline group* (its own ``PipelineStage`` chain); the ranks of
a stage with the same t form its data-parallel group (gradients averaged after the schedule's
step, or, when the stage's ``data`` is "fsdp", its parameters sharded by FSDP2 over it:
``shard_stage``); with the same d its tensor-parallel group (blocks split Megatron-style by
``shard_gpt_block``; replicated values cross the cut from each tp rank to its peer).

Semantics of one step: data-parallel group d takes rows ``[d B/D, (d+1) B/D)`` of the batch; the
schedule splits them into M microbatches along dim 0; the loss is the mean over microbatches of
``loss_fn`` on each (each microbatch's loss divided by M: gradients of that mean, and a step that
follows another without ``zero_grad`` adds to the gradients as one process would), then averaged over the D
groups: for a per-element-mean loss and equal microbatches, the loss of the whole batch. Batch
norm inside a stage normalises each microbatch with its own statistics and updates running
statistics once per microbatch, in microbatch order; with D > 1 each replica does so from the
same running statistics and the step ends with their mean over the D replicas, as the plans'
local statistics do (``reference_step`` computes exactly that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..decomp.stages import (CANNOT_CUT_HINT, SCHEDULES, SPLIT_BACKWARD, CutPlan, StageLayout, chunk_ranges,
                              chunks_of_stage, pipeline_structure)
from ..decomp.fsdp import shard_rows
from ..errors import PipelineError
from .dtensor import local
from .launch import raise_peer_failure

# ------------------------------------------------------------------------------------------
# Cutting a model into stage modules
# ------------------------------------------------------------------------------------------


class _GPTPre(nn.Module):
    def __init__(self, tok: nn.Module, pos: nn.Module, drop: nn.Module | None = None):
        super().__init__()
        self.tok, self.pos, self.drop = tok, pos, drop

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.drop(x) if self.drop is not None else x


class _Embed(nn.Module):
    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, idx):
        return self.embed(idx)


class _LlamaBlock(nn.Module):
    """A Hugging Face Llama decoder layer as a pipeline block: hidden states in, hidden states out.
    What the model's forward computes once before its layers -- the position ids, the rotary
    tables (``rotary_emb``) and the causal mask -- each block computes again from the hidden
    states it receives (the same values: they depend on the sequence length only), so that only
    the hidden states cross a cut, as the planner's cut values say."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config):
        from transformers.masking_utils import create_causal_mask     # optional package: only for this model
        super().__init__()
        self.layer, self.rotary, self.config = layer, rotary, config
        self.causal_mask = create_causal_mask

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = self.causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=pos)
        out = self.layer(x, attention_mask=mask, position_embeddings=self.rotary(x, position_ids=pos),
                         position_ids=pos, cache=None, use_cache=False)
        return out[0] if isinstance(out, tuple) else out


class _Post(nn.Module):
    def __init__(self, *mods: nn.Module):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        for m in self.mods:
            x = m(x)
        return x


def pipeline_parts(model: nn.Module) -> tuple[nn.Module | None, Sequence[nn.Module], nn.Module | None]:
    """``(pre, blocks, post)`` of a sequential block model (module docstring; which one:
    ``decomp.stages.pipeline_structure``); the modules are the model's own (parameters shared,
    not copied). Refuses other models naming what it looked for."""
    kind = pipeline_structure(model)
    if kind == "parts":
        return model.pipeline_parts()
    if kind == "gpt":
        return _GPTPre(model.tok, model.pos), list(model.blocks), _Post(model.ln, model.head)
    if kind == "hf_gpt2":
        tr = model.transformer
        return _GPTPre(tr.wte, tr.wpe, getattr(tr, "drop", None)), list(tr.h), _Post(tr.ln_f, model.lm_head)
    if kind == "hf_llama":
        base = model.model
        return (_Embed(base.embed_tokens), [_LlamaBlock(layer, base.rotary_emb, base.config) for layer in base.layers],
                _Post(base.norm, model.lm_head))
    raise PipelineError(f"cannot cut {type(model).__name__} into pipeline stages", CANNOT_CUT_HINT)


class _LogitsOutput:
    """What a Hugging Face causal LM returns, as far as a loss reads it: ``.logits``."""

    def __init__(self, logits):
        self.logits = logits


def stage_loss(model: nn.Module, loss_fn: Callable) -> Callable:
    """The loss the last stage calls: ``loss_fn`` itself, or for a Hugging Face LM (whose last
    stage ends at ``lm_head``, a tensor) ``loss_fn`` on an object with ``.logits``, as the user's
    loss reads the model's output."""
    if pipeline_structure(model) in ("hf_gpt2", "hf_llama"):
        return lambda out, target: loss_fn(_LogitsOutput(out), target)
    return loss_fn


def _call_block(block: nn.Module, values: tuple) -> tuple:
    out = block(*values)
    if isinstance(out, tuple):
        # HF blocks return (hidden, present, ...) in some versions: the hidden state only, unless
        # the block is one of ours returning every value it passes on
        return out if getattr(block, "returns_all_values", False) or len(out) == len(values) else (out[0],)
    return (out,)


class StageModule(nn.Module):
    """Blocks ``[first, stop)`` of a sequential block model, with ``pre`` on the first stage and
    ``post`` on the last. Returns a tensor when one value leaves it, else a tuple (each element
    crosses the cut point to point)."""

    def __init__(self, pre: nn.Module | None, blocks: Sequence[nn.Module], post: nn.Module | None):
        super().__init__()
        self.pre, self.blocks, self.post = pre, nn.ModuleList(blocks), post

    def forward(self, *values):
        if self.pre is not None:
            out = self.pre(*values)
            values = out if isinstance(out, tuple) else (out,)
        for blk in self.blocks:
            values = _call_block(blk, values)
        if self.post is not None:
            return self.post(*values)
        return values[0] if len(values) == 1 else values


def stage_modules(model: nn.Module, layout: StageLayout, stage: int) -> list[tuple[int, StageModule]]:
    """The (chunk index, module) pairs rank group ``stage`` runs (sharing the model's parameters)."""
    pre, blocks, post = pipeline_parts(model)
    ranges = chunk_ranges(layout)
    if ranges[-1][2] != len(blocks):
        raise PipelineError(f"the stage layout covers {ranges[-1][2]} layers but the model has {len(blocks)} blocks",
                            "plan the stages for this model")
    last = len(ranges) - 1
    return [(c, StageModule(pre if c == 0 else None, blocks[ranges[c][1]:ranges[c][2]], post if c == last else None))
            for c in chunks_of_stage(layout, stage)]


def _all_chunks(model: nn.Module, layout: StageLayout) -> list[StageModule]:
    """Every chunk's module, in model order (sharing the model's parameters)."""
    pre, blocks, post = pipeline_parts(model)
    ranges = chunk_ranges(layout)
    last = len(ranges) - 1
    return [StageModule(pre if c == 0 else None, blocks[lo:hi], post if c == last else None) for c, lo, hi in ranges]


# ------------------------------------------------------------------------------------------
# Tensor parallelism inside a stage (plain GPT blocks, Megatron-style)
# ------------------------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _shard_linear(lin: nn.Linear, dim: int, t: int, tp: int, blocks: int = 1) -> None:
    """Keep this rank's 1/tp of ``lin``'s weight along ``dim`` (0: output features, 1: input),
    within each of ``blocks`` equal blocks of the output (q, k, v of a fused projection)."""
    with torch.no_grad():
        w = lin.weight
        if dim == 0:
            parts = w.chunk(blocks, 0)
            lin.weight = nn.Parameter(torch.cat([p.chunk(tp, 0)[t] for p in parts], 0).clone())
            if lin.bias is not None:
                bp = lin.bias.chunk(blocks, 0)
                lin.bias = nn.Parameter(torch.cat([p.chunk(tp, 0)[t] for p in bp], 0).clone())
        else:
            lin.weight = nn.Parameter(w.chunk(tp, 1)[t].clone())


class _TPBlock(nn.Module):
    """A plain-GPT ``Block`` with attention heads and the MLP's hidden features split over the
    stage's tp group: qkv and fc column-parallel, proj and out row-parallel (their bias added
    once, after the all-reduce); layer norms replicated."""

    def __init__(self, block: nn.Module, heads: int, t: int, tp: int, group):
        super().__init__()
        if heads % tp:
            raise PipelineError(f"{heads} heads do not split over tp {tp}", "pick tp dividing the heads")
        self.b, self.heads, self.group = block, heads // tp, group
        _shard_linear(block.attn.qkv, 0, t, tp, blocks=3)
        _shard_linear(block.attn.proj, 1, t, tp)
        _shard_linear(block.fc, 0, t, tp)
        _shard_linear(block.out, 1, t, tp)

    def forward(self, x):
        import torch.nn.functional as F
        b, g = self.b, self.group
        n, s, e = x.shape
        h = _CopyToTP.apply(b.ln1(x), g)
        q, k, v = b.attn.qkv(h).chunk(3, dim=-1)
        el = q.shape[-1]
        q, k, v = (z.view(n, s, self.heads, el // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(n, s, el)
        x = x + _ReduceFromTP.apply(F.linear(y, b.attn.proj.weight), g) + b.attn.proj.bias
        h = _CopyToTP.apply(b.ln2(x), g)
        return x + _ReduceFromTP.apply(F.linear(F.gelu(b.fc(h)), b.out.weight), g) + b.out.bias


def shard_gpt_blocks(model: nn.Module, heads: int, t: int, tp: int, group) -> dict[str, tuple[int, int, int]]:
    """Replace each plain-GPT block of ``model`` by its tp shard ``t`` of ``tp``. Returns, per
    sharded parameter name, ``(dim, blocks, t)`` so that a reference can cut the same slice."""
    sharded: dict[str, tuple[int, int, int]] = {}
    for i, blk in enumerate(list(model.blocks)):
        model.blocks[i] = _TPBlock(blk, heads, t, tp, group)
        pfx = f"blocks.{i}."
        sharded.update({pfx + "attn.qkv.weight": (0, 3, t), pfx + "attn.qkv.bias": (0, 3, t),
                        pfx + "attn.proj.weight": (1, 1, t), pfx + "fc.weight": (0, 1, t),
                        pfx + "fc.bias": (0, 1, t), pfx + "out.weight": (1, 1, t)})
    return sharded


def shard_of(full: torch.Tensor, spec: tuple[int, int, int], tp: int) -> torch.Tensor:
    """The slice of ``full`` a tp rank holds for ``shard_gpt_blocks``' spec ``(dim, blocks, t)``."""
    dim, blocks, t = spec
    return torch.cat([p.chunk(tp, dim)[t] for p in full.chunk(blocks, dim)], dim)


# ------------------------------------------------------------------------------------------
# Groups and the schedule
# ------------------------------------------------------------------------------------------


@dataclass
class StageGroups:
    """This rank's process groups: its pipeline chain, its stage's dp and tp groups."""

    pipeline: Any
    dp: Any
    tp: Any
    coords: tuple[int, int]            # (d, t) inside its stage


def make_groups(layout: StageLayout, rank: int) -> StageGroups:
    """Create every pipeline, dp and tp group (every rank calls this, in the same order)."""
    mine: dict[str, Any] = {}
    st = layout.stage_of(rank)
    size = len(st.ranks)
    for idx in range(size):
        g = dist.new_group([s.ranks[idx] for s in layout.stages])
        if st.ranks[idx] == rank:
            mine["pipeline"] = g
    for s in layout.stages:
        for t in range(s.tp):
            ranks = [s.ranks[d * s.tp + t] for d in range(s.dp)]
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine["dp"] = g
        for d in range(s.dp):
            ranks = [s.ranks[d * s.tp + t] for t in range(s.tp)]
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine["tp"] = g
    i = st.ranks.index(rank)
    return StageGroups(mine["pipeline"], mine.get("dp"), mine.get("tp"), (i // st.tp, i % st.tp))


def _schedule_class(name: str):
    from torch.distributed.pipelining import schedules as sch
    return getattr(sch, SCHEDULES[name][0])


@dataclass
class StageRunner:
    """One rank's part of a pipelined model: its chunk modules, groups and torch schedule.

    ``step(inputs, targets)`` takes the *whole* batch (every rank passes the same), runs the
    schedule on this data-parallel group's rows, averages gradients over the stage's dp group
    and returns the global loss (mean over microbatches and dp groups) on every rank."""

    layout: StageLayout
    rank: int
    modules: list[tuple[int, StageModule]]
    groups: StageGroups
    schedule: Any
    loss_fn: Callable
    tied: tuple = ()            # (parameter, group of its holders' peers): gradients summed (tied weights)
    sharded: dict = None        # single-process parameter name -> shard_of spec (tp > 1), else {}
    held: dict | None = None    # FSDP2 stages: single-process name -> this rank's DTensor parameter

    def held_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's parameters under their single-process names (a tp block's wrapper dropped);
        ``self.sharded`` says which are tp slices (``shard_of``); under FSDP2 they are DTensors
        sharded over the stage's dp group (``whole`` gathers one)."""
        if self.held is not None:
            return dict(self.held)
        return _held(model, self.parameters())

    @property
    def stage(self):
        return self.layout.stage_of(self.rank)

    def running_stats(self) -> list[torch.Tensor]:
        """The batch-norm running means and variances of this rank's chunks (their replicas each
        update their own over the step's microbatches; ``_step`` averages them over dp)."""
        return [b for _, m in self.modules for bn in m.modules() if isinstance(bn, nn.modules.batchnorm._BatchNorm)
                for b in (bn.running_mean, bn.running_var) if b is not None]

    def parameters(self):
        seen = set()
        for _, m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The watchdog: a communication error inside the step (a peer died: its sockets closed;
        or the process group's time-out) becomes :class:`~autopar.runtime.launch.PeerFailure`
        naming the failed rank when the launcher knows it (``launch.peer_failures``), so every
        surviving rank's error names it; other errors pass unchanged."""
        try:
            return self._step(inputs, targets)
        except Exception as e:
            raise_peer_failure(e, f"in stage {self.stage.index}'s schedule step (rank {self.rank})")
            raise

    def _step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        st, (d, _) = self.stage, self.groups.coords
        rows = inputs.shape[0] // st.dp
        x = inputs[d * rows:(d + 1) * rows]
        y = targets[d * rows:(d + 1) * rows]
        chunks = [c for c, _ in self.modules]
        first, last = 0 in chunks, (self.layout.num_stages * self.layout.schedule.virtual - 1) in chunks
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        kw = {"target": y, "losses": losses} if last else {}
        before = [None if p.grad is None else local(p.grad).detach().clone() for p, _ in self.tied]
        self.schedule.step(*args, **kw)
        for (p, g), b in zip(self.tied, before):   # a weight used on several stages (tied embeddings):
            if p.grad is None:                     # sum this step's parts (not what earlier steps left)
                p.grad = torch.zeros_like(p)
            new = local(p.grad)                    # FSDP2: peers hold the same rows of it
            if b is not None:
                new -= b
            dist.all_reduce(new, group=g)
            if b is not None:
                new += b
        if self.groups.dp is not None and st.data != "fsdp":   # one all-reduce of every gradient, flattened
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.groups.dp)
            flat /= st.dp
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
        if self.groups.dp is not None:       # batch norm: the replicas' running statistics, averaged
            for b in self.running_stats():
                dist.all_reduce(b, group=self.groups.dp)
                b /= st.dp
        # the global loss on every rank: the last stage's tp-rank-0 ranks contribute
        contrib = torch.zeros((), dtype=torch.float64)
        if last and self.groups.coords[1] == 0:
            contrib = torch.stack([l.detach().to(torch.float64) for l in losses]).sum() / st.dp   # each is 1/M
        dist.all_reduce(contrib)
        return contrib


def _wrapped_names(model: nn.Module) -> set[str]:
    return {f"blocks.{i}.b.{n}" for i, blk in enumerate(getattr(model, "blocks", ())) if isinstance(blk, _TPBlock)
            for n, _ in blk.b.named_parameters()}


def _held(model: nn.Module, params) -> dict[str, torch.Tensor]:
    """``params`` under their single-process names (a tp block's ``.b.`` wrapper dropped)."""
    mine = {id(p) for p in params}
    wrapped = _wrapped_names(model)
    return {n.replace(".b.", ".", 1) if n in wrapped else n: p for n, p in model.named_parameters() if id(p) in mine}


def _static_metas(modules_all: list[StageModule], microbatch: torch.Tensor) -> list[tuple[tuple, Any]]:
    """(inputs, outputs) of every chunk for one microbatch, from one forward of the chunks in
    model order with every module in eval mode and no autograd: nothing is updated (batch-norm
    running statistics stay as they are), unlike torch's dynamic shape inference, which runs a
    training-mode forward and so would update them once more than the step does."""
    modes = [(m, m.training) for c in modules_all for m in c.modules()]
    out: list[tuple[tuple, Any]] = []
    try:
        for c in modules_all:
            c.eval()
        with torch.no_grad():
            values: tuple = (microbatch,)
            for c in modules_all:
                res = c(*values)
                out.append((tuple(_needs_grad(v) for v in values) if out else values,
                            tuple(_needs_grad(v) for v in res) if isinstance(res, tuple) else _needs_grad(res)))
                values = res if isinstance(res, tuple) else (res,)
    finally:
        for m, t in modes:
            m.train(t)
    return out


def _needs_grad(t):
    """The metadata tensor of a value that carries a gradient across a cut (floating point)."""
    return t.detach().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t


def build_runner(model: nn.Module, layout: StageLayout, rank: int, loss_fn: Callable,
                 heads: int | None = None, example_microbatch: torch.Tensor | None = None) -> StageRunner:
    """Cut ``model`` (built identically on every rank) into this rank's stage modules, shard its
    blocks over the stage's tp group when tp > 1 (plain GPT blocks; ``heads`` needed), and make
    torch's schedule for ``layout.schedule``. Every rank calls it (group creation is collective).
    ``example_microbatch`` (one microbatch of the first stage's input) gives torch the shapes
    that cross each cut up front (``_static_metas``); without it torch infers them on the first
    step with a training-mode forward (which updates batch-norm running statistics once more)."""
    from torch.distributed.pipelining import PipelineStage
    groups = make_groups(layout, rank)
    st = layout.stage_of(rank)
    sharded: dict = {}
    if st.tp > 1:
        if heads is None:
            raise PipelineError("tensor parallelism inside a stage needs the number of heads", "pass heads=")
        sharded = shard_gpt_blocks(model, heads, groups.coords[1], st.tp, groups.tp)
    modules = stage_modules(model, layout, st.index)
    n_chunks = layout.num_stages * layout.schedule.virtual
    every = _all_chunks(model, layout)
    tied = _tied_groups(model, layout, every, rank)
    metas: dict[int, tuple] = {}
    if example_microbatch is not None:
        metas = dict(enumerate(_static_metas(every, example_microbatch)))
    held = None
    if st.data == "fsdp" and groups.dp is not None:
        if layout.schedule.name in SPLIT_BACKWARD:
            raise PipelineError(f"stage {st.index} is FSDP2 under the {layout.schedule.name} schedule, whose weight-"
                                "gradient step does not reach FSDP2's gathered parameters",
                                "re-plan with --stage-data replicate or a schedule with whole backward steps")
        # fully_shard replaces each parameter by a DTensor: find every one (and each tied weight)
        # again by its path in this rank's chunk modules afterwards
        by_id = {id(p): n for n, p in _held(model, (p for _, m in modules for p in m.parameters())).items()}
        where: dict[str, tuple[nn.Module, str]] = {}
        for _, m in modules:
            for path, p in m.named_parameters(remove_duplicate=False):
                if id(p) in by_id:
                    where.setdefault(by_id[id(p)], (m, path))
        tied_at = [(where[by_id[id(p)]], g) for p, g in tied]
        modules = shard_stage(modules, groups.dp, model)
        held = {n: m.get_parameter(path) for n, (m, path) in where.items()}
        tied = tuple((m.get_parameter(path), g) for (m, path), g in tied_at)
    stages = [PipelineStage(m, c, n_chunks, torch.device("cpu"), group=groups.pipeline,
                            **({"input_args": metas[c][0], "output_args": metas[c][1]} if metas else {}))
              for c, m in modules]
    cls = _schedule_class(layout.schedule.name)
    m = layout.schedule.microbatches
    # the loss of each microbatch divided by M here, not torch's ``scale_grads`` (which divides the
    # whole .grad after the step, so a gradient accumulated over several steps would shrink too)
    per_mb = stage_loss(model, loss_fn)
    schedule = cls(stages if layout.schedule.multi else stages[0], m,
                   loss_fn=lambda out, target: per_mb(out, target) / m, scale_grads=False)
    return StageRunner(layout, rank, modules, groups, schedule, loss_fn, tied, sharded, held)


def shard_stage(modules: list[tuple[int, StageModule]], dp_group, model: nn.Module) -> list[tuple[int, StageModule]]:
    """FSDP2 over the stage's dp group (``Stage.data == "fsdp"``): ``fully_shard`` on every block
    of this rank's chunks, then on each chunk module (its pre/post parameters: embeddings, head),
    torchtitan's order (tensor parallelism, ``shard_gpt_blocks``, already applied; the shards are
    then cut again over dp). torch's ``PipelineStage`` drives FSDP2 under a schedule: gradients stay
    whole across the microbatches and are reduce-scattered (averaged over dp) once after the last
    backward. A weight in two chunks of one rank (a tied embedding under a V-shaped schedule)
    would be sharded twice: refused, naming it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    seen: dict[int, int] = {}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for c, m in modules:
        for p in m.parameters():
            if seen.setdefault(id(p), c) != c:
                raise PipelineError(f"parameter {names.get(id(p), '?')} is in chunks {seen[id(p)]} and {c} of one "
                                    "rank: FSDP2 inside a stage would shard it twice",
                                    "plan with --stage-data replicate or a schedule with one chunk per rank")
    mesh = DeviceMesh.from_group(dp_group, "cpu")
    for _, m in modules:
        for blk in m.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return modules


def shard_like(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (the whole tensor on this rank) placed as ``p`` is: for an FSDP2 DTensor, this
    rank's rows as ``torch.chunk`` cuts dim 0 (what ``fully_shard`` holds), as a DTensor on
    ``p``'s mesh; any other ``p``: ``full`` itself."""
    from torch.distributed.tensor import DTensor, Shard
    if not isinstance(p, DTensor):
        return full
    if tuple(pl for pl in p.placements) != (Shard(0),):
        raise PipelineError(f"a stage parameter placed {p.placements}, not FSDP2's Shard(0)", "re-plan the stages")
    if full.dim():
        r, n = p.device_mesh.get_local_rank(), p.device_mesh.size()
        start = min(r * -(-full.shape[0] // n), full.shape[0])
        rows = full.narrow(0, start, shard_rows(full.shape[0], n, r))
    else:
        rows = full
    return DTensor.from_local(rows.contiguous(), p.device_mesh, p.placements, run_check=False,
                              shape=full.shape, stride=full.stride())


def _tied_groups(model: nn.Module, layout: StageLayout, every: list[StageModule], rank: int) -> tuple:
    """Parameters used by chunks of several stages (GPT-2's embedding tied to its head): for each,
    one group per (d, t) coordinate over the peers of the stages holding it, so that each stage's
    part of the gradient is summed into the whole (Megatron's embedding group). Every rank
    creates every group, in name order (collective)."""
    stage_of_chunk = {c: s for s in range(layout.num_stages) for c in chunks_of_stage(layout, s)}
    holders: dict[int, set[int]] = {}
    for c, mod in enumerate(every):
        for p in mod.parameters():
            holders.setdefault(id(p), set()).add(stage_of_chunk[c])
    out = []
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        st = sorted(holders.get(id(p), ()))
        if len(st) < 2:
            continue
        if len({layout.stages[k].data for k in st}) > 1:     # whole on one stage, FSDP2 rows on another
            raise PipelineError(f"weight {name} is tied across stages {st} whose data axes differ "
                                f"({[layout.stages[k].data for k in st]}): its parts cannot be summed",
                                "plan with --stage-data replicate or fsdp (one for every stage)")
        g = peer_group(layout, st, rank)
        if g is not None:
            out.append((p, g))
    return tuple(out)


def peer_group(layout: StageLayout, stages: Sequence[int], rank: int):
    """Create, for every mesh index, the group of that index's rank in each of ``stages`` (where a
    weight tied across them has its parts summed); this rank's, or None when it is in none.
    Collective: every rank calls it with the same ``stages``."""
    mine = None
    for idx in range(len(layout.stages[0].ranks)):
        ranks = [layout.stages[s].ranks[idx] for s in stages]
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


# ------------------------------------------------------------------------------------------
# What torch sends over a cut, against the plan's cut steps
# ------------------------------------------------------------------------------------------


class CutMessageMismatch(PipelineError):
    """torch's ``PipelineStage`` sent over a cut other tensors than the plan's cut steps
    (plan.json ``runtime.cuts``) say: the plan was made for another model, batch or layout."""


def record_sends(runner: StageRunner) -> dict[tuple[int, int], list[tuple[int, tuple[int, ...], int]]]:
    """Log what this rank's chunks send forward: {(chunk, microbatch): [(peer global rank, shape,
    bytes)]}, filled as the schedule runs (every ``PipelineStage.get_fwd_send_ops`` is wrapped;
    the ops torch then posts are exactly these)."""
    log: dict[tuple[int, int], list[tuple[int, tuple[int, ...], int]]] = {}
    for st in _stages_of(runner.schedule):
        orig = st.get_fwd_send_ops

        def wrapped(fwd_chunk_id, *a, _orig=orig, _chunk=int(st.stage_index), **kw):
            ops = _orig(fwd_chunk_id, *a, **kw)
            log.setdefault((_chunk, int(fwd_chunk_id)), []).extend(
                (int(op.peer), tuple(op.tensor.shape), op.tensor.numel() * op.tensor.element_size()) for op in ops)
            return ops
        st.get_fwd_send_ops = wrapped
    return log


def _stages_of(schedule) -> list:
    one = getattr(schedule, "_stage", None)
    return [one] if one is not None else list(getattr(schedule, "_stages", ()))


def check_cut_messages(runner: StageRunner, log: dict[tuple[int, int], list[tuple[int, tuple[int, ...], int]]],
                       cuts: Sequence[CutPlan], itemsize: int | None = None) -> int:
    """Every microbatch each of this rank's chunks sent forward (``record_sends``) carried what
    the plan's cut after that chunk says for its rank pair (``cuts[c]``: the stage cuts when V = 1,
    the chunk cuts otherwise): the same shapes, value by value in any order, and (``itemsize``
    given: the plan's dtype ran) the same bytes; the last chunk sends nothing, nor does a cut the
    plan keeps on one rank group. Raises ``CutMessageMismatch``; returns the messages checked."""
    layout = runner.layout
    last = layout.num_stages * layout.schedule.virtual - 1
    m = layout.schedule.microbatches
    if len(cuts) != last:
        raise CutMessageMismatch(f"the plan records {len(cuts)} cuts, the layout has {last}", "re-plan this layout")
    n = 0
    for c, _ in runner.modules:
        mine = {mb: sent for (cc, mb), sent in log.items() if cc == c}
        if c == last:
            if any(mine.values()):
                raise CutMessageMismatch(f"rank {runner.rank}'s last chunk sent {mine}", "re-plan this layout")
            continue
        planned = {pair: shapes for pair, shapes in cuts[c].messages().items() if pair[0] == runner.rank}
        want = {peer: sorted(shapes) for (_, peer), shapes in planned.items()}
        if want and len(mine) != m:
            raise CutMessageMismatch(f"rank {runner.rank} sent {len(mine)} microbatches over cut {c}, the schedule "
                                     f"runs {m}", "re-plan this layout")
        for mb, sent in sorted(mine.items()):
            got: dict[int, list] = {}
            for peer, shape, nbytes in sent:
                got.setdefault(peer, []).append(shape)
                if itemsize is not None and nbytes != itemsize * _prod(shape):
                    raise CutMessageMismatch(f"rank {runner.rank}, microbatch {mb}: a {shape} message of {nbytes} "
                                             f"bytes, the plan's values are {itemsize} bytes per element",
                                             "re-plan this model")
                n += 1
            if {p: sorted(v) for p, v in got.items()} != want:
                raise CutMessageMismatch(
                    f"rank {runner.rank}, microbatch {mb}: torch sent {dict(sorted(got.items()))} over cut {c}, "
                    f"the plan's cut steps say {want}", "re-plan for this model, batch and stage layout")
    return n


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def reference_step(model: nn.Module, inputs, targets: torch.Tensor, loss_fn: Callable,
                   microbatches: int, dp: int = 1) -> torch.Tensor:
    """The one-process function a pipelined step computes (``inputs``: the model's input tensor, or
    a tuple of them, each cut alike along dim 0): the batch cut into ``dp`` row blocks,
    each into ``microbatches`` microbatches, run one after another (batch norm: statistics and
    running-statistics updates per microbatch, in that order, each row block from the same
    running statistics, which end as the mean of the blocks' -- the data-parallel replicas each
    update their own, then average them); the loss is the mean of the per-microbatch losses;
    backward of that mean. Returns the loss (detached)."""
    total = 0.0
    n = dp * microbatches
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    running = [b for m in bns for b in (m.running_mean, m.running_var) if b is not None]
    counts = [m.num_batches_tracked for m in bns if m.num_batches_tracked is not None]
    start = [b.detach().clone() for b in running + counts]
    ends = [torch.zeros_like(b) for b in running]
    xs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)     # one input or several
    blocks = list(zip(*(x.chunk(dp) for x in xs)))
    for xb, yb in zip(blocks, targets.chunk(dp)):
        with torch.no_grad():       # each data-parallel replica starts from the same running statistics
            for b, b0 in zip(running + counts, start):
                b.copy_(b0)
        for xm, ym in zip(zip(*(x.tensor_split(microbatches) for x in xb)), yb.tensor_split(microbatches)):
            loss = loss_fn(model(*xm), ym) / n
            loss.backward()
            total = total + loss.detach()
        for e, b in zip(ends, running):
            e += b.detach() / dp
    with torch.no_grad():           # and the step keeps their mean (``StageRunner``: over the dp group);
        for b, e in zip(running, ends):   # each replica counted its own M microbatches
            b.copy_(e)
    return torch.as_tensor(total)


__all__ = ["CutMessageMismatch", "StageModule", "StageRunner", "build_runner", "check_cut_messages", "chunk_ranges",
           "chunks_of_stage", "make_groups", "pipeline_parts", "record_sends", "reference_step", "shard_gpt_blocks", "shard_of", "stage_modules"]
