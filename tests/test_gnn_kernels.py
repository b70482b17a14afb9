"""Calibration of the GNN kernels: NNConv's per-edge products (``edge_bmm``, matmul class) and
gather / index_select / scatter_add / index_add on PCQM4M-like sizes (gather_scatter class):
the sweep reaches realistic sizes, the calibration counts FLOPs and bytes exactly as the op
families price them, small sizes run and fit, and the report shows each form's held-out error."""

from __future__ import annotations

import textwrap

import pytest

from autopar.calibrate import kernels
from autopar.profile import fit
from autopar.calibrate.run import FULL, QUICK


def test_sweeps_reach_pcqm4m_like_sizes_in_every_form():
    mm = kernels.sweep_configs("matmul", FULL.kernel_configs, FULL.kernel_max_flops, FULL.kernel_max_numel)
    edge = [c for c in mm if c.get("kind") == "edge_bmm"]
    assert len(edge) == len(mm) // 3
    assert all(100 <= c["e"] <= 100_000 and 16 <= c["fin"] <= 100 and 16 <= c["fout"] <= 100 for c in edge)
    assert max(c["e"] for c in edge) > 2000
    gs = kernels.sweep_configs("gather_scatter", FULL.kernel_configs, FULL.kernel_max_flops, FULL.kernel_max_numel)
    gnn = [c for c in gs if 16 <= c["width"] <= 128 and c["m"] >= 100 and c["rows"] < c["m"]]
    assert {c["kind"] for c in gnn} == set(kernels.GATHER_SCATTER_FORMS)
    assert max(c["m"] for c in gnn) > 10_000
    # the quick sweep keeps them too (what `autopar calibrate --quick` measures)
    q = kernels.sweep_configs("matmul", QUICK.kernel_configs, QUICK.kernel_max_flops, QUICK.kernel_max_numel)
    assert sum(c.get("kind") == "edge_bmm" for c in q) == QUICK.kernel_configs // 3


MODEL = """
import torch
from torch import nn

E, N, F, FO = 37, 20, 24, 12

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x, w, idx, idx_full):
        h = self.lin(x)                                   # [N, F]
        a = h.index_select(0, idx)                        # [E, F]
        b = torch.gather(h, 0, idx_full)                  # [E, F]
        msg = torch.bmm((a + b).unsqueeze(1), w).squeeze(1)  # [E, FO]
        z = torch.zeros(N, FO, device=x.device).index_add(0, idx, msg)
        z2 = torch.zeros(N, F, device=x.device).scatter_add(0, idx_full, a)
        return z.sum() + z2.sum()

def build_model():
    return M()

def example_inputs(batch_size):
    idx = torch.randint(0, N, (E,))
    return (torch.randn(N, F), torch.randn(E, F, FO), idx, idx.unsqueeze(1).expand(E, F).contiguous())
"""


def test_calibration_counts_as_the_op_families_price(tmp_path):
    from autopar.modelfile import load_model_file
    from autopar.ops import family_of
    from autopar.trace.tracer import trace_model
    p = tmp_path / "gnnk.py"
    p.write_text(textwrap.dedent(MODEL))
    g = trace_model(load_model_file(p), 1)
    ops = {op.target.split(".")[1]: op for lay in g.layers for op in lay.ops}
    E, N, F, FO = 37, 20, 24, 12

    def priced(name):
        op = ops[name]
        fam = family_of(op.kind)
        return fam.local_flops(op, op.in_shapes, op.out_shape), fam.local_bytes(op, op.in_shapes, op.out_shape)

    assert priced("bmm") == pytest.approx(kernels.edge_matmul_features(E, F, FO))
    assert priced("index_select") == pytest.approx(kernels.gather_scatter_features(E, F, False))
    assert priced("gather") == pytest.approx(kernels.gather_scatter_features(E, F, True))
    assert priced("index_add") == pytest.approx(kernels.gather_scatter_features(E, FO, False))
    assert priced("scatter_add") == pytest.approx(kernels.gather_scatter_features(E, F, True))


def test_small_sizes_run_fit_and_report_each_form(tmp_path):
    cfgs = [{"kind": "edge_bmm", "e": e, "fin": 16, "fout": 16} for e in (100, 200, 400)]
    cfgs += [{"m": m, "k": 32, "o": 32} for m in (16, 64, 256)]
    rows = kernels.benchmark_op_class("matmul", cfgs, repeats=3, warmup=1, budget_s=0.02)
    gs = [{"kind": k, "rows": 60, "width": 16, "m": m} for k in kernels.GATHER_SCATTER_FORMS for m in (100, 400)]
    rows_gs = kernels.benchmark_op_class("gather_scatter", gs, repeats=3, warmup=1, budget_s=0.02)
    assert all(r["median_s"] > 0 for r in rows + rows_gs)
    by = fit.heldout_by_form(rows + rows)    # 12 samples: a 70/30 split leaves each form some
    assert set(by) == {"edge_bmm", "gemm"} and sum(v["n"] for v in by.values()) == 12
    assert by["edge_bmm"]["n_test"] == by["gemm"]["n_test"] == 2      # 30 % of each form's 6
    assert by["edge_bmm"]["heldout_median_rel_err"] is not None
    by_gs = fit.heldout_by_form(rows_gs)
    assert set(by_gs) == set(kernels.GATHER_SCATTER_FORMS)

    from autopar.calibrate.report import report_markdown
    from fakes import synthetic_profile
    prof = synthetic_profile()
    prof.kernels["matmul"]["by_form"] = by
    md = report_markdown(prof, "fake", [])
    assert "| matmul | edge_bmm |" in md and "held-out median" in md


def test_intensity_model_prices_index_per_element_kernels_apart():
    """Synthetic samples: gather / scatter_add (16 bytes per element moved) run 5x slower per
    byte than index_select / index_add; the flat fit cannot hold both, the intensity model can,
    is kept, and is what the profile prices with."""
    from fakes import synthetic_profile
    rows = []
    for i, m in enumerate((100, 300, 1000, 3000, 10_000, 30_000, 60_000, 100_000)):
        for kind, full in kernels.GATHER_SCATTER_FORMS.items():
            fl, by = kernels.gather_scatter_features(m, 32 + i, full)
            rows.append({"config": {"kind": kind, "m": m, "width": 32 + i, "rows": m // 2}, "flops": fl, "bytes": by,
                         "median_s": 2e-6 + by * (5e-11 if full else 1e-11)})
    prof = synthetic_profile()
    flat = fit.fit_kernel([r["flops"] for r in rows], [r["bytes"] for r in rows], [r["median_s"] for r in rows])
    prof.kernels["gather_scatter"] = {**flat, "measured": True}
    prof.samples = {"kernels": {"gather_scatter": rows}}
    assert fit.add_intensity_models(prof) == ["gather_scatter"]
    k = prof.kernels["gather_scatter"]
    assert k["intensity_model"]["heldout_median_rel_err"] < 0.01 < flat["heldout_median_rel_err"]
    fl, by = kernels.gather_scatter_features(5000, 64, True)
    assert prof.kernel_time_s("gather_scatter", fl, by) == pytest.approx(2e-6 + by * 5e-11, rel=1e-3)
    fl, by = kernels.gather_scatter_features(5000, 64, False)
    assert prof.kernel_time_s("gather_scatter", fl, by) == pytest.approx(2e-6 + by * 1e-11, rel=1e-3)
    by_form = fit.heldout_by_form(rows, features=fit.model_features(k))
    assert all(v["heldout_median_rel_err"] < 0.01 for v in by_form.values())
    # a class whose samples hold one regime only gets no intensity model
    prof2 = synthetic_profile()
    prof2.samples = {"kernels": {"gather_scatter": [r for r in rows if not kernels.GATHER_SCATTER_FORMS[r["config"]["kind"]]]}}
    assert fit.add_intensity_models(prof2) == [] and "intensity_model" not in prof2.kernels["gather_scatter"]


def test_timed_kernels_keep_their_results_alive_as_a_step_keeps_activations(monkeypatch):
    """The sweep times every kernel with its last KEPT_RESULTS results alive (``_kept``), so a
    call writes fresh memory as in a training step, not the block the previous call freed."""
    import gc
    import weakref

    import torch

    made = []

    def fn():
        t = torch.empty(1000)
        made.append(weakref.ref(t))
        return t

    kept = kernels._kept(fn)
    for _ in range(kernels.KEPT_RESULTS + 3):
        kept()
    gc.collect()
    alive = [r() is not None for r in made]
    assert alive == [False] * 3 + [True] * kernels.KEPT_RESULTS
    # and the sweep times forward and backward through it
    wrapped = []
    real = kernels._kept
    monkeypatch.setattr(kernels, "_kept", lambda f: (wrapped.append(f), real(f))[1])
    rows = kernels.benchmark_op_class("matmul", [{"m": 64, "k": 64, "o": 64}], repeats=3, warmup=1)
    assert len(wrapped) == 2 and rows[0]["median_s"] > 0 and rows[0]["bwd_median_s"] > 0


def test_norm_and_pool_sweeps_time_the_backward_autograd_runs():
    """Batch norm and max pooling sweeps time their backward too (``kernels.BACKWARD_CLASSES``):
    positive, and for max pooling far below the twice-the-forward the cost model assumed
    before (it zeroes the input's gradient and scatters into it)."""
    from autopar.calibrate.kernels import BACKWARD_CLASSES, benchmark_op_class
    assert {"matmul", "norm", "pool"} <= set(BACKWARD_CLASSES)
    rows = benchmark_op_class("pool", [{"x": [8, 16, 64, 64], "k": 2, "stride": 2},
                                       {"x": [2, 4, 16, 16, 16], "k": 3, "stride": 1}], repeats=3, warmup=1)
    rows += benchmark_op_class("norm", [{"shape": [8, 16, 32, 32]}], repeats=3, warmup=1)
    assert all(r["bwd_median_s"] > 0 for r in rows)
    assert rows[0]["bwd_median_s"] < 2 * rows[0]["median_s"]


def test_elementwise_sweep_writes_a_ring_of_mapped_buffers_and_allocates_nothing_per_call():
    """The elementwise sweep's timed call writes the next of KEPT_RESULTS buffers made up
    front (``kernels._written_ring``): the right values, a different buffer than the last
    call's, and no tensor allocated by the call (an allocated result's page faults depended on
    glibc's state at that moment of the sweep, and made the fit bimodal)."""
    import torch

    for kind, ref in (("relu", lambda a, b: torch.relu(a)), ("add", lambda a, b: a + b)):
        fn, flops, nbytes = kernels._runner("elementwise", {"kind": kind, "numel": 4096}, "cpu")
        assert (flops, nbytes) == kernels.elementwise_features(4096, 2 if kind == "relu" else 3)
        outs = [fn() for _ in range(kernels.KEPT_RESULTS + 1)]
        ptrs = [o.data_ptr() for o in outs]
        assert len(set(ptrs)) == kernels.KEPT_RESULTS and ptrs[0] == ptrs[-1]
        g = torch.Generator().manual_seed(1)           # the operands _runner draws
        a, b = torch.randn(4096, generator=g), torch.randn(4096, generator=g)
        assert torch.equal(outs[-1], ref(a, b))
    # nothing allocated inside the call: the profiler sees no aten::empty in it
    from torch.profiler import ProfilerActivity, profile
    fn, _, _ = kernels._runner("elementwise", {"kind": "add", "numel": 4096}, "cpu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events()}
    assert "aten::add" in names and "aten::empty" not in names
