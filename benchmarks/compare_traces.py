"""Check that a change to the tracer keeps every shipped example's layer graph: trace each model
file with one tree, write each graph's JSON, and compare with the JSON another tree wrote.

    python benchmarks/compare_traces.py dump OUTDIR            # with PYTHONPATH = the tree
    python benchmarks/compare_traces.py diff BASEDIR NEWDIR

The graphs are traced without the trace cache (``trace_model``), each at a small batch size;
``tracer`` (the name of the tracer used) is left out of the comparison, since changing it is
the point of such a change; every other field must be equal.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (model file, batch size, environment)
MODELS = [(str(p.relative_to(ROOT)), 4, {}) for p in sorted((ROOT / "strategies" / "examples").glob("*.py"))] + \
    [(str(p.relative_to(ROOT)), 4, {}) for p in sorted((ROOT / "benchmarks" / "models").glob("*.py"))] + \
    [("strategies/examples/cnn3d_large.py", 1, {"AUTOPAR_CNN3D_SIZE": "64"}),
     ("strategies/examples/gpt.py", 8, {"AUTOPAR_GPT_LAYERS": "3"}),
     ("strategies/examples/torch_encoder.py", 4, {"AUTOPAR_ENC_CAUSAL": "1"}),
     ("strategies/examples/hf_bert.py", 4, {"AUTOPAR_BERT_HEAD": "classification"}),
     ("strategies/examples/gnn_pcqm4m.py", 4, {"AUTOPAR_GNN_NODE_EMBED": "12", "AUTOPAR_GNN_LAYERS": "2"}),
     ("tests/tp_llama.py", 2, {})]


def dump(out: Path) -> int:
    import warnings
    warnings.simplefilter("ignore")
    from autopar.modelfile import load_model_file
    from autopar.trace.tracer import trace_model
    out.mkdir(parents=True, exist_ok=True)
    for model, batch, env in MODELS:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        name = Path(model).stem + "".join(f"-{k}={v}" for k, v in env.items()) + f"-b{batch}"
        t = time.perf_counter()
        try:
            mf = load_model_file(ROOT / model)
            g = trace_model(mf, mf.default_batch_size() or batch).to_json()
            status = "ok"
        except Exception as e:     # recorded, so that both trees must fail alike
            g = {"error": f"{type(e).__name__}: {e}"}
            status = "error"
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        (out / f"{name}.json").write_text(json.dumps(g, indent=1, sort_keys=True))
        print(f"{name}: {status} {time.perf_counter() - t:.2f} s", flush=True)
    return 0


def _strip(g: dict) -> dict:
    """Without ``tracer``, and with the user module's import name (``autopar_user_model_`` and a
    hash of its path that changes with ``PYTHONHASHSEED``) made one name."""
    text = re.sub(r"autopar_user_model_\d+", "autopar_user_model", json.dumps(g))
    return {k: v for k, v in json.loads(text).items() if k != "tracer"}


def diff(a: Path, b: Path) -> int:
    bad = 0
    for pa in sorted(a.glob("*.json")):
        pb = b / pa.name
        if not pb.is_file():
            print(f"{pa.stem}: missing in {b}")
            bad += 1
            continue
        ga, gb = json.loads(pa.read_text()), json.loads(pb.read_text())
        if _strip(ga) == _strip(gb):
            print(f"{pa.stem}: identical ({len(ga.get('layers', []))} layers; tracer "
                  f"{ga.get('tracer')} -> {gb.get('tracer')})")
        else:
            bad += 1
            print(f"{pa.stem}: DIFFERENT")
            _first_difference(_strip(ga), _strip(gb), pa.stem)
    print("all identical" if not bad else f"{bad} differ")
    return 1 if bad else 0


def _first_difference(x, y, path: str) -> bool:
    if type(x) is not type(y):
        print(f"  {path}: {str(x)[:200]} != {str(y)[:200]}")
        return True
    if isinstance(x, dict):
        for k in sorted(set(x) | set(y)):
            if k not in x or k not in y:
                print(f"  {path}.{k}: only in {'new' if k not in x else 'base'}")
                return True
            if x[k] != y[k] and _first_difference(x[k], y[k], f"{path}.{k}"):
                return True
        return False
    if isinstance(x, list):
        if len(x) != len(y):
            print(f"  {path}: length {len(x)} != {len(y)}")
        for i, (u, v) in enumerate(zip(x, y)):
            if u != v and _first_difference(u, v, f"{path}[{i}]"):
                return True
        return len(x) != len(y)
    if x != y:
        print(f"  {path}: {str(x)[:200]} != {str(y)[:200]}")
        return True
    return False


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        sys.exit(dump(Path(sys.argv[2])))
    if len(sys.argv) == 4 and sys.argv[1] == "diff":
        sys.exit(diff(Path(sys.argv[2]), Path(sys.argv[3])))
    print(__doc__)
    sys.exit(2)
