"""Re-make every shipped plan (strategies/plans/*/plan.json) in process from the options it was
made with, and compare with the file: the choice per layer, the predicted step time and the
predicted memory per rank (to 1e-6 relative). Writes ``reports/core_comparison.md``.

The options are the plan's recorded ``options`` (plans made since they are recorded), else
read from the plan itself (world, batch, profile, cluster shape, memory limit, candidate cap,
batch-norm statistics, a shape file it names) plus the model environment scripts/regenerate.sh
gives it (``ENV`` below, mirrored by hand). ``--old-tree DIR`` also re-makes each plan with the
autopar at DIR (e.g. ``git archive REV | tar -x -C DIR``) in a child process on the same inputs,
so that a difference from the file can be told apart from a difference between the cores.

    python benchmarks/compare_core.py [--old-tree DIR] [--only NAME ...] [--out reports/core_comparison.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REL = 1e-6

#: the model environment scripts/regenerate.sh plans these shipped plans with (not in plan.json)
ENV = {
    "pyg_nnconv-w4-mem3MiB": {"AUTOPAR_GNN_GRAPHS": "2"},
    "gpt-w4-mem4MiB": {"AUTOPAR_GPT_EMBED": "128", "AUTOPAR_GPT_VOCAB": "512"},
    "cnn3d-256-w64-a100": {"AUTOPAR_CNN3D_SIZE": "256"},
    "meshtangle2d-1024-w16-a100": {"AUTOPAR_MESH_SIZE": "1024"},
}


def options_json(plan: dict, plan_path: Path) -> dict:
    """The PlanOptions (as JSON) plan ``plan`` was made with: recorded, or read from the plan."""
    if plan.get("options"):
        return dict(plan["options"], write=False, out_dir=None)
    mesh, solver, bn = plan["mesh"], plan["solver"], plan.get("batch_norm") or {}
    out = {"world_size": int(plan["world_size"]), "batch_size": int(plan["model"]["batch_size"]),
           "calibration": plan["calibration"]["path"], "memory_limit_bytes": solver.get("memory_limit_bytes"),
           "ranks_per_node": int(mesh["ranks_per_node"]), "nodes": int(mesh["nodes"]),
           "max_candidates": int(solver.get("max_candidates_per_layer") or 8),
           "batch_norm": bn.get("mode", "global"), "write": False}
    if bn.get("mode") == "local" and bn.get("group"):
        out["bn_group"] = int(bn["group"])
    shapes = (plan["calibration"].get("shapes") or {}).get("path")
    if shapes:
        out["shapes"] = shapes
    return out


def priced_with(plan: dict) -> str:
    """The exact shapes beyond the profile a plan file was priced with: a shape file it names
    (``calibration.shapes``), or, for plans made before planning stopped measuring, the
    machine-local shape cache it read (``shapes_on_demand``, not in the repository)."""
    cal = plan["calibration"]
    if cal.get("shapes"):
        return f"shape file {cal['shapes']['path']} ({cal['shapes']['entries']})"
    sod = cal.get("shapes_on_demand") or {}
    if sod.get("cached") or sod.get("measured"):
        return f"profile + {sod.get('cached', 0)} cached shapes (machine-local cache)"
    return "profile alone"


def model_path(plan: dict, plan_path: Path) -> Path:
    p = Path(plan["model"]["path"])
    return p if p.is_absolute() else (plan_path.parent / p).resolve()


def remake(names: list[str]) -> dict[str, dict]:
    """name -> {choices, step_time_s, memory_per_rank_bytes} re-made by the autopar importable here."""
    from autopar.artifacts import PlanOptions
    from autopar.modelfile import model_env
    try:
        from autopar.planner import make_plan
    except ImportError:                       # an autopar from before the planner package
        from autopar.pipeline import make_plan
    out = {}
    for name in names:
        plan_path = ROOT / "strategies" / "plans" / name / "plan.json"
        plan = json.loads(plan_path.read_text())
        env = {**ENV.get(name, {}), **((plan.get("padding") or {}).get("env") or {})}
        with model_env(env):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opts = options_json(plan, plan_path)
                    known = {f.name for f in dataclasses.fields(PlanOptions)}
                    if "shapes" in opts and "shapes" not in known:
                        # an older core has no ``shapes`` option: it reads PROFILE-shapes.json beside
                        # the profile (its machine-local cache, the file a shipped plan names) when
                        # asked to measure shapes on demand; with every shape there, it measures none
                        opts = {**opts, "measure_shapes": True}
                    res = make_plan(model_path(plan, plan_path),
                                    PlanOptions(**{k: v for k, v in opts.items() if k in known}))
                p = res.plan
                out[name] = {"choices": [d.choice for d in p.layers], "step_time_s": p.predicted.step_time_s,
                             "memory_per_rank_bytes": p.predicted.memory_per_rank_bytes}
            except Exception as e:  # noqa: BLE001 - reported per plan
                out[name] = {"error": f"{e.__class__.__name__}: {e}"}
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def compare(ref: dict, got: dict) -> tuple[bool, str]:
    if "error" in got:
        return False, got["error"]
    same = ref["choices"] == got["choices"]
    dt, dm = _rel(ref["step_time_s"], got["step_time_s"]), _rel(ref["memory_per_rank_bytes"], got["memory_per_rank_bytes"])
    ok = same and dt <= REL and dm <= REL
    why = [] if same else [f"{sum(a != b for a, b in zip(ref['choices'], got['choices']))} layer choice(s) differ"]
    if dt > REL:
        why.append(f"step {dt:.2e} rel")
    if dm > REL:
        why.append(f"memory {dm:.2e} rel")
    return ok, "; ".join(why)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-tree", help="an autopar source tree to re-make the plans with too (child process)")
    ap.add_argument("--old-label", help="what the old tree is (e.g. the git revision it was archived from)")
    ap.add_argument("--rev", help="the revision this tree is, when it is not a git checkout (an archive)")
    ap.add_argument("--only", nargs="*", help="plan folder names (default: every shipped plan)")
    ap.add_argument("--out", default=str(ROOT / "reports" / "core_comparison.md"))
    ap.add_argument("--dump", help=argparse.SUPPRESS)      # child mode: write the re-made figures as JSON
    a = ap.parse_args()
    names = a.only or sorted(p.parent.name for p in (ROOT / "strategies" / "plans").glob("*/plan.json"))
    os.environ.setdefault("AUTOPAR_SPEED_HISTORY", "off")
    if a.dump:
        Path(a.dump).write_text(json.dumps(remake(names)))
        return 0
    new = remake(names)
    old = None
    if a.old_tree:
        dump = Path(a.out).with_suffix(".old.json")
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dump", str(dump), "--only", *names],
                       cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(Path(a.old_tree).resolve())})
        old = json.loads(dump.read_text())
        dump.unlink()
    rev = a.rev or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                  text=True).stdout.strip()
    dirty = "" if a.rev else subprocess.run(["git", "status", "--porcelain", "--", "autopar"], cwd=ROOT,
                                            capture_output=True, text=True).stdout.strip()
    lines = ["# Shipped plans re-made by the current core", "",
             f"`python benchmarks/compare_core.py{' --old-tree OLD' if a.old_tree else ''}` at "
             f"{rev}{'+dirty' if dirty else ''}: every shipped plan re-planned in process from the options "
             f"it was made with (`benchmarks/compare_core.py`, `options_json`), compared with the file: "
             f"the choice of every layer, the predicted step time and memory per rank, to {REL:g} relative.", ""]
    hdr = "| plan | layers | shapes the file was priced with | file step ms | re-made step ms | vs file |"
    sep = "|---|---:|---|---:|---:|---|"
    if old is not None:
        hdr += " old core step ms | new vs old core |"
        sep += "---:|---|"
    lines += [hdr, sep]
    n_file = n_core = 0
    for name in names:
        plan = json.loads((ROOT / "strategies" / "plans" / name / "plan.json").read_text())
        ref = {"choices": [d["choice"] for d in plan["layers"]], "step_time_s": plan["predicted"]["step_time_s"],
               "memory_per_rank_bytes": plan["predicted"]["memory_per_rank_bytes"]}
        ok, why = compare(ref, new[name])
        n_file += ok
        step = f"{new[name]['step_time_s'] * 1e3:.4f}" if "error" not in new[name] else "-"
        row = (f"| {name} | {len(ref['choices'])} | {priced_with(plan)} | {ref['step_time_s'] * 1e3:.4f} | {step} | "
               f"{'same' if ok else why} |")
        if old is not None:
            ok2, why2 = compare(old[name], new[name]) if "error" not in old[name] else (False, old[name]["error"])
            n_core += ok2
            ostep = f"{old[name]['step_time_s'] * 1e3:.4f}" if "error" not in old[name] else "-"
            row += f" {ostep} | {'same' if ok2 else why2} |"
        lines.append(row)
    lines += ["", f"{n_file} of {len(names)} plans re-made as the file says."]
    if old is not None:
        lines.append(f"{n_core} of {len(names)} plans re-made alike by the old core "
                     f"({a.old_label or a.old_tree}) and the new, on the same inputs.")
    cached = [n for n in names if "machine-local" in priced_with(
        json.loads((ROOT / "strategies" / "plans" / n / "plan.json").read_text()))]
    if n_file < len(names) and cached:
        lines += ["", "A file priced with the machine-local shape cache (`calibration/*-shapes.json`, ignored by "
                  "git, written by the on-demand measurement that planning ran before it stopped starting "
                  "processes) cannot be re-made from the repository: the cache's shapes are not in it. Planning "
                  "now reads the profile alone unless a shape file is named (`--shapes`, `--measure-shapes`), "
                  "and records the file it read in plan.json; `scripts/regenerate.sh` re-makes such plans from "
                  "the repository."]
    text = "\n".join(lines) + "\n"
    from autopar.io import atomic_write_text
    atomic_write_text(Path(a.out), text)
    print(text)
    return 0 if n_file == len(names) and (old is None or n_core == len(names)) else 1


if __name__ == "__main__":
    sys.exit(main())
