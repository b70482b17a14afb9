"""The conformance matrix: every shipped model x every decomposition kind pinned where legal x
world 2 and 4 x three checks, written to ``reports/conformance.md`` (issue 38, item 3).

Rows of each model's table: every kind of ``autopar.decomp.REGISTRY`` pinned with ``autopar
plan --pin '*=KIND'`` (``PlanOptions(pins=...)``: every layer where the kind is legal takes it,
the solver chooses the rest); the three batch-norm semantics on the
solver's own plan (``bn local``: per rank's samples, what DDP computes; ``bn group``: local with
``--bn-group G``; ``bn global``: the whole batch); and the tournament (``autopar plan
--trainers``): 2 trainers of W/2 ranks and W trainers of 1 rank. Columns: world 2 and 4, each
with three checks:

* ``execute``: ``autopar execute``'s validation (``autopar.execute.runner.execute``: one
  float64 step of the plan against one process, every tensor; timing cut to one step, no DDP);
* ``loop``: the user's own loop, ``autopar.parallelize`` + ``autopar.plan_loader`` (a PyG
  batch, whose graphs are not dataset rows: ``autopar.shard_batch`` of each global batch) +
  ``dmodel.loss`` + ``autopar.clip_grad_norm_`` + AdamW, ``LOOP_STEPS`` steps in float64; every
  step's loss and gradient norm, and every parameter and buffer after the steps, equal to the
  same loop in one process (``max|a-b| <= RTOL max|ref| + ATOL`` per tensor);
* ``checkpoint``: ``autopar.save`` under the row's plan of a model whose parameters and
  buffers were moved off their initial values, then ``autopar.load`` into the data-parallel
  plan at the other world size (2 <-> 4) of a model built with another seed: every parameter
  and buffer loaded equals the one saved, exactly.

A cell passes, fails (the error's first line is recorded), or is not legal, with the planner's
own reason: the pin refused with a named error (``PinError``: the kind is legal on no layer,
naming the first layer's legal kinds; or another, e.g. a tied parameter no plan can hold that
way), or the model has no batch norm, or ``--trainers`` refused. Tournament plans train under
``autopar execute`` only, so their ``loop`` and ``checkpoint`` cells are n/a. A cell whose
driver was cut short is "not run" (``--resume`` runs it).

Each (model, world) runs in its own driver process with a time-out; every check starts fresh
rank processes (``run_ranks``: a gloo error poisons its process group) with its own time-out.
Results are cached per cell in ``reports/conformance.json``; ``--resume`` reruns only failed or
missing cells. The report is rewritten (atomically) from the whole cache after each driver.

    python benchmarks/conformance.py                       # the whole matrix
    python benchmarks/conformance.py --quick               # the slice tests/test_conformance.py runs
    python benchmarks/conformance.py --models hf_gpt2 --kinds head,mlp --worlds 4 --resume

Models are kept small (``MODELS``): environment sizes where the model file has them, a batch
of 8 (4 for two CNNs), and for the three files without a size option a wrapper file, written
into the work directory, that imports the shipped file unchanged and then sets the input size
(``resnet50.py``, ``wide_resnet.py``: ``IMAGE``) or, for ``hf_resnet50.py``, builds the
file's Hugging Face ``ResNetForImageClassification`` from a small config.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REPORT = ROOT / "reports" / "conformance.md"
CACHE = ROOT / "reports" / "conformance.json"
WORK = Path(os.environ.get("AUTOPAR_CONFORMANCE_WORK", f"/tmp/autopar-conformance-{os.getuid()}"))

WORLDS = (2, 4)
CHECKS = ("execute", "loop", "checkpoint")
RTOL, ATOL = 1e-9, 1e-12          # float64, every tensor: max|a-b| <= RTOL max|ref| + ATOL
LOOP_STEPS, LOOP_SEED, LOOP_LR, LOOP_WD, MAX_NORM = 3, 5, 1e-2, 0.1, 0.5
# Adam divides each gradient element by its own magnitude (plus eps): a plan that sums in
# another order changes an element by rounding (~1e-16 relative, up to ~1e-13 absolute in the
# deep batch-norm CNNs), and Adam turns that into up to lr / eps times as much in the weight.
# With eps 1e-6 ResNet-50's channel plan at world 4 ended 3 steps 1.4e-8 of the weights' scale
# from one process (its exec, one SGD step, within 1e-9); eps 1e-4 bounds the factor at 100
LOOP_EPS = 1e-4
# A deep batch-norm net amplifies any rounding difference step by step (a normalisation over
# few values divides by a small deviation): ResNet-50 at world 4 with groups of 1 sample ended
# 3 steps 7e-8 apart. The loop check measures that sensitivity in one process: the same loop
# from weights scaled by (1 +- PERTURB_REL) (random signs, a few ulp) ends ``floor`` apart, and
# a plan passes a tensor within max(RTOL, min(FLOOR_FACTOR * floor, TOL_CAP)) of its scale: a
# loop whose floor passes the cap cannot tell a plan from one process, and fails saying so
PERTURB_REL, FLOOR_FACTOR, TOL_CAP = 1e-15, 100.0, 1e-6
# no pruning of a layer's candidates (``cost.table._pareto``): a kind is offered or refused
# by its own rules, never dropped for price
MAX_CANDIDATES = 1000
CELL_TIMEOUT_S = 300.0            # one check (its rank processes)
JOB_TIMEOUT_S = 2400.0            # one driver: a (model, world) and all its rows


@dataclass(frozen=True)
class ModelSpec:
    """A model file of the matrix and how it is kept small: ``env`` (the file's own size
    options), ``batch`` (the global batch), ``wrap`` (code run by a wrapper
    file that imports the shipped file unchanged)."""
    path: str
    batch: int = 8
    env: tuple[tuple[str, str], ...] = ()
    wrap: str = ""        # code run after the shipped file is imported as ``_m`` (a wrapper file)
    note: str = ""
    loop_rtol: float = 1e-9   # the loop check's tolerance (RTOL unless the note says why not)


_HF_RESNET_SMALL = """
class SmallHFResNet(torch.nn.Module):
    # the shipped file's module (transformers' ResNetForImageClassification, bottleneck layers)
    # at a small config: one block per stage, stages 64..512 wide, 10 labels
    def __init__(self):
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification
        self.net = ResNetForImageClassification(ResNetConfig(
            num_labels=10, embedding_size=32, hidden_sizes=[64, 128, 256, 512], depths=[1, 1, 1, 1]))

    forward = _m.HFResNet50.forward


def build_model():
    return SmallHFResNet()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 64, 64),)


def example_targets(batch_size):
    return torch.randint(0, 10, (batch_size,))
"""

#: light models first: a matrix run cut short has covered the most
MODELS: dict[str, ModelSpec] = {
    "towers": ModelSpec("strategies/examples/towers.py"),
    "ltfb_surrogate": ModelSpec("strategies/examples/ltfb_surrogate.py"),
    "ltfb_gan": ModelSpec("strategies/examples/ltfb_gan.py"),
    "gpt": ModelSpec("strategies/examples/gpt.py"),
    "parallel_gpt": ModelSpec("strategies/examples/parallel_gpt.py"),
    "torch_encoder": ModelSpec("strategies/examples/torch_encoder.py"),
    "hf_gpt2": ModelSpec("strategies/examples/hf_gpt2.py", note="Hugging Face GPT-2"),
    "hf_bert": ModelSpec("strategies/examples/hf_bert.py", note="Hugging Face BERT"),
    "hf_llama": ModelSpec("strategies/examples/hf_llama.py",
                          note="Hugging Face Llama; its RMSNorm computes in float32 whatever the input dtype "
                               "(transformers' LlamaRMSNorm.forward casts to float32 and back), so float64 checks "
                               "meet float32 rounding (~6e-8) where a plan sums in another order before a norm"),
    "gnn_pcqm4m": ModelSpec("strategies/examples/gnn_pcqm4m.py"),
    "pyg_nnconv": ModelSpec("strategies/examples/pyg_nnconv.py", note="PyTorch Geometric NNConv"),
    "resnet2d": ModelSpec("strategies/examples/resnet2d.py"),
    "meshtangle2d": ModelSpec("strategies/examples/meshtangle2d.py", batch=4, env=(("AUTOPAR_MESH_SIZE", "32"),),
                              note="32x32 meshes"),
    "cnn3d_large": ModelSpec("strategies/examples/cnn3d_large.py", batch=4, env=(("AUTOPAR_CNN3D_SIZE", "16"),),
                             note="16^3 volumes"),
    "hf_resnet50": ModelSpec("benchmarks/models/hf_resnet50.py", wrap=_HF_RESNET_SMALL,
                             note="Hugging Face ResNet (the file's ResNetForImageClassification) at a small "
                                  "config: 1 bottleneck block per stage, widths 64-512, 10 labels, 64x64 images"),
    "wide_resnet": ModelSpec("strategies/examples/wide_resnet.py", batch=16, wrap="_m.IMAGE = IMAGE = 16",
                             note="16x16 images, batch 16 (its head's BatchNorm1d normalises each group of "
                                  "samples per feature: a group of 1 cannot train, a group of 2 is ill-conditioned)"),
    # 25.6 M parameters whatever the image: each check costs ~30 s at world 4 here
    "resnet50": ModelSpec("strategies/examples/resnet50.py", wrap="_m.IMAGE = IMAGE = 64",
                          note="64x64 images"),
}

#: the slice CI runs (tests/test_conformance.py): a CNN, HF GPT-2 and a GNN at world 2
QUICK: dict[str, tuple[str, ...]] = {"resnet2d": ("spatial",), "hf_gpt2": ("sample", "vocab_head"),
                                     "pyg_nnconv": ("edges",)}
QUICK_WORLDS = (2,)

BN_ROWS = ("bn local", "bn group", "bn global")
TOURNAMENT_ROWS = ("tournament 2 x W/2", "tournament W x 1")


def kinds() -> tuple[str, ...]:
    from autopar.decomp import REGISTRY
    return tuple(REGISTRY)


def all_rows() -> tuple[str, ...]:
    return kinds() + BN_ROWS + TOURNAMENT_ROWS


def cell_key(model: str, row: str, world: int, check: str) -> str:
    return f"{model}|{row}|w{world}|{check}"


def first_line(e: BaseException | str) -> str:
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    line = lines[0] if lines else str(text)
    return line if len(line) <= 400 else line[:397] + "..."


def _rank_error(e: BaseException) -> str:
    """A ``RankFailure`` in short: 'rank R: <its error's first line>' (without the list of
    stopped ranks and the hint that follow it)."""
    import re
    m = re.match(r"rank (\d+)(?: \([^)]*\))? failed: (.*?); ranks that stopped", str(e), re.S)
    return first_line(f"rank {m.group(1)}: {m.group(2)}") if m else first_line(e)


# ---------------------------------------------------------------------------------------------
# model files
# ---------------------------------------------------------------------------------------------
def model_file(name: str, work: Path) -> Path:
    """The file to plan: the shipped one, or a wrapper that imports it unchanged and runs
    ``wrap`` (its text names the shipped file's sha256, so the trace cache follows it)."""
    spec = MODELS[name]
    src = (ROOT / spec.path).resolve()
    if not spec.wrap:
        return src
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    text = (f'"""Conformance matrix: {spec.path} (sha256 {sha}) imported unchanged, then smaller '
            f'inputs (benchmarks/conformance.py)."""\n'
            "import importlib.util as _u\n\nimport torch\n\n"
            f"_spec = _u.spec_from_file_location('_conformance_{name}', {str(src)!r})\n"
            "_m = _u.module_from_spec(_spec)\n_spec.loader.exec_module(_m)\n"
            "globals().update({k: v for k, v in vars(_m).items() if not k.startswith('__')})\n"
            f"{spec.wrap}\n")
    out = work / "models" / f"{name}.py"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.is_file() or out.read_text() != text:
        from autopar.io import atomic_write_text
        atomic_write_text(out, text)
    return out


def apply_env(name: str) -> None:
    for k, v in MODELS[name].env:
        os.environ[k] = v


# ---------------------------------------------------------------------------------------------
# what runs in the rank processes (forked: the parent does no torch compute)
# ---------------------------------------------------------------------------------------------
def _innermost(e: BaseException) -> str:
    """'Type: message' of the error that caused ``e``: a wrapper such as DCP's
    CheckpointException quotes its ranks' tracebacks, whose last 'XError: ...' line is the cause."""
    import re
    fails = getattr(e, "failures", None)          # DCP: {rank: (exception, traceback)}
    if isinstance(fails, dict) and fails:
        inner = next(iter(fails.values()))
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException):
            return _innermost(inner)
    lines = [ln.strip() for ln in str(e).splitlines()]
    causes = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Mismatch|Failed)\b.*:", ln)]
    if causes and causes[-1] != lines[0]:
        return first_line(causes[-1])
    return first_line(e)


def _explained(fn):
    """Rank functions raise their root cause's line first (``run_ranks`` reports first lines)."""
    import functools

    @functools.wraps(fn)
    def run(*a, **kw):
        try:
            return fn(*a, **kw)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:     # DCP's CheckpointException is a BaseException
            why = _innermost(e)
            if why.startswith(type(e).__name__):
                raise
            raise RuntimeError(f"{type(e).__name__}, caused by {why}") from e
    return run


def _f64(ts):
    return [t.double() if t.is_floating_point() else t for t in ts]


def _loop_data(mf, batch: int, graph_batch: bool):
    """Dataset mode: (inputs [2B...], target [2B...] or None), rows read through plan_loader.
    Graph-batch mode: a list of LOOP_STEPS global batches (PyG batches: graphs concatenated)."""
    import torch
    if graph_batch:
        out = []
        for k in range(LOOP_STEPS):
            torch.manual_seed(LOOP_SEED + 100 + k)
            xs = list(mf.example_inputs(batch))
            y = mf.example_targets(batch)
            out.append((_f64(xs), y.double() if y is not None and y.is_floating_point() else y))
        return out
    torch.manual_seed(LOOP_SEED)
    n = 2 * batch
    xs = _f64(list(mf.example_inputs(n)))
    y = mf.example_targets(n)
    if y is not None and y.is_floating_point():
        y = y.double()
    return xs, y


def _batches_one_process(mf, batch: int, graph_batch: bool):
    """The global batches the loop sees, in order (plan_loader's shuffle: epoch e visits
    randperm(N) of a generator seeded LOOP_SEED + e, drop-last)."""
    import torch
    data = _loop_data(mf, batch, graph_batch)
    if graph_batch:
        return data
    xs, y = data
    n = xs[0].shape[0]
    per_epoch = n // batch
    out = []
    for step in range(LOOP_STEPS):
        e, k = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(LOOP_SEED + e))
        idx = perm[k * batch:(k + 1) * batch]
        out.append(([x[idx] for x in xs], y[idx] if y is not None else None))
    return out


class _Rows:
    """A map-style data set of rows (x_1[i], ..., x_k[i][, y[i]])."""

    def __init__(self, xs, y):
        self.xs, self.y = xs, y

    def __len__(self):
        return int(self.xs[0].shape[0])

    def __getitem__(self, i):
        row = tuple(x[i] for x in self.xs)
        return row + ((self.y[i],) if self.y is not None else ())


def _optimizer(params):
    import torch
    return torch.optim.AdamW(params, lr=LOOP_LR, weight_decay=LOOP_WD, eps=LOOP_EPS)


def _loss(mf, out, y):
    fn = mf.loss_fn()
    return fn(out, y) if y is not None else fn(out)


@_explained
def _loop_reference(rank, world, mpath, batch, graph_batch, bn_group, out_path, perturb_rel=0.0, base_path=None):
    """One process, plain torch (batch norm over groups of ``bn_group`` samples when local):
    the loop every plan must reproduce. Saves the state after the steps to ``out_path``. With
    ``perturb_rel`` the initial weights are scaled by (1 +- perturb_rel) and the result holds
    ``floor``: each tensor's (and the losses' and norms') relative distance from the unperturbed
    run saved at ``base_path`` (``PERTURB_REL``)."""
    import torch

    from autopar.execute.validate import Float32Inside, ghost_batch_norm
    from autopar.modelfile import load_model_file
    mf = load_model_file(mpath)
    torch.manual_seed(0)
    model = mf.build_model().double()
    model.train()
    if perturb_rel:
        g = torch.Generator().manual_seed(99)
        with torch.no_grad():
            for p in model.parameters():
                sign = torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1
                p.mul_(1 + perturb_rel * sign)
    opt = _optimizer(model.parameters())
    losses, norms = [], []
    f32 = Float32Inside(model)      # a model that casts to float32 inside meets float32 rounding
    with ghost_batch_norm(bn_group), f32:
        for xs, y in _batches_one_process(mf, batch, graph_batch):
            opt.zero_grad()
            loss = _loss(mf, model(*xs), y)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            losses.append(loss.item())
    # every parameter once (a tied one under its first name, as named_parameters gives it) and
    # every buffer: what the loop trained
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    state = {k: v.detach().clone() for k, v in state.items()}
    torch.save(state, out_path)
    out = {"losses": losses, "norms": norms, "float32_inside": sorted(set(f32.modules))}
    if base_path is not None:
        base = torch.load(base_path)
        out["floor"] = {k: _close(v, base[k])[1] for k, v in state.items() if v.is_floating_point()}
    return out


def _chaotic(floor: dict[str, float]) -> str:
    worst = max(floor.values())
    return (f"; ill-conditioned: {FLOOR_FACTOR:g} x floor passes the cap {TOL_CAP:g}, the loop cannot "
            f"tell a plan's rounding from a bug here" if FLOOR_FACTOR * worst > TOL_CAP else "")


def _loop_tol(rtol: float, floor: float) -> float:
    return max(rtol, min(FLOOR_FACTOR * floor, TOL_CAP))


def _close(a, b, rtol: float = RTOL) -> tuple[bool, float]:
    import torch
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return False, float("inf")
    if a.numel() == 0:
        return True, 0.0
    d = float((a - b).abs().max())
    scale = float(b.abs().max())
    return d <= rtol * scale + ATOL, (d / scale if scale > 0 else (0.0 if d == 0 else float("inf")))


@_explained
def _loop_rank(rank, world, plan_path, mpath, batch, graph_batch, ref_path, rtol, floor):
    """The user's loop under the plan; rank 0 compares the state after the steps with the
    reference's and returns the worst tensor."""
    import torch

    import autopar
    from autopar.modelfile import load_model_file
    mf = load_model_file(mpath)
    torch.manual_seed(0)
    model = mf.build_model().double()
    model.train()
    dm = autopar.parallelize(model, plan_path)
    opt = _optimizer(dm.parameters())
    if graph_batch:
        steps = (autopar.shard_batch(dm, xs, y) for xs, y in _loop_data(mf, batch, True))
    else:
        xs, y = _loop_data(mf, batch, False)
        loader = autopar.plan_loader(_Rows(xs, y), dm, seed=LOOP_SEED)

        def gen():
            step, epoch = 0, 0
            while step < LOOP_STEPS:
                loader.batch_sampler.set_epoch(epoch)
                for b in loader:
                    if step < LOOP_STEPS:
                        yield b
                    step += 1
                epoch += 1
        steps = gen()
    losses, norms = [], []
    for inputs, target in steps:
        opt.zero_grad()
        loss = dm.loss(inputs, target)
        loss.backward()
        norms.append(float(autopar.clip_grad_norm_(dm, MAX_NORM)))
        opt.step()
        losses.append(loss.item())
    state = autopar.full_state_dict(dm)
    if rank != 0:
        return None
    ref = torch.load(ref_path)
    bad, worst = [], ("", 0.0)
    for k, v in ref.items():
        if k not in state:
            bad.append(f"{k}: missing")
            continue
        if not v.is_floating_point():
            ok, rel = bool(torch.equal(state[k].to(v.dtype), v)), 0.0
        else:
            ok, rel = _close(state[k], v, _loop_tol(rtol, floor.get(k, 0.0)))
        if rel > worst[1]:
            worst = (k, rel)
        if not ok:
            bad.append(f"{k} rel {rel:.3g} (floor {floor.get(k, 0.0):.1e})")
    return {"losses": losses, "norms": norms, "bad": bad, "worst": worst,
            "extra_keys": sorted(set(state) - set(ref))}


def _perturbed_model(mf, seed: int, perturb: bool):
    import torch
    torch.manual_seed(seed)
    model = mf.build_model().double()
    if perturb:
        g = torch.Generator().manual_seed(seed + 17)
        with torch.no_grad():
            for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
                t.add_(0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype))
            for b in model.buffers():
                if not b.is_floating_point():
                    b.add_(3)
    return model


@_explained
def _save_rank(rank, world, plan_path, mpath, ckpt, expected_path):
    import torch

    import autopar
    from autopar.modelfile import load_model_file
    mf = load_model_file(mpath)
    dm = autopar.parallelize(_perturbed_model(mf, 0, True), plan_path)
    autopar.save(ckpt, dm)
    full = autopar.full_state_dict(dm)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, expected_path)
    return None


@_explained
def _load_rank(rank, world, plan_path, mpath, ckpt, expected_path):
    import torch

    import autopar
    from autopar.modelfile import load_model_file
    mf = load_model_file(mpath)
    dm = autopar.parallelize(_perturbed_model(mf, 1, False), plan_path)
    before = {k: v.detach().clone() for k, v in autopar.full_state_dict(dm).items()}
    autopar.load(ckpt, dm)
    after = autopar.full_state_dict(dm)
    if rank != 0:
        return None
    want = torch.load(expected_path)
    differ = [k for k in want if not torch.equal(after.get(k, torch.empty(0)), want[k])]
    same_before = [k for k in want if k in before and torch.equal(before[k], want[k])]
    return {"differ": differ, "unchanged_by_load": same_before, "keys": len(want),
            "missing": sorted(set(want) - set(after))}


# ---------------------------------------------------------------------------------------------
# planning a row, running a check (the driver: one (model, world))
# ---------------------------------------------------------------------------------------------
@dataclass
class RowPlan:
    """A row's plan at one world: ``plan_path`` (None when not legal), ``reason`` (why not
    legal, or planning's failure), ``status`` ("planned", "not_legal", "fail"), ``note``
    (what was pinned)."""
    status: str
    plan_path: Path | None = None
    reason: str = ""
    note: str = ""
    tournament: bool = False


@dataclass
class Driver:
    """Plans the rows of one model at one world and runs their checks."""
    model: str
    world: int
    work: Path
    cell_timeout_s: float = CELL_TIMEOUT_S
    _plans: dict[str, RowPlan] = field(default_factory=dict)
    _refs: dict[Any, Any] = field(default_factory=dict)
    _free: Any = None
    _dp_other: Any = None

    def __post_init__(self) -> None:
        apply_env(self.model)
        self.spec = MODELS[self.model]
        self.dir = self.work / self.model / f"w{self.world}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mpath = model_file(self.model, self.work)
        sys.path.insert(0, str(ROOT / "tests"))
        from fakes import synthetic_profile
        self.profile = synthetic_profile()

    # ---- planning ------------------------------------------------------------------------
    def options(self, world: int | None = None, out: Path | None = None, **kw):
        from autopar.artifacts import PlanOptions
        return PlanOptions(world_size=world or self.world, batch_size=self.spec.batch,
                           out_dir=str(out) if out else None, placement="block", speed_history=False,
                           max_candidates=MAX_CANDIDATES, write=out is not None, **kw)

    def hooks(self, **kw):
        from autopar.artifacts import PlanHooks
        return PlanHooks(profile=self.profile, **kw)

    def free(self):
        """The solver's own plan at this world (its cost table says which layer offers what)."""
        if self._free is None:
            from autopar.planner import make_plan
            self._free = make_plan(self.mpath, self.options(out=self.dir / "free"), self.hooks())
        return self._free

    def dp_other(self) -> Path:
        """The data-parallel plan at the other world size (where checkpoints are loaded)."""
        if self._dp_other is None:
            from autopar.errors import AutoparError
            from autopar.planner import make_plan
            other = 6 - self.world if self.world in (2, 4) else 2
            out = self.work / self.model / f"w{other}" / "dp-load"
            try:
                r = make_plan(self.mpath, self.options(world=other, out=out, kinds=("sample",)), self.hooks())
            except AutoparError:      # no sample split anywhere (a PyG batch): the solver's plan
                r = make_plan(self.mpath, self.options(world=other, out=out), self.hooks())
            self._dp_other = r.plan_path
        return self._dp_other

    def plan(self, row: str) -> RowPlan:
        if row not in self._plans:
            try:
                self._plans[row] = self._plan(row)
            except Exception as e:     # a planner bug, not a refusal: the row's cells fail
                self._plans[row] = RowPlan("fail", reason="planning: " + first_line(e),
                                           note=traceback.format_exc(limit=3))
        return self._plans[row]

    def _has_batch_norm(self) -> bool:
        g = self.free().plan.graph()
        return any(op.kind == "batch_norm" for lay in g.layers for op in lay.ops)

    def _plan(self, row: str) -> RowPlan:
        from autopar.errors import AutoparError
        from autopar.planner import make_plan
        out = self.dir / row.replace(" ", "_").replace("/", "")
        if row in BN_ROWS:
            if not self._has_batch_norm():
                return RowPlan("not_legal", reason="the model has no batch norm")
            if row == "bn local":
                return RowPlan("planned", self.free().plan_path, note="the solver's plan, --batch-norm local")
            if row == "bn global":
                r = make_plan(self.mpath, self.options(out=out, batch_norm="global"), self.hooks())
                return RowPlan("planned", r.plan_path, note="the solver's plan, --batch-norm global")
            per_rank = self.spec.batch // self.world
            g = per_rank // 2 if per_rank >= 2 else 2 * per_rank
            try:
                r = make_plan(self.mpath, self.options(out=out, batch_norm="local", bn_group=g), self.hooks())
            except AutoparError as e:
                return RowPlan("not_legal", reason=f"--bn-group {g} refused: " + first_line(e))
            return RowPlan("planned", r.plan_path, note=f"the solver's plan, --batch-norm local --bn-group {g}")
        if row in TOURNAMENT_ROWS:
            from autopar.tournament.pricing import TournamentOptions, make_tournament_plan
            t = 2 if row == TOURNAMENT_ROWS[0] else self.world
            try:
                r = make_tournament_plan(self.mpath, self.options(out=out),
                                         TournamentOptions(trainers=t, interval_steps=2), self.hooks())
            except AutoparError as e:
                return RowPlan("not_legal", reason=f"--trainers {t} refused: " + first_line(e))
            return RowPlan("planned", r.plan_path, note=f"{t} trainers x {self.world // t} ranks, "
                                                        "a tournament every 2 steps", tournament=True)
        return self._plan_kind(row, out)

    def _plan_kind(self, kind: str, out: Path) -> RowPlan:
        """``autopar plan --pin '*=KIND'`` (``PlanOptions(pins=...)``): every layer where KIND is
        legal takes it, the solver the rest; a refusal (``PinError``: legal on no layer, with
        the first layer's legal kinds; or another named error) is the row's reason. Before the
        pin API existed: ``PlanHooks(force=...)`` on every layer the cost table offers KIND."""
        from autopar.errors import AutoparError
        from autopar.planner import make_plan
        n_layers = len(self.free().table.layers)
        pins = self._pin_option(kind)
        if pins is not None:
            try:
                r = make_plan(self.mpath, self.options(out=out, pins=pins), self.hooks())
            except AutoparError as e:
                return RowPlan("not_legal", reason=f"--pin '*={kind}' refused: " + first_line(e))
        elif kind == "graphs":        # plan-level (no layer choice): --kinds graphs asks for it
            try:
                r = make_plan(self.mpath, self.options(out=out, kinds=("graphs",)), self.hooks())
            except AutoparError as e:
                return RowPlan("not_legal", reason="refused: " + first_line(e))
        else:
            table = self.free().table
            layers = [i for i, o in enumerate(table.layers) if any(d.kind == kind for d in o.choices)]
            if not layers:
                return RowPlan("not_legal", reason=f"no layer offers {kind}" + self._why_not(kind))
            try:
                r = make_plan(self.mpath, self.options(out=out), self.hooks(force={i: kind for i in layers}))
            except AutoparError as e:
                return RowPlan("not_legal", reason="pin refused: " + first_line(e))
        got = [d for d in r.plan.layers if d.choice.split("(")[0] == kind]
        if kind == "graphs":
            chosen = sorted({d.choice for d in r.plan.layers})
            return RowPlan("planned", r.plan_path, note="graphs: the plan-level graph-parallel plan ("
                                                        + ", ".join(chosen[:3]) + ")")
        if not got:
            return RowPlan("fail", reason=f"{kind} pinned, the plan holds no layer of it")
        chosen = sorted({d.choice for d in got})
        return RowPlan("planned", r.plan_path,
                       note=f"{len(got)} of {n_layers} layers pinned: " + ", ".join(chosen[:4])
                       + (" ..." if len(chosen) > 4 else ""))

    @staticmethod
    def _pin_option(kind: str):
        """``PlanOptions(pins=...)`` where the pin API exists (issue 38 item 2), else None."""
        from autopar.artifacts import PlanOptions
        if "pins" not in {f.name for f in dataclasses.fields(PlanOptions)}:
            return None
        return (f"*={kind}",)

    def _why_not(self, kind: str) -> str:
        """One layer's reason for refusing a candidate of ``kind``, where the table kept one."""
        table = self.free().table
        for i, o in enumerate(table.layers):
            for name, why in (o.illegal or {}).items():
                if name.split("(")[0] == kind:
                    lay = o.layer
                    return f" (e.g. layer {i} {getattr(lay, 'module', '') or getattr(lay, 'name', '')}: {name}: {why})"
        return " (no layer lists a candidate of it, legal or not: its rules match none of the model's operators)"

    # ---- checks --------------------------------------------------------------------------
    def warm(self) -> None:
        """Import here, once, what every rank would import on its own: ``parallelize`` runs the
        model on meta tensors (``runtime.model.output_structure``), which imports ~800 modules
        (torch._refs, _prims, _decomp: 5-10 s per forked rank when planning read its graph
        from the trace cache), and DCP. Meta tensors only: no compute before forking."""
        if getattr(self, "_warmed", False):
            return
        self._warmed = True
        import torch
        import torch.distributed.checkpoint  # noqa: F401  (autopar.save / load)

        from autopar.modelfile import load_model_file
        from autopar.runtime.model import output_structure
        try:
            mf = load_model_file(self.mpath)
            with torch.device("meta"):
                model = mf.build_model()
            output_structure(model, self.free().plan.graph())
        except Exception:       # only a warm-up: the checks meet any error themselves
            pass

    def check(self, row: str, check: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        rp = self.plan(row)
        if rp.status == "planned":
            self.warm()
        if rp.status != "planned":
            res = {"status": rp.status, "detail": rp.reason}
        elif rp.tournament and check != "execute":
            res = {"status": "n/a", "detail": "a tournament plan trains under autopar execute only "
                                              "(its trainers' loop is the runtime's)"}
        else:
            try:
                res = getattr(self, f"_check_{check}")(row, rp)
            except Exception as e:
                from autopar.errors import RankFailure
                res = {"status": "fail", "detail": _rank_error(e) if isinstance(e, RankFailure) else first_line(e)}
        res.setdefault("note", rp.note if rp.status == "planned" else "")
        res["seconds"] = round(time.perf_counter() - t0, 2)
        return res

    def _check_execute(self, row: str, rp: RowPlan) -> dict[str, Any]:
        from autopar.errors import ValidationFailed
        from autopar.execute.runner import ExecuteOptions, execute
        opts = ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, ddp=False, rounds=2,
                              timeout_s=self.cell_timeout_s)
        out = self.dir / "runs" / row.replace(" ", "_").replace("/", "")
        try:
            run, _ = execute(rp.plan_path, opts, out_dir=out, progress=lambda s: None)
        except ValidationFailed as e:
            return {"status": "fail", "detail": first_line(e.message)}
        if run.kind == "tournament":   # autopar.artifacts.TournamentRun
            v = run.validation
            ok = bool(run.passed)
            return {"status": "pass" if ok else "fail",
                    "detail": (f"{v.checked} tensors of every trainer against the simulation"
                               if ok else first_line(json.dumps(v.to_json() if v else {})[:400]))}
        v = run.validation
        return {"status": "pass" if v.passed else "fail",
                "detail": f"{v.checked} tensors within rtol {v.rtol:g}" if v.passed else "validation failed"}

    def _graph_batch(self) -> bool:
        g = self.free().plan.graph()
        b = self.spec.batch
        return any(int(gi.shape[0]) != b for gi in g.inputs if len(gi.shape))

    def _check_loop(self, row: str, rp: RowPlan) -> dict[str, Any]:
        from autopar.artifacts import load_plan
        from autopar.runtime.launch import run_ranks
        bn = load_plan(rp.plan_path).bn_stats()
        group = bn.group if bn.local else None
        gb = self._graph_batch()
        key = (group, gb)
        if key not in self._refs:
            path = self.dir / f"loop-ref-{group}.pt"
            ref = run_ranks(_loop_reference, 1, args=(str(self.mpath), self.spec.batch, gb, group, str(path)),
                            timeout_s=self.cell_timeout_s)[0]
            nudged = run_ranks(_loop_reference, 1, args=(str(self.mpath), self.spec.batch, gb, group,
                                                         str(self.dir / f"loop-ref-{group}-nudged.pt"),
                                                         PERTURB_REL, str(path)),
                               timeout_s=self.cell_timeout_s)[0]
            floor = dict(nudged["floor"])
            floor["losses"] = _close(nudged["losses"], ref["losses"])[1]
            floor["norms"] = _close(nudged["norms"], ref["norms"])[1]
            self._refs[key] = (ref, path, floor)
        ref, path, floor = self._refs[key]
        rtol = self.spec.loop_rtol
        f32_note = ""
        if ref.get("float32_inside"):     # what autopar execute does too (execute.validate.Float32Inside)
            from autopar.execute.validate import DEFAULT_TOL
            rtol = max(rtol, DEFAULT_TOL["float32"][0])
            f32_note = f"; the model computes in float32 inside ({', '.join(ref['float32_inside'])}): rtol {rtol:g}"
        got = run_ranks(_loop_rank, self.world, args=(str(rp.plan_path), str(self.mpath), self.spec.batch, gb, str(path),
                                                    rtol, floor),
                        timeout_s=self.cell_timeout_s)[0]
        ok_l, rel_l = _close(got["losses"], ref["losses"], _loop_tol(rtol, floor["losses"]))
        ok_n, rel_n = _close(got["norms"], ref["norms"], _loop_tol(rtol, floor["norms"]))
        worst_floor = max(floor.values())
        how = "shard_batch" if gb else "plan_loader"
        if not ok_l:
            return {"status": "fail", "detail": f"losses differ (rel {rel_l:.3g}, one process's own floor "
                                                f"{floor['losses']:.1e}{_chaotic(floor)}): {got['losses']} vs {ref['losses']}"}
        if not ok_n:
            return {"status": "fail", "detail": f"gradient norms differ (rel {rel_n:.3g}, floor {floor['norms']:.1e}"
                                                f"{_chaotic(floor)}): "
                                                f"{got['norms']} vs {ref['norms']}"}
        if got["bad"]:
            return {"status": "fail", "detail": f"{len(got['bad'])} tensors differ after {LOOP_STEPS} steps: "
                                                + "; ".join(got["bad"][:3]) + f" (one process's own floor up to "
                                                f"{worst_floor:.1e}{_chaotic(floor)})"}
        clipped = max(ref["norms"]) > MAX_NORM
        return {"status": "pass", "detail": f"{LOOP_STEPS} AdamW steps via {how}: losses rel {rel_l:.1e}, worst "
                                            f"tensor {got['worst'][0] or '-'} rel {got['worst'][1]:.1e}"
                                            + f", floor {worst_floor:.1e}"
                                            + ("" if clipped else " (clipping did not clip)") + f32_note}

    def _check_checkpoint(self, row: str, rp: RowPlan) -> dict[str, Any]:
        import shutil

        from autopar.runtime.launch import run_ranks
        target = self.dp_other()
        other = 6 - self.world if self.world in (2, 4) else 2
        tag = row.replace(" ", "_").replace("/", "")
        ck = self.dir / f"ckpt-{tag}"
        want = self.dir / f"ckpt-{tag}.pt"
        shutil.rmtree(ck, ignore_errors=True)
        try:
            run_ranks(_save_rank, self.world, args=(str(rp.plan_path), str(self.mpath), str(ck), str(want)),
                      timeout_s=self.cell_timeout_s)
            got = run_ranks(_load_rank, other, args=(str(target), str(self.mpath), str(ck), str(want)),
                            timeout_s=self.cell_timeout_s)[0]
        finally:
            shutil.rmtree(ck, ignore_errors=True)
            want.unlink(missing_ok=True)
        if got["missing"] or got["differ"]:
            return {"status": "fail", "detail": f"loaded into the data-parallel plan at world {other}: "
                                                f"{len(got['differ'])} of {got['keys']} tensors differ from the saved ones: "
                                                + ", ".join((got["missing"] or got["differ"])[:3])}
        vacuous = [k for k in got["unchanged_by_load"]]
        if vacuous:
            return {"status": "fail", "detail": f"test defect: {len(vacuous)} tensors were already equal before "
                                                f"the load: {vacuous[:3]}"}
        return {"status": "pass", "detail": f"saved at world {self.world}, loaded into the data-parallel plan "
                                            f"at world {other}: {got['keys']} tensors equal"}


# ---------------------------------------------------------------------------------------------
# the cache and the report
# ---------------------------------------------------------------------------------------------
def read_cache(path: Path) -> dict[str, Any]:
    if path.is_file():
        try:
            d = json.loads(path.read_text())
            if isinstance(d, dict) and isinstance(d.get("cells"), dict):
                return d
        except json.JSONDecodeError:
            pass
    return {"schema": "autopar.conformance/1", "cells": {}, "commands": []}


def write_cache(path: Path, cache: dict[str, Any]) -> None:
    from autopar.io import atomic_write_json
    cache["cells"] = dict(sorted(cache["cells"].items()))
    atomic_write_json(path, cache)


SYMBOL = {"pass": "pass", "not_legal": "–", "fail": "**FAIL**", "n/a": "n/a", "not_run": "not run"}
STATUSES = ("pass", "not_legal", "fail", "n/a", "not_run")
RERUN = (None, "fail", "not_run")      # what --resume runs again


def render(cache: dict[str, Any]) -> str:
    cells = cache["cells"]
    models = [m for m in MODELS if any(k.startswith(m + "|") for k in cells)]
    counts = {s: 0 for s in STATUSES}
    for c in cells.values():
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    rows_order = all_rows()
    lines = ["# Conformance matrix", "",
             "Every shipped model x every decomposition kind pinned where legal x world 2 and 4 x three checks "
             "(issue 38). Written by `benchmarks/conformance.py` from its cache `reports/conformance.json`; "
             "do not edit by hand.", "",
             f"**{len(cells)} cells: {counts['pass']} pass, {counts['not_legal']} not legal, "
             f"{counts['fail']} fail, {counts['n/a']} n/a"
             + (f", {counts['not_run']} not run (the run was cut short; `--resume` runs them)" if counts["not_run"] else "")
             + ".**", "",
             "Commands that made it (the cache merges runs; the last one first):", ""]
    for c in reversed(cache.get("commands", [])[-6:]):
        lines.append(f"    {c['when']}  {c['command']}" + (f"    # code {c['code']}" if c.get("code") else ""))
    lines += ["", "## Legend", "",
              "* Columns `wN exec / loop / ckpt`: world N (N CPU processes, gloo), and the three checks:",
              "  * **exec**: `autopar execute`'s validation: one float64 step of the plan against one process, "
              "every tensor (output, loss, input gradients, every parameter gradient, parameters after an SGD "
              "step, buffers) within `max|a-b| <= 1e-9 max|ref| + 1e-12`; tournament rows: the tournament "
              "(2 rounds of 2 steps) against its single-process simulation.",
              f"  * **loop**: the user's loop, `autopar.parallelize` + `autopar.plan_loader` (PyG batches: "
              f"`autopar.shard_batch` of each global batch) + `dmodel.loss` + `autopar.clip_grad_norm_({MAX_NORM})` "
              f"+ AdamW (lr {LOOP_LR}, weight decay {LOOP_WD}, eps {LOOP_EPS:g}: see `LOOP_EPS`), {LOOP_STEPS} steps in float64: every loss and "
              f"gradient norm, and every parameter and buffer after the steps, against the same loop in one "
              f"process (batch norm per the plan's statistics), within `max|a-b| <= tol max|ref| + {ATOL:g}`, "
              f"tol = max({RTOL:g}, min({FLOOR_FACTOR:g} x floor, {TOL_CAP:g})): the floor is how far the same loop in one process "
              f"ends from itself started from weights scaled by (1 +- {PERTURB_REL:g}), per tensor (deep batch-norm "
              f"nets amplify rounding step by step; elsewhere the floor is far below 1e-11 and tol is {RTOL:g}).",
              "  * **ckpt**: `autopar.save` under the row's plan (parameters and buffers moved off their "
              "initial values), then `autopar.load` into the data-parallel plan at the other world size "
              "(2 <-> 4) of a model built with another seed: every parameter and buffer equal to the saved one, "
              "exactly.",
              "* Rows: each kind of `autopar.decomp.REGISTRY` pinned on every layer that offers it (the other "
              "layers left to the solver); `bn local` / `bn group` / `bn global`: the solver's own plan with "
              "`--batch-norm local` (per rank's samples, as DDP), `local --bn-group G`, `global`; "
              "`tournament 2 x W/2` and `tournament W x 1`: `autopar plan --trainers`.",
              "* `pass`; `–`: not legal there, the planner's reason in the notes; **FAIL**: the error's first "
              "line in the notes; `n/a`: a tournament plan trains under `autopar execute` only. `[k]` numbers "
              "a note under the table.",
              "* Plans are priced with a synthetic profile (`tests/fakes.py`), block placement, every legal "
              "candidate of every layer kept (no pruning); pins: `autopar plan --pin '*=KIND'` "
              "(`PlanOptions(pins=...)`), or before that API `PlanHooks(force=...)` on every layer offering KIND.", ""]
    lines += ["## Counts per model", "", "| model | size | pass | not legal | fail | n/a | not run |",
              "|---|---|---|---|---|---|---|"]
    for m in models:
        cs = [c for k, c in cells.items() if k.startswith(m + "|")]
        n = {s: sum(1 for c in cs if c["status"] == s) for s in counts}
        spec = MODELS[m]
        size = ", ".join(filter(None, [f"batch {spec.batch}", spec.note]
                                + [f"{k}={v}" for k, v in spec.env]))
        size += "; a wrapper imports the file unchanged" if spec.wrap else ""
        lines.append(f"| {m} (`{spec.path}`) | {size} | {n['pass']} | {n['not_legal']} | {n['fail']} | {n['n/a']} "
                     f"| {n['not_run']} |")
    failing = []
    for m in models:
        lines += ["", f"## {m}", "", f"`{MODELS[m].path}`", ""]
        worlds = sorted({int(k.split("|")[2][1:]) for k in cells if k.startswith(m + "|")})
        head = "| row | " + " | ".join(f"w{w} {c[:4] if c != 'checkpoint' else 'ckpt'}" for w in worlds for c in CHECKS) + " |"
        lines += [head, "|---" * (1 + len(worlds) * len(CHECKS)) + "|"]
        # one note per (row, reason): the worlds (and, for failures, checks) it holds for
        notes: dict[tuple, list[str]] = {}
        table_rows = []
        for row in rows_order:
            if not any(cell_key(m, row, w, c) in cells for w in worlds for c in CHECKS):
                continue
            out = []
            for w in worlds:
                for c in CHECKS:
                    cell = cells.get(cell_key(m, row, w, c))
                    if cell is None:
                        out.append(" ")
                        continue
                    sym = SYMBOL.get(cell["status"], cell["status"])
                    if cell["status"] in ("not_legal", "fail", "not_run"):
                        key = (row, cell["status"], cell["detail"])
                        where = notes.setdefault(key, [])
                        tag = f"w{w}" if cell["status"] == "not_legal" else f"w{w} {c}"
                        if tag not in where:
                            where.append(tag)
                        if cell["status"] == "fail":
                            failing.append(f"{m} | {row} | w{w} | {c}: {cell['detail']}")
                        sym += f" [{list(notes).index(key) + 1}]"
                    out.append(sym)
            table_rows.append(f"| {row} | " + " | ".join(out) + " |")
        lines += table_rows
        if notes:
            lines += ["", "Notes:", ""]
            for i, ((row, status, detail), where) in enumerate(notes.items(), 1):
                what = {"not_legal": "not legal", "fail": "FAIL", "not_run": "not run"}[status]
                lines.append(f"{i}. {row} ({', '.join(where)}), {what}: {detail}")
        planned = {}
        for k, c in cells.items():
            if k.startswith(m + "|") and c.get("note"):
                _, row, w, _ = k.split("|")
                planned.setdefault(f"{w} {row}", c["note"])
        if planned:
            lines += ["", "<details><summary>what each plan pinned</summary>", ""]
            lines += [f"* {k}: {v}" for k, v in planned.items()]
            lines += ["", "</details>"]
    lines += ["", "## Failing cells", ""]
    lines += [f"* {f}" for f in failing] or ["none"]
    return "\n".join(lines) + "\n"


def write_report(cache: dict[str, Any], path: Path = REPORT) -> None:
    from autopar.io import atomic_write_text
    atomic_write_text(path, render(cache))


# ---------------------------------------------------------------------------------------------
# the orchestrator
# ---------------------------------------------------------------------------------------------
def _driver_main(args) -> int:
    """``--_driver MODEL WORLD``: plan and check the given rows, one JSON line per cell."""
    import torch
    torch.set_num_threads(1)
    os.environ.setdefault("AUTOPAR_SPEED_HISTORY", "off")
    d = Driver(args.models[0], int(args.worlds[0]), Path(args.work), float(args.cell_timeout))
    with open(args.results, "a") as out:
        for row in args.rows:
            for check in args.checks:
                res = d.check(row, check)
                out.write(json.dumps({"key": cell_key(d.model, row, d.world, check), **res}) + "\n")
                out.flush()
                print(f"{cell_key(d.model, row, d.world, check)}: {res['status']} {res.get('detail', '')[:160]} "
                      f"({res['seconds']:.1f} s)", flush=True)
    return 0


def code_version() -> str:
    """The commit the cells ran on, '+ uncommitted autopar/' when the package differs from it
    (engineers share one checkout)."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "autopar")
    return rev + (" + uncommitted autopar/" if dirty else "")


def _csv(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--kinds", help="comma-separated rows: kinds, 'bn' (the three batch-norm rows), "
                                    "'tournament' (both tournament rows), or row names")
    ap.add_argument("--worlds", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--checks", help=f"comma-separated, of: {', '.join(CHECKS)}")
    ap.add_argument("--quick", action="store_true", help="the CI slice: " + "; ".join(
        f"{m} {'/'.join(k)}" for m, k in QUICK.items()) + " at world 2")
    ap.add_argument("--resume", action="store_true", help="run only cells missing from the cache or failed")
    ap.add_argument("--cache", default=str(CACHE))
    ap.add_argument("--report", default=str(REPORT))
    ap.add_argument("--work", default=str(WORK), help="plans, runs and checkpoints (not committed)")
    ap.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT_S, help="seconds per check")
    ap.add_argument("--job-timeout", type=float, default=JOB_TIMEOUT_S, help="seconds per (model, world) driver")
    ap.add_argument("--_driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("AUTOPAR_SPEED_HISTORY", "off")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("AUTOPAR_CACHE_DIR", str(work / "trace-cache"))
    if args._driver:
        args.models, args.worlds = _csv(args.models), _csv(args.worlds)
        args.rows = [r for r in args.rows.split(";") if r]
        args.checks = _csv(args.checks)
        return _driver_main(args)

    models = _csv(args.models) or (list(QUICK) if args.quick else list(MODELS))
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    worlds = [int(w) for w in (_csv(args.worlds) or (QUICK_WORLDS if args.quick else WORLDS))]
    checks = _csv(args.checks) or list(CHECKS)
    if any(c not in CHECKS for c in checks):
        ap.error(f"checks are {', '.join(CHECKS)}")
    wanted = _csv(args.kinds)
    every = all_rows()
    rows_of: dict[str, list[str]] = {}
    for m in models:
        if wanted:
            rows = []
            for w in wanted:
                rows += (list(BN_ROWS) if w == "bn" else list(TOURNAMENT_ROWS) if w == "tournament" else [w])
            bad = [r for r in rows if r not in every]
            if bad:
                ap.error(f"unknown rows {bad}; choose kinds {', '.join(kinds())}, bn, tournament or {every}")
        elif args.quick:
            rows = list(QUICK.get(m, ()))
        else:
            rows = list(every)
        rows_of[m] = rows

    cache_path = Path(args.cache)
    cache = read_cache(cache_path)
    code = code_version()
    cmd = "python benchmarks/conformance.py " + " ".join(sys.argv[1:] if argv is None else argv)
    cache.setdefault("commands", []).append({"when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                                             "command": cmd.strip(), "code": code})
    t_all = time.perf_counter()
    for m in models:
        for w in worlds:
            rows = [r for r in rows_of[m]
                    if not args.resume or any(cache["cells"].get(cell_key(m, r, w, c), {}).get("status") in RERUN
                                              for c in checks)]
            if not rows:
                continue
            results = work / f"results-{m}-w{w}-{os.getpid()}.jsonl"
            results.unlink(missing_ok=True)
            argv_d = [sys.executable, str(Path(__file__).resolve()), "--_driver", "--models", m, "--worlds", str(w),
                      "--rows", ";".join(rows), "--checks", ",".join(checks), "--results", str(results),
                      "--work", str(work), "--cell-timeout", str(args.cell_timeout)]
            print(f"== {m} at world {w}: {len(rows)} rows x {len(checks)} checks", flush=True)
            t0 = time.perf_counter()
            why = None
            try:
                p = subprocess.run(argv_d, timeout=args.job_timeout, stdout=None, stderr=subprocess.PIPE, text=True)
                if p.returncode != 0:
                    why = f"the driver exited with code {p.returncode}: " + first_line(
                        (p.stderr.strip().splitlines() or [""])[-1])
            except subprocess.TimeoutExpired:
                why = f"the driver ran past its time-out of {args.job_timeout:.0f} s"
            got = {}
            if results.is_file():
                for line in results.read_text().splitlines():
                    try:
                        d = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    got[d.pop("key")] = d
                results.unlink()
            stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            for r in rows:
                for c in checks:
                    k = cell_key(m, r, w, c)
                    if k in got:
                        cache["cells"][k] = {**got[k], "when": stamp, "code": code}
                    elif not args.resume or cache["cells"].get(k, {}).get("status") in RERUN:
                        cache["cells"][k] = {"status": "not_run", "detail": f"no result: {why or 'the driver stopped'}",
                                             "when": stamp}
            write_cache(cache_path, cache)
            write_report(cache, Path(args.report))
            print(f"   {m} w{w}: {time.perf_counter() - t0:.0f} s", flush=True)
    write_cache(cache_path, cache)
    write_report(cache, Path(args.report))
    n = {s: sum(1 for c in cache["cells"].values() if c["status"] == s) for s in STATUSES}
    print(f"{len(cache['cells'])} cells: {n['pass']} pass, {n['not_legal']} not legal, {n['fail']} fail, "
          f"{n['n/a']} n/a, {n['not_run']} not run ({time.perf_counter() - t_all:.0f} s); {args.report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
