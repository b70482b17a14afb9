"""Plots of a profile's fits against its measurements (PNG, matplotlib Agg, log-log).

One figure per kernel op class (left: time against FLOPs, measured dots and the fitted model
at the same sizes; right: fitted against measured with the y = x line) and one per collective
kind (time against bytes, one colour per group size: measured medians as dots, the fitted
formula as a line). A datasheet profile has no samples: its plots show the model lines only.
"""

from __future__ import annotations

from pathlib import Path

from ..profile.profile import COLLECTIVES, OP_CLASSES, Profile


def plot_fits(profile: Profile, out_dir) -> list[Path]:
    """Write ``kernel_<op>.png`` and ``collective_<kind>.png`` to ``out_dir``; return paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    label = profile.provenance.get("kind", "?")
    ksamples = profile.samples.get("kernels", {})
    for op in OP_CLASSES:
        model = profile.kernels.get(op)
        rows = ksamples.get(op, [])
        if model is None or not rows:
            continue
        flops = np.array([r["flops"] for r in rows], float)
        nbytes = np.array([r["bytes"] for r in rows], float)
        meas = np.array([r["median_s"] for r in rows], float)
        pred = np.array([profile.kernel_time_s(op, f, b) for f, b in zip(flops, nbytes)])
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
        x = np.maximum(flops, 1.0)
        ax1.loglog(x, meas, "o", label="measured (median)")
        ax1.loglog(x, pred, "x", label="fitted model")
        ax1.set_xlabel("FLOPs")
        ax1.set_ylabel("time [s]")
        ax1.legend()
        err = model.get("heldout_median_rel_err")
        ax1.set_title(f"{op}: t0={model['t0_s']:.2g}s, "
                      f"held-out median err {'n/a' if err is None else f'{100 * err:.0f}%'}")
        lo, hi = min(meas.min(), pred.min()), max(meas.max(), pred.max())
        ax2.loglog([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
        ax2.loglog(meas, pred, "o")
        ax2.set_xlabel("measured [s]")
        ax2.set_ylabel("fitted [s]")
        ax2.legend()
        fig.suptitle(f"kernel {op} ({label} profile)")
        fig.tight_layout()
        path = out_dir / f"kernel_{op}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)

    csamples = {"intra": profile.samples.get("collectives", {}),
                "inter": profile.samples.get("collectives_inter", {})}  # multi-node profiles
    for kind in COLLECTIVES:
        levels = profile.collectives.get(kind)
        if not levels:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        n_line = np.logspace(1, 25, 80, base=2)
        for level, style in (("intra", "-"), ("inter", ":")):
            for j, (p, entry) in enumerate(sorted(levels.get(level, {}).items(), key=lambda kv: int(kv[0]))):
                if level == "inter" and not entry.get("measured", True):
                    continue  # a copy of intra: drawing it again would suggest a measurement
                colour = f"C{j % 10}"
                rows = csamples[level].get(kind, {}).get(p, [])
                if rows:
                    n_line = np.logspace(np.log2(max(rows[0]["nbytes"], 1)),
                                         np.log2(rows[-1]["nbytes"]), 60, base=2)
                    ax.loglog([r["nbytes"] for r in rows], [r["median_s"] for r in rows],
                              "o" if level == "intra" else "x",
                              color=colour, ms=4)
                t = [profile.collective_time_s(kind, int(p), n, level) for n in n_line]
                sim = " (SIMULATED: one host)" if entry.get("measured") == "simulated" else ""
                ax.loglog(n_line, t, style, color=colour, label=f"{level}, p={p}{sim}")
        ax.set_xlabel("bytes (profile convention)")
        ax.set_ylabel("time [s]")
        ax.set_title(f"{kind}: measured (dots) vs fitted ({label} profile)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"collective_{kind}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
