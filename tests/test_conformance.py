"""The conformance matrix's quick slice (``benchmarks/conformance.py --quick``, issue 38).

A CNN (``resnet2d``, spatial pinned), Hugging Face GPT-2 (``sample`` pinned: run natively, the
loss reading ``output.logits``; ``head`` pinned: the traced program with [B, S] targets) and a
GNN (PyTorch Geometric NNConv, ``edges`` pinned), at world 2, each through the matrix's three
checks, with the matrix's own code (``conformance.Driver``): ``autopar execute``'s float64
validation; the user's loop (``parallelize`` + ``plan_loader`` / ``shard_batch`` + AdamW with
clipping, 3 steps) equal to one process within 1e-9 (or 100x one process's own sensitivity to a
few-ulp nudge of its weights, where that is larger: ``conformance.PERTURB_REL``; these models
are far below it); ``autopar.save`` under the plan, then
``autopar.load`` into the data-parallel plan at world 4, every tensor equal. Also: a kind no
layer offers is reported not legal with the planner's reason, and the report counts and notes
what the cache holds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _conformance():
    name = "autopar_benchmarks_conformance"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "conformance.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


cf = _conformance()
CELLS = [(m, row, check) for m, rows in cf.QUICK.items() for row in rows for check in cf.CHECKS]
NEEDS = {"hf_gpt2": "transformers", "pyg_nnconv": "torch_geometric"}


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    """One ``Driver`` per model at world 2 (its plans and loop reference made once)."""
    work = tmp_path_factory.mktemp("conformance")
    made: dict[str, object] = {}

    def get(model: str):
        if model in NEEDS:
            pytest.importorskip(NEEDS[model])
        if model not in made:
            made[model] = cf.Driver(model, cf.QUICK_WORLDS[0], work, cell_timeout_s=180.0)
        return made[model]
    return get


@pytest.mark.dist
@pytest.mark.parametrize("model, row, check", CELLS, ids=[f"{m}-{r}-{c}" for m, r, c in CELLS])
def test_quick_cell_passes(model, row, check, drivers):
    d = drivers(model)
    res = d.check(row, check)
    assert res["status"] == "pass", f"{model} {row} w2 {check}: {res['status']}: {res['detail']}"
    # the row really pinned its kind: the plan's layers hold it
    assert d.plan(row).note and row in d.plan(row).note, d.plan(row).note


def test_kind_no_layer_offers_is_not_legal_with_the_planners_reason(drivers):
    res = drivers("resnet2d").check("head", "execute")
    assert res["status"] == "not_legal", res
    # the pin API's refusal (``autopar.pins.PinError``) or, before it, the cost table's
    assert "is legal on none of" in res["detail"] or res["detail"].startswith("no layer offers head"), res["detail"]


def test_report_counts_and_notes_what_the_cache_holds():
    cells = {
        cf.cell_key("resnet2d", "spatial", 2, "execute"): {"status": "pass", "detail": "267 tensors"},
        cf.cell_key("resnet2d", "head", 2, "execute"): {"status": "not_legal", "detail": "no layer offers head"},
        cf.cell_key("resnet2d", "channel", 2, "loop"): {"status": "fail", "detail": "IndexError: tuple index"},
        cf.cell_key("resnet2d", "tournament W x 1", 2, "loop"): {"status": "n/a", "detail": "execute only"},
    }
    md = cf.render({"cells": cells, "commands": [{"when": "t", "command": "python benchmarks/conformance.py"}]})
    assert "**4 cells: 1 pass, 1 not legal, 1 fail, 1 n/a.**" in md
    assert "head (w2), not legal: no layer offers head" in md
    assert "resnet2d | channel | w2 | loop: IndexError: tuple index" in md     # the failing-cells list
    assert "python benchmarks/conformance.py" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| channel |"))
    assert "**FAIL** [" in row
