"""The planning speed-ups change no answer: equal layers priced once give the prices of each
layer priced alone; edge classes and separable edges in the ILP give brute force's optimum;
the shape- and cache-aware kernel models fit what they should and price through the profile."""

import random

import numpy as np
import pytest

from autopar.cost.table import _price_loss_move, build_cost_table, layer_options, layer_signature
from autopar.decomp.base import CostContext
from autopar.solve.brute import brute_force
from autopar.solve.ilp import build_model, solve

from test_solver import random_table


def test_equal_layers_priced_once_match_each_layer_priced_alone(root, profile):
    from autopar.modelfile import load_model_file
    from autopar.trace.cache import trace_cached
    graph, _ = trace_cached(load_model_file(root / "strategies/examples/resnet2d.py"), 8)
    ctx = CostContext(profile=profile, world=4, ranks_per_node=4, batch_size=8)
    table = build_cost_table(graph, ctx)
    sigs = [layer_signature(l) for l in graph.layers]
    assert len(set(sigs)) < len(sigs)            # the example has repeated blocks
    # each layer priced alone, then the whole-graph terms the table adds after pricing (the
    # output's move into the loss layout, in the producing layer's choices)
    alone_opts = _price_loss_move(graph, ctx, [layer_options(lay, ctx) for lay in graph.layers])
    for lay, alone, o in zip(graph.layers, alone_opts, table.layers):
        assert [str(d) for d in alone.choices] == [str(d) for d in o.choices]
        assert alone.costs == o.costs
        assert alone.illegal == o.illegal         # reasons name the layer's own module
    out_layer = graph.producer()[graph.output]
    assert alone_opts[out_layer].costs != layer_options(graph.layers[out_layer], ctx).costs, \
        "the example's output layer has a choice whose output must move into the loss layout"


@pytest.mark.parametrize("seed", range(10))
def test_edge_classes_and_separable_edges_keep_the_optimum(seed):
    """Edges whose rows repeat (choices with one output layout) and separable edges."""
    rng = random.Random(100 + seed)
    table = random_table(rng.randint(3, 6), 4, rng, dag=seed % 2 == 0)
    for e in table.edges:
        nu, nv = len(e.fwd_s), len(e.fwd_s[0])
        if seed % 3 == 0:          # separable: r[i] + c[j]
            r, c = [rng.uniform(0, 1) for _ in range(nu)], [rng.uniform(0, 1) for _ in range(nv)]
            e.fwd_s = [[r[i] + c[j] for j in range(nv)] for i in range(nu)]
            e.bwd_s = [[2 * r[i] + c[j] for j in range(nv)] for i in range(nu)]
        else:                      # two layout classes per side
            ra, cb = [i % 2 for i in range(nu)], [j % 2 for j in range(nv)]
            m = [[rng.uniform(0, 1) for _ in range(2)] for _ in range(2)]
            e.fwd_s = [[m[ra[i]][cb[j]] for j in range(nv)] for i in range(nu)]
            e.bwd_s = [[0.5 * m[ra[i]][cb[j]] for j in range(nv)] for i in range(nu)]
    sol = solve(table)
    _, best = brute_force(table)
    assert sol.objective_s == pytest.approx(best, rel=1e-6)
    _, _, pairs = build_model(table)
    full = sum(len(e.fwd_s) * len(e.fwd_s[0]) for e in table.edges)
    assert pairs <= full and (seed % 3 != 0 or pairs == 0)


def test_hint_and_cutoff_keep_the_optimum():
    rng = random.Random(7)
    for _ in range(5):
        table = random_table(5, 3, rng, dag=True)
        choice, best = brute_force(table)
        hint = [str(o.choices[i]) for o, i in zip(table.layers, choice)]
        assert solve(table, hint=hint).objective_s == pytest.approx(best, rel=1e-6)


def test_conv_shape_and_cache_models_fit_and_price():
    from autopar.profile.fit import cache_features, fit_conv_shape, fit_kernel_cache
    from autopar.calibrate.kernels import sweep_configs
    from autopar.profile.features import conv_shape_features
    from fakes import synthetic_profile
    specs = sweep_configs("conv_fwd", 40, 5e8, 1 << 22)
    true = np.array([1e-5, 1e-10, 1e-10, 3e-9, 0, 1e-9, 0, 0, 0])
    t = [float(np.dot(true, conv_shape_features(s))) for s in specs]
    m = fit_conv_shape(specs, t)
    assert m["heldout_median_rel_err"] < 1e-3
    flops = [10.0 ** rng for rng in np.linspace(4, 8, 30)]
    nbytes = [4.0 * f for f in flops]
    tt = [float(np.dot([1e-6, 1e-11, 1e-10, 2e-10, 0], cache_features(f, b))) for f, b in zip(flops, nbytes)]
    c = fit_kernel_cache(flops, nbytes, tt)
    assert c["heldout_median_rel_err"] < 1e-3
    prof = synthetic_profile()
    flat = prof.kernel_time_s("conv_fwd", 1e8, 1e6, spec=specs[0])
    prof.kernels["conv_fwd"]["shape_model"] = m
    assert prof.kernel_time_s("conv_fwd", 1e8, 1e6, spec=specs[0]) == pytest.approx(t[0], rel=1e-3)
    assert prof.kernel_time_s("conv_fwd", 1e8, 1e6) == pytest.approx(flat)   # no spec: flat


def test_replanning_from_the_trace_cache_imports_no_torch(tmp_path, root):
    """A user changing a flag re-plans without importing torch (the model file is read, not
    run, when the trace cache has its graph)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, AUTOPAR_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(root))
    cmd = [sys.executable, "-m", "autopar", "plan", str(root / "strategies/examples/resnet2d.py"),
           "--world-size", "2", "-o", str(tmp_path / "plan")]
    first = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=root)  # traces
    assert "plan written to" in first.stdout      # a piped stdout is flushed before the quick exit
    # ``python -m autopar`` leaves through ``cli.run`` (exit handlers, then os._exit): the probe
    # reads sys.modules from an exit handler
    probe = ("import atexit, runpy, sys\n"
             "atexit.register(lambda: print('TORCH', 'torch' in sys.modules))\n"
             "sys.argv = " + repr(["autopar"] + cmd[3:]) + "\n"
             "runpy.run_module('autopar', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", probe], env=env, check=True, capture_output=True,
                         text=True, cwd=root)
    assert "TORCH False" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_cli_quick_exit_keeps_exit_codes_output_and_exit_handlers(tmp_path, root):
    """``cli.run`` (the console entry point and ``python -m autopar``) skips the interpreter's
    teardown but keeps what a user sees: main's exit code, every line of output (flushed),
    and the exit handlers (atexit)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=str(root))
    bad = subprocess.run([sys.executable, "-m", "autopar", "plan", str(root / "strategies/examples/resnet2d.py"),
                          "--world-size", "0"], env=env, capture_output=True, text=True, cwd=root)
    assert bad.returncode == 2 and "--world-size must be >= 1" in bad.stderr, bad.stderr
    probe = ("import atexit, sys\n"
             "from autopar import cli\n"
             "atexit.register(lambda: print('EXIT HANDLER RAN'))\n"
             "sys.argv = ['autopar', 'check', " + repr(str(tmp_path / "missing.json")) + "]\n"
             "print('before', end='')\n"
             "cli.run()\n"
             "print('NOT REACHED')\n")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=root)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout.startswith("before") and "EXIT HANDLER RAN" in out.stdout
    assert "NOT REACHED" not in out.stdout and "autopar:" in out.stderr


def test_deferred_model_file(tmp_path):
    from autopar.modelfile import load_model_file
    f = tmp_path / "m.py"
    f.write_text("import torch\nDEFAULT_BATCH_SIZE = 12\nPLANNING_UNITS = ['a.*']\nN = len('abc')\n"
                 "def build_model():\n    return torch.nn.Linear(2, 2)\n"
                 "def example_inputs(b):\n    return (torch.randn(b, 2),)\n")
    mf = load_model_file(f, lazy=True)
    assert mf.default_batch_size() == 12 and mf.planning_units() == ["a.*"] and not mf.has_loss
    assert type(mf.module).__name__ == "_DeferredModule"
    assert mf.module.N == 3                     # not a literal: the file is imported
    bad = tmp_path / "bad.py"
    bad.write_text("def build_model(:\n")
    with pytest.raises(Exception, match="does not import"):
        load_model_file(bad, lazy=True)


def test_batch_norm_group_check_shortcut_equals_the_block_by_block_rule():
    """``decomp.bn.check_groups`` answers equal blocks of whole groups without walking the
    blocks (at 1024 ranks it was a tenth of pricing): the same answer, message included, as
    checking every block's start and extent."""
    from autopar.decomp.bn import check_groups
    from autopar.decomp.sharding import block_extent, block_start

    def block_by_block(n, parts, group):
        for c in range(parts):
            a, e = block_start(n, parts, c), block_extent(n, parts, c)
            if a % group or e % group:
                return (f"--bn-group {group} does not divide the {e} samples a rank holds "
                        f"({n} samples in {parts} blocks)")
        return None
    cases = [(n, p, g) for n in range(0, 50) for p in range(1, 34) for g in range(1, 10)]
    cases += [(2048, 1024, 2), (2048, 1024, 4), (2048, 512, 4), (2048, 1024, 1), (2000, 1024, 2)]
    for n, p, g in cases:
        assert check_groups(n, p, g) == block_by_block(n, p, g), (n, p, g)
