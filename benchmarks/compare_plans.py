"""Compare every shipped plan (strategies/plans/*/plan.json) with the same plan at a git
revision: choices per layer, predicted step time and memory. Used to show that a refactor of
the core leaves the planner's answers unchanged (re-plan first: scripts/regenerate.sh
--plans-only).

    python benchmarks/compare_plans.py --base REV [--out reports/benchmarks/replan_vs_REV.txt]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision holding the earlier plans")
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    rows = [f"shipped plans re-made at the working tree vs the same plans at {rev} (same profiles)",
            f"{'plan':<30} {'old ms':>9} {'new ms':>9} {'diff':>9}  {'choices':<9} {'old MiB':>8} {'new MiB':>8}"]
    same_all = True
    for new_path in sorted((ROOT / "strategies" / "plans").glob("*/plan.json")):
        rel = new_path.relative_to(ROOT).as_posix()
        old_txt = subprocess.run(["git", "show", f"{args.base}:{rel}"], cwd=ROOT, capture_output=True, text=True)
        if old_txt.returncode:
            rows.append(f"{new_path.parent.name:<30} (not at {rev})")
            continue
        old, new = json.loads(old_txt.stdout), json.loads(new_path.read_text())
        po, pn = old["predicted"]["step_time_s"], new["predicted"]["step_time_s"]
        same = [lay["choice"] for lay in old["layers"]] == [lay["choice"] for lay in new["layers"]]
        same_all &= same
        mo = old["predicted"]["memory_per_rank_bytes"] / 2**20
        mn = new["predicted"]["memory_per_rank_bytes"] / 2**20
        rows.append(f"{new_path.parent.name:<30} {po * 1e3:9.3f} {pn * 1e3:9.3f} {100 * (pn - po) / po:+8.4f}%  "
                    f"{'same' if same else 'CHANGED':<9} {mo:8.1f} {mn:8.1f}")
    rows.append(f"every plan's choices unchanged: {same_all}")
    text = "\n".join(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
