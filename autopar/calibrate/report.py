"""The calibration report: how good is each fit, in a table and in pictures.

``write_report(profile, out_dir)`` writes ``out_dir/report.md`` and the plots of
``calibrate.plots`` beside it: provenance, every kernel fit's held-out error (median and max
relative error on the sizes left out of the fit), every collective fit's per level and group
size, the in-situ latency of blocking collectives per (group size, ranks running), the compute
slowdown, how many exact shapes were measured, and any factors learned from runs. Numbers are
read from the profile, never recomputed or rounded into it.
"""

from __future__ import annotations

from pathlib import Path

from ..io import atomic_write_text
from ..profile.profile import COLLECTIVES, OP_CLASSES, Profile
from .plots import plot_fits


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * float(x):.0f}%"


def report_markdown(profile: Profile, profile_name: str, plots: list[Path]) -> str:
    pv = profile.provenance
    lines = [f"# Calibration report: `{profile_name}`", "",
             f"- kind: **{pv.get('kind', '?')}**; date {pv.get('date', '?')}; "
             f"command `{pv.get('command', '?')}`",
             f"- machine: {profile.fingerprint.get('cpu_model') or '?'}"
             f"{' / ' + profile.fingerprint['gpu_model'] if profile.fingerprint.get('gpu_model') else ''}, "
             f"torch {profile.fingerprint.get('torch_version', '?')}, backend {profile.fingerprint.get('backend', '?')}",
             f"- topology: {profile.topology.get('nodes')} node(s) x {profile.topology.get('ranks_per_node')} ranks",
             f"- notes: {pv.get('notes', '')}",
             *([f"- load average (1 / 5 / 15 min) before: {' / '.join(map(str, pv['loadavg_before']))}, after: "
                f"{' / '.join(map(str, pv.get('loadavg_after') or []))} (other work on the machine skews every timing)"]
               if pv.get("loadavg_before") else []), "",
             "Held-out error: each fit is made on 70% of the measured sizes and judged on the other "
             "30% (median and maximum relative error), then refitted on all of them.", "",
             "## Kernels", "", "| op class | t0 | GFLOP/s | GB/s | held-out median | held-out max | samples | measured |",
             "|---|---|---|---|---|---|---|---|"]
    for op in OP_CLASSES:
        k = profile.kernels.get(op)
        if not k:
            continue
        fl = k.get("flops_per_s")
        by = k.get("bytes_per_s")
        lines.append(f"| {op} | {k['t0_s'] * 1e6:.1f} us | {'-' if not fl else f'{fl / 1e9:.3g}'} | "
                     f"{'-' if not by else f'{by / 1e9:.3g}'} | {_pct(k.get('heldout_median_rel_err'))} | "
                     f"{_pct(k.get('heldout_max_rel_err'))} | {k.get('n_samples', '-')} | {k.get('measured')} |")
    formed = [op for op in OP_CLASSES if (profile.kernels.get(op) or {}).get("by_form")]
    if formed:
        lines += ["", "Per form (the GNN kernels: NNConv's per-edge products `edge_bmm` in the matmul "
                  "class; gather / index_select and scatter_add / index_add on PCQM4M-like sizes in "
                  "gather_scatter): for each form, 30 % of its sizes left out, the class's model in "
                  "use (intensity, cache-aware or flat, as below) fitted on every other size, judged on "
                  "the left-out ones:", "",
                  "| op class | form | held-out median | held-out max | held-out sizes | sizes |",
                  "|---|---|---|---|---|---|"]
        for op in formed:
            for form, e in sorted(profile.kernels[op]["by_form"].items()):
                lines.append(f"| {op} | {form} | {_pct(e.get('heldout_median_rel_err'))} | "
                             f"{_pct(e.get('heldout_max_rel_err'))} | {e.get('n_test', '-')} | {e.get('n', '-')} |")
    shaped = [op for op in OP_CLASSES if (profile.kernels.get(op) or {}).get("shape_model")]
    if shaped:
        lines += ["", "Shape-aware convolution model (``profile.features.conv_shape_features``: roofline plus "
                  "efficiency terms in channels, filters and image size, 1x1 apart; form ``conv_shape/3`` "
                  "adds ``profile.features.conv_layout_features``: channel counts oneDNN cannot block, strides, "
                  "tensors past the caches), which prices "
                  "convolutions whose exact shape was not measured; held-out error per op class "
                  "(70/30 split of the sweep and the exact shapes measured here), against the flat "
                  "roofline on the same split; kept only where it is the better of the two. Forms "
                  "``conv_shape/2`` and ``/3`` fit torch's native CPU path (``profile.features.conv_cpu_path``: one small "
                  "sample, 1x1 below 16 samples) apart when that generalises better; its own held-out "
                  "error and rows in the last column:", "",
                  "| op class | held-out median | held-out max | flat held-out median | samples | form | native path |",
                  "|---|---|---|---|---|---|---|"]
        for op in shaped:
            k = profile.kernels[op]
            sm = k["shape_model"]
            flat = sm.get("flat_heldout_median_rel_err", k.get("heldout_median_rel_err"))
            nat = sm.get("native")
            lines.append(f"| {op} | {_pct(sm.get('heldout_median_rel_err'))} | "
                         f"{_pct(sm.get('heldout_max_rel_err'))} | {_pct(flat)} | "
                         f"{sm.get('n_samples', '-')} | {sm.get('form', '-')} | "
                         + (f"{_pct(nat.get('heldout_median_rel_err'))} of {nat.get('n_samples', '-')} |"
                            if nat else "one model |"))
    cached = [op for op in OP_CLASSES if (profile.kernels.get(op) or {}).get("cache_model")]
    if cached:
        lines += ["", "Cache-aware model (``fit.cache_features``: the per-byte price rises past 1 MiB "
                  "and 8 MiB of operands), used where its held-out error is lower than the flat fit's:", "",
                  "| op class | held-out median | held-out max | flat held-out median | samples |",
                  "|---|---|---|---|---|"]
        for op in cached:
            k = profile.kernels[op]
            cm = k["cache_model"]
            lines.append(f"| {op} | {_pct(cm.get('heldout_median_rel_err'))} | "
                         f"{_pct(cm.get('heldout_max_rel_err'))} | {_pct(k.get('heldout_median_rel_err'))} | "
                         f"{cm.get('n_samples', '-')} |")
    intense = [op for op in OP_CLASSES if (profile.kernels.get(op) or {}).get("intensity_model")]
    if intense:
        lines += ["", "Arithmetic-intensity model (``fit.intensity_features``: kernels moving at least the "
                  "threshold bytes per FLOP, e.g. gather / scatter_add with an index per element and NNConv's "
                  "per-edge products, get rates of their own), used where its held-out error is lower than "
                  "the model otherwise used:", "",
                  "| op class | threshold bytes/FLOP | mean of per-form held-out medians | the same, model otherwise used | "
                  "held-out median (70/30) | held-out max (70/30) | samples |", "|---|---|---|---|---|---|---|"]
        for op in intense:
            im = profile.kernels[op]["intensity_model"]
            lines.append(f"| {op} | {im['threshold_bytes_per_flop']:g} | "
                         f"{_pct(im.get('stratified_heldout_median_rel_err'))} | "
                         f"{_pct(im.get('previous_stratified_heldout_median_rel_err'))} | "
                         f"{_pct(im.get('heldout_median_rel_err'))} | "
                         f"{_pct(im.get('heldout_max_rel_err'))} | {im.get('n_samples', '-')} |")
    if "runtime_op" in profile.kernels:
        ro = profile.kernels["runtime_op"]
        lines += ["", f"Runtime per-op cost beyond the kernels: "
                  f"{ro['t0_s'] * 1e6:.1f} us per op."]
        if ro.get("by_family"):
            nat = ro.get("native_by_family") or {}
            lines += ["", "| op family | traced (DistModel.op), us per op | native module, us per op |",
                      "|---|---|---|"]
            lines += [f"| {f} | {v * 1e6:.1f} | {nat[f] * 1e6:.1f} |" if f in nat else f"| {f} | {v * 1e6:.1f} | - |"
                      for f, v in ro["by_family"].items()]
    red = profile.samples.get("grad_reducer")
    if red:
        lines += ["", f"torch DDP's reducer beyond its all-reduces (one rank; charged to every choice that "
                  f"all-reduces gradients, `cost.table.price_grad_reducer`): {red['fixed_s'] * 1e6:.0f} us a step + "
                  f"{red['per_tensor_s'] * 1e6:.2f} us per parameter tensor + {red['per_byte_s'] * 1e12:.0f} us per MB of gradients, fitted to "
                  + ", ".join(f"{r['tensors']} x {r['elements']} floats {r['reducer_s'] * 1e6:.0f} us"
                              for r in red.get("rows", [])) + "."]
    opt = profile.kernels.get("optimizer_step")
    if opt:
        lines += ["", f"Optimizer step (SGD, momentum; {opt.get('cache', 'timed hot')}): "
                  f"{opt.get('fixed_s', 0.0) * 1e6:.0f} us a step + {opt['t0_s'] * 1e6:.1f} us per parameter tensor + "
                  f"{opt['s_per_byte'] * 1e12:.2f} ps per parameter byte (held-out median "
                  f"{_pct(opt.get('heldout_median_rel_err'))}, max {_pct(opt.get('heldout_max_rel_err'))})."]
    kappa = profile.samples.get("straggler_kappa") or {}
    sigma = profile.samples.get("straggler_sigma") or {}
    if kappa:
        lines += ["", "Straggler wait at a synchronisation after t seconds of compute since the last one: "
                  "min(kappa t, sigma sqrt(t)) (`profile.straggler.Straggler`): " +
                  ", ".join(f"{w} ranks kappa {float(k):.3f}" + (f", sigma {float(sigma[w]):.4f} s^0.5" if w in sigma else "")
                            for w, k in sorted(kappa.items(), key=lambda kv: int(kv[0]))) +
                  ("" if sigma else " (no sigma: the profile predates it, all compute is charged 1 + kappa)") + "."]
    lines += ["", "## Collectives", "",
              "Time = a(p) alpha + b(p) bytes beta (terms per kind in `profile.schema`).", "",
              "| kind | level | p | alpha | beta (GB/s) | held-out median | held-out max | measured | source |",
              "|---|---|---|---|---|---|---|---|---|"]
    for kind in COLLECTIVES:
        levels = profile.collectives.get(kind, {})
        for level, sizes in sorted(levels.items(), key=lambda kv: kv[0] != "intra"):
            for p, e in sorted(sizes.items(), key=lambda kv: int(kv[0])):
                beta = e.get("beta_s_per_byte") or 0.0
                lines.append(f"| {kind} | {level} | {p} | {e['alpha_s'] * 1e6:.1f} us | "
                             f"{'-' if beta <= 0 else f'{1 / beta / 1e9:.3g}'} | "
                             f"{_pct(e.get('heldout_median_rel_err'))} | {_pct(e.get('heldout_max_rel_err'))} | "
                             f"{e.get('measured')} | {e.get('source', '')} |")
    by_world = profile.samples.get("insitu_latency_by_world_s") or {}
    if by_world:
        ps = sorted({int(p) for row in by_world.values() for p in row})
        lines += ["", "## Blocking collectives in a step (in situ)", "",
                  "Latency of a blocking collective among p ranks between kernels of a step, with w "
                  "ranks running on the node (`calibrate.insitu`).", "",
                  "| ranks running w | " + " | ".join(f"p = {p}" for p in ps) + " |",
                  "|---|" + "---|" * len(ps)]
        for w, row in sorted(by_world.items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {w} | " + " | ".join(f"{row[str(p)] * 1e3:.2f} ms" if str(p) in row else "-"
                                                 for p in ps) + " |")
    for kind, table in sorted((profile.samples.get("insitu_latency_by_kind_s") or {}).items()):
        ps = sorted({int(p) for row in table.values() for p in row})
        lines += ["", f"In situ, {kind} (the runtime's {'redistributions between placements' if kind == 'all_to_all' else 'halo exchanges'}):", "",
                  "| ranks running w | " + " | ".join(f"p = {p}" for p in ps) + " |", "|---|" + "---|" * len(ps)]
        for w, row in sorted(table.items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {w} | " + " | ".join(f"{row[str(p)] * 1e3:.2f} ms" if str(p) in row else "-"
                                                 for p in ps) + " |")
    if profile.compute_slowdown:
        lines += ["", "## Compute slowdown with k ranks on a node", "",
                  "| k | " + " | ".join(sorted(profile.compute_slowdown, key=int)) + " |",
                  "|---|" + "---|" * len(profile.compute_slowdown),
                  "| factor | " + " | ".join(f"{profile.compute_slowdown[k]:.2f}"
                                              for k in sorted(profile.compute_slowdown, key=int)) + " |"]
        read = (profile.samples or {}).get("compute_slowdown_measured") or {}
        if read and any(read.get(k) != v for k, v in profile.compute_slowdown.items()):
            lines += ["| measured | " + " | ".join(f"{read[k]:.2f}" if k in read else "-"
                                                  for k in sorted(profile.compute_slowdown, key=int)) + " |",
                      "", f"Beyond one rank per core ({profile.samples.get('cores')} cores) the factor priced is "
                      "time sharing of the cores, the reading at one rank per core times k / cores "
                      "(`calibrate.run.time_shared_slowdown`); the measured row is what the windows read."]
    sp = (profile.samples or {}).get("speed_probe") or {}
    if sp.get("nominal_s"):
        rd = sp.get("readings_s") or []
        lines += ["", "## Machine speed while kernels were measured", "",
                  f"{len(rd)} readings of a fixed probe (`calibrate.speed`) between the kernel measurements: "
                  f"{min(rd) * 1e3:.2f}-{max(rd) * 1e3:.2f} ms (spread {100 * (sp.get('spread') or 0):.0f} %), "
                  f"nominal (median) {sp['nominal_s'] * 1e3:.2f} ms. Every kernel time of the profile is stated at "
                  "the nominal speed (the mean reading within a few seconds of each measurement against the "
                  "nominal); the raw times stay in the samples."]
    lines += ["", "## Exact shapes", "", f"{len(profile.exact)} local shapes measured exactly "
              "(forward, backward-data, backward-filter); the cost model prefers them to the fits."]
    ref = pv.get("refined")
    if ref:
        c = ref.get("corrections", {})
        cv = ref.get("cross_validation", {})
        lines += ["", "## Learned from runs", "",
                  f"Refined from {len(ref.get('runs', []))} run(s); kinds applied: {ref.get('kinds') or 'none'} "
                  f"(leave-one-run-out median error {_pct(cv.get('uncorrected_loo_median_abs_error'))} "
                  f"uncorrected, {_pct(cv.get('chosen_loo_median_abs_error'))} with them); drift per ranks on a node {c.get('drift_by_world') or 'none'}, "
                  f"blocking collectives x{c.get('blocking_comm_scale', 1):.3g}, gradient all-reduce "
                  f"x{c.get('grad_sync_scale', 1):.3g}, {c.get('exact_entries', 0)} exact entries rescaled."]
    if plots:
        lines += ["", "## Measured against fitted", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(profile: Profile, out_dir, profile_name: str = "profile") -> Path:
    """Write ``report.md`` and the fit plots into ``out_dir``; return the report's path."""
    out_dir = Path(out_dir)
    plots = plot_fits(profile, out_dir)
    path = out_dir / "report.md"
    atomic_write_text(path, report_markdown(profile, profile_name, plots))
    return path


def default_report_dir(profile_path) -> Path:
    p = Path(profile_path)
    return p.with_name(p.stem + "-report")
