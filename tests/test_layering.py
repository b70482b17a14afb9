"""The import contract of autopar, read from the source: every file's AST, no process, nothing of
autopar imported (issue 39 item 4).

Sides of the flow (calibrate -> trace -> cost -> solve -> codegen -> execute -> report):

- **measurement** (``autopar.calibrate``): measures the machine, starts ranks, writes profiles;
- **profile** (``autopar.profile``): the pure profile model (schema, keys, features, fitted models,
  straggler, optimizer step, speed, shape cache); imports only itself, ``errors``, ``io`` and
  ``ops``, and nothing that starts processes;
- **planning** (trace, cost, decomp's plan-time value types, solve, codegen, the planner,
  explain): never imports measurement nor the runtime; ``cost`` reads the profile through
  ``autopar.profile`` only;
- **runtime** (``autopar.runtime``, what generated code imports, with the decompositions' run-time
  halves in ``autopar.runtime.layers``): everything it reaches, at module or function level,
  is free of the solver and the tracer (``autopar.solve``, ``autopar.trace``, pulp, highspy).

No import circle, counting module-level and function-level imports; and none at module level
once the implicit import of a package's ``__init__`` is counted (importing ``a.b.c`` from outside
``a.b`` runs ``a.b/__init__`` first), so that no import order can meet a half-initialised
module. A function-level import of an autopar module is allowed only where
``FUNCTION_LEVEL_ALLOWED`` says why (an optional heavy dependency, the lazy ``autopar`` API, or
a named piece of work still to do); a planning module that reaches measurement or the runtime
only where ``PLANNING_EXCEPTIONS`` says why. Both lists must stay exact: an entry that no
longer matches an import fails, so that the lists shrink as the code is fixed.

``check_tree`` is run on a synthetic tree with planted violations (``test_checker_*``), so that
a checker that found nothing could not pass.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------
# The contract
# ------------------------------------------------------------------------------------------

MEASUREMENT = ("autopar.calibrate",)
PROFILE = ("autopar.profile",)
PROFILE_MAY_IMPORT = ("autopar.profile", "autopar.errors", "autopar.io", "autopar.ops")
PLANNING = ("autopar.trace", "autopar.cost", "autopar.decomp", "autopar.solve", "autopar.codegen",
            "autopar.pipeline", "autopar.planner", "autopar.sweep", "autopar.pins", "autopar.explain")
RUNTIME = ("autopar.runtime",)
RUNTIME_NEVER_REACHES = ("autopar.solve", "autopar.trace", "pulp", "highspy")
COST = ("autopar.cost",)
STARTS_PROCESSES = ("subprocess", "multiprocessing", "torch.multiprocessing", "autopar.runtime.launch")

#: why a module is named in the lists below while its owner's work is in flight
_ENTRY_TRAIN = ("a real circle at import time: runtime.entry.run_generated (the generated module's main loop) "
                "trains through the public train API, autopar.train imports the runtime, and runtime/__init__ "
                "re-exports run_generated; breaking it moves run_generated up into autopar.train, which changes "
                "what codegen/generate.py emits (left for the owner of activation checkpointing work in flight)")
_DECOMP_COST_CIRCLE = ("a real circle at import time: cost.primitives reads decomp.ir (OpSpec, has_backward, "
                        "...), importing decomp.ir runs decomp/__init__, which imports every decomposition; "
                        "so a decomposition's cost method imports its pricing primitive when it prices")

#: (importing module, imported module) -> why the import is made inside a function;
#: (module or package, "*"): every function-level import of that module / package
FUNCTION_LEVEL_ALLOWED: dict[tuple[str, str], str] = {
    # the lazy public API: ``import autopar`` stays cheap, ``autopar.train`` loads torch
    ("autopar", "autopar.train"): "the lazy autopar API (__getattr__): import autopar stays free of torch",
    ("autopar.decomp.branch", "autopar.cost.primitives"): _DECOMP_COST_CIRCLE,
    ("autopar.decomp.branch.heads", "autopar.cost.primitives"): _DECOMP_COST_CIRCLE,
    ("autopar.decomp.channel_filter", "autopar.cost.primitives"): _DECOMP_COST_CIRCLE,
    ("autopar.decomp.common", "autopar.cost.primitives"): _DECOMP_COST_CIRCLE,
    ("autopar.decomp.spatial", "autopar.cost.primitives"): _DECOMP_COST_CIRCLE,
    ("autopar.decomp.tensor_parallel.common", "autopar.cost.primitives"): _DECOMP_COST_CIRCLE,
    ("autopar.decomp.tensor_parallel.heads", "autopar.cost.primitives"): _DECOMP_COST_CIRCLE,
    ("autopar.decomp.tensor_parallel.vocab", "autopar.cost.primitives"): _DECOMP_COST_CIRCLE,
    ("autopar.decomp.transition", "autopar.cost.primitives"): _DECOMP_COST_CIRCLE,
    ("autopar.decomp.transition", "autopar.cost.redistribute"): _DECOMP_COST_CIRCLE,
    ("autopar.cli", "*"): ("start-up speed of `autopar --help` and of each subcommand: the modules a "
                           "subcommand runs load torch, pulp and highspy"),
    ("autopar.runtime.entry", "autopar.train.api"): _ENTRY_TRAIN,
    ("autopar.runtime.entry", "autopar.train.data"): _ENTRY_TRAIN,
}

#: circles still to break: " <-> ".join(sorted modules), or a package whose every circle inside
#: it is meant -> why it is still there
CIRCLES_ALLOWED: dict[str, str] = {}

#: (planning module, measurement or runtime module) -> why planning reaches it; (module, "*") as above
PLANNING_EXCEPTIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Contract:
    measurement: tuple[str, ...] = MEASUREMENT
    profile: tuple[str, ...] = PROFILE
    profile_may_import: tuple[str, ...] = PROFILE_MAY_IMPORT
    planning: tuple[str, ...] = PLANNING
    runtime: tuple[str, ...] = RUNTIME
    runtime_never_reaches: tuple[str, ...] = RUNTIME_NEVER_REACHES
    cost: tuple[str, ...] = COST
    starts_processes: tuple[str, ...] = STARTS_PROCESSES
    function_level_allowed: dict = field(default_factory=lambda: dict(FUNCTION_LEVEL_ALLOWED))
    planning_exceptions: dict = field(default_factory=lambda: dict(PLANNING_EXCEPTIONS))
    circles_allowed: dict = field(default_factory=lambda: dict(CIRCLES_ALLOWED))


# ------------------------------------------------------------------------------------------
# The import graph, from the AST
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    src: str              # the importing module
    dst: str              # an autopar module, or a third-party module's dotted name
    line: int
    function_level: bool  # inside a function (run when it is called), not at module level


def in_any(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _entry(table: dict, src: str, dst: str):
    """The key of ``table`` that covers the import ``src`` -> ``dst``, or None."""
    if (src, dst) in table:
        return (src, dst)
    for key in table:
        if key[1] == "*" and in_any(src, (key[0],)):
            return key
    return None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def scan(root: Path, package: str = "autopar") -> tuple[dict[str, Path], list[Edge]]:
    """Every module of ``package`` under ``root`` and every import it makes."""
    modules = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    edges: list[Edge] = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_pkg = path.name == "__init__.py"
        for node, in_function in _imports(tree):
            for dst in _targets(node, mod, is_pkg, modules, package):
                if dst != mod:
                    edges.append(Edge(mod, dst, node.lineno, in_function))
    return modules, sorted(set(edges), key=lambda e: (e.src, e.line, e.dst))


def _imports(tree: ast.AST):
    stack = [(tree, False)]
    while stack:
        node, in_function = stack.pop()
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            stack.append((child, inner))


def _known(name: str, modules: dict[str, Path]) -> str:
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(node, mod: str, is_pkg: bool, modules: dict[str, Path], package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [_known(a.name, modules) if in_any(a.name, (package,)) else a.name for a in node.names]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not in_any(target, (package,)):
        return [target]
    out = []
    for a in node.names:
        sub = f"{target}.{a.name}"
        out.append(sub if sub in modules else _known(target, modules))
    return out


def circles(nodes, edges: list[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        if a in succ and b in succ:
            succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in succ:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _with_package_inits(modules: dict[str, Path], edges: list[Edge]) -> list[tuple[str, str]]:
    """Module-level edges, plus: importing ``a.b.c`` from outside ``a.b`` runs ``a.b/__init__``."""
    out = []
    for e in edges:
        if e.function_level or e.dst not in modules:
            continue
        out.append((e.src, e.dst))
        parts = e.dst.split(".")
        for i in range(2, len(parts)):
            pkg = ".".join(parts[:i])
            if pkg in modules and not in_any(e.src, (pkg,)):
                out.append((e.src, pkg))
    return out


def _reach(start: str, succ: dict[str, set[str]]) -> dict[str, str]:
    """Everything ``start`` reaches: {module: the module that imports it on one path}."""
    seen = {start: ""}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in sorted(succ.get(v, ())):
            if w not in seen:
                seen[w] = v
                todo.append(w)
    return seen


def _path(seen: dict[str, str], end: str) -> str:
    chain = [end]
    while seen.get(chain[-1]):
        chain.append(seen[chain[-1]])
    return " -> ".join(reversed(chain))


def check_tree(root: Path, contract: Contract = Contract(), package: str = "autopar") -> dict[str, list[str]]:
    """{rule: [violation, ...]} of ``contract`` on the tree at ``root`` (empty lists: it holds)."""
    modules, edges = scan(root, package)
    internal = [e for e in edges if e.dst in modules]
    out: dict[str, list[str]] = {k: [] for k in (
        "circle", "circle at import time", "planning reaches measurement or the runtime",
        "cost reads the profile only through autopar.profile", "the profile model stays pure",
        "the runtime reaches the solver or the tracer", "function-level import",
        "stale allow-list entry")}

    seen_circles = set()

    def allowed_circle(comp: list[str]) -> str | None:
        name = " <-> ".join(comp)
        if name in contract.circles_allowed:
            return name
        return next((k for k in contract.circles_allowed
                     if " <-> " not in k and all(in_any(m, (k,)) for m in comp)), None)

    for rule, edge_list in (("circle", [(e.src, e.dst) for e in internal]),
                            ("circle at import time", _with_package_inits(modules, edges))):
        for comp in circles(modules, edge_list):
            key = allowed_circle(comp)
            if key is None:
                out[rule].append(" <-> ".join(comp))
            else:
                seen_circles.add(key)
    for name in sorted(set(contract.circles_allowed) - seen_circles):
        out["stale allow-list entry"].append(f"CIRCLES_ALLOWED[{name!r}]: no such circle any more")

    used_exceptions = set()
    for e in internal:
        if in_any(e.src, contract.planning) and in_any(e.dst, contract.measurement + contract.runtime):
            key = _entry(contract.planning_exceptions, e.src, e.dst)
            if key is not None:
                used_exceptions.add(key)
            else:
                out["planning reaches measurement or the runtime"].append(f"{e.src}:{e.line} imports {e.dst}")
        if in_any(e.src, contract.cost) and in_any(e.dst, contract.measurement):
            out["cost reads the profile only through autopar.profile"].append(f"{e.src}:{e.line} imports {e.dst}")
    for e in edges:
        if in_any(e.src, contract.profile) and (
                (in_any(e.dst, (package,)) and not in_any(e.dst, contract.profile_may_import))
                or in_any(e.dst, contract.starts_processes)):
            out["the profile model stays pure"].append(f"{e.src}:{e.line} imports {e.dst}")

    succ: dict[str, set[str]] = {}
    for e in edges:
        succ.setdefault(e.src, set()).add(e.dst)
    for mod in sorted(m for m in modules if in_any(m, contract.runtime)):
        seen = _reach(mod, succ)
        for bad in sorted(m for m in seen if in_any(m, contract.runtime_never_reaches)):
            out["the runtime reaches the solver or the tracer"].append(_path(seen, bad))

    used_allowed = set()
    for e in internal:
        if not e.function_level:
            continue
        key = _entry(contract.function_level_allowed, e.src, e.dst)
        if key is not None:
            used_allowed.add(key)
        else:
            out["function-level import"].append(f"{e.src}:{e.line} imports {e.dst} inside a function")
    for key in sorted(set(contract.function_level_allowed) - used_allowed):
        out["stale allow-list entry"].append(f"FUNCTION_LEVEL_ALLOWED{key}: no such import any more")
    for key in sorted(set(contract.planning_exceptions) - used_exceptions):
        out["stale allow-list entry"].append(f"PLANNING_EXCEPTIONS{key}: no such import any more")
    return out


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------


def _broken(result: dict[str, list[str]]) -> dict[str, list[str]]:
    return {k: v for k, v in result.items() if v}


def test_autopar_keeps_its_import_contract():
    result = check_tree(ROOT)
    assert _broken(result) == {}, "\n".join(f"{k}:\n  " + "\n  ".join(v) for k, v in _broken(result).items())


def test_every_allow_list_entry_says_why():
    for table in (FUNCTION_LEVEL_ALLOWED, PLANNING_EXCEPTIONS, CIRCLES_ALLOWED):
        for key, why in table.items():
            assert isinstance(why, str) and len(why.split()) >= 3, key


def test_scan_reads_the_real_tree():
    """The graph the contract is checked on is the package's: a scan that read nothing, or
    resolved nothing, would make every rule hold."""
    modules, edges = scan(ROOT)
    assert {"autopar.profile.profile", "autopar.cost.table", "autopar.calibrate.run",
            "autopar.runtime.model"} <= set(modules)
    pairs = {(e.src, e.dst) for e in edges}
    assert ("autopar.cost.table", "autopar.profile.optimizer") in pairs      # a relative import
    assert ("autopar.calibrate.run", "autopar.runtime.launch") in pairs
    assert any(e.dst == "torch" for e in edges)                                 # third party kept


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


#: a tiny package with the same sides as autopar, obeying the contract
CLEAN = {
    "autopar/__init__.py": "",
    "autopar/errors.py": "",
    "autopar/profile/__init__.py": "from .model import Profile\n",
    "autopar/profile/model.py": "from ..errors import *\nclass Profile: pass\n",
    "autopar/calibrate/__init__.py": "",
    "autopar/calibrate/run.py": "import subprocess\nfrom ..profile import Profile\nfrom ..runtime import launch\n",
    "autopar/cost/__init__.py": "",
    "autopar/cost/table.py": "from ..profile.model import Profile\nfrom ..decomp import base\n",
    "autopar/decomp/__init__.py": "from . import base\n",
    "autopar/decomp/base.py": "import math\n",
    "autopar/solve/__init__.py": "",
    "autopar/solve/ilp.py": "from ..cost import table\ndef solve():\n    import pulp\n",
    "autopar/trace/__init__.py": "",
    "autopar/runtime/__init__.py": "",
    "autopar/runtime/launch.py": "import torch.multiprocessing\n",
    "autopar/runtime/model.py": "from ..decomp import base\nfrom . import launch\n",
}


def test_checker_passes_a_clean_tree(tmp_path):
    _write(tmp_path, CLEAN)
    assert _broken(check_tree(tmp_path, Contract(function_level_allowed={}, planning_exceptions={},
                                                 circles_allowed={}))) == {}


def test_checker_catches_planted_violations(tmp_path):
    planted = dict(CLEAN)
    planted.update({
        # a circle through a function-level import, and one only the package __init__ closes
        "autopar/cost/native.py": "from .table import *\n",
        "autopar/cost/table.py": ("from ..profile.model import Profile\nfrom ..decomp import base\n"
                                  "def f():\n    from .native import g\n"),
        "autopar/decomp/__init__.py": "from . import base, kind\n",
        "autopar/decomp/kind.py": "from ..cost import prim\n",
        "autopar/cost/prim.py": "from ..decomp.base import X\n",
        # planning reaches measurement; cost reads a measuring module
        "autopar/solve/ilp.py": "from ..cost import table\nfrom ..calibrate import run\n",
        "autopar/cost/exact.py": "from ..calibrate.run import shape_key\n",
        # the profile imports the cost model and starts processes
        "autopar/profile/model.py": "import subprocess\nfrom ..trace import tracer\nclass Profile: pass\n",
        # the runtime reaches the tracer two steps away, and pulp inside a function
        "autopar/runtime/model.py": "from ..decomp import helper\ndef f():\n    import pulp\n",
        "autopar/decomp/helper.py": "from ..trace import tracer\n",
        "autopar/trace/tracer.py": "",
    })
    _write(tmp_path, planted)
    contract = Contract(function_level_allowed={("autopar.x", "autopar.y"): "no such import left"},
                        planning_exceptions={}, circles_allowed={})
    r = check_tree(tmp_path, contract)
    assert r["circle"] == ["autopar.cost.native <-> autopar.cost.table"]
    assert r["circle at import time"] == ["autopar.cost.prim <-> autopar.decomp <-> autopar.decomp.kind"]
    assert r["planning reaches measurement or the runtime"] == [
        "autopar.cost.exact:1 imports autopar.calibrate.run", "autopar.solve.ilp:2 imports autopar.calibrate.run"]
    assert r["cost reads the profile only through autopar.profile"] == [
        "autopar.cost.exact:1 imports autopar.calibrate.run"]
    assert sorted(r["the profile model stays pure"]) == [
        "autopar.profile.model:1 imports subprocess", "autopar.profile.model:2 imports autopar.trace.tracer"]
    assert "autopar.runtime.model -> autopar.decomp.helper -> autopar.trace.tracer" in \
        r["the runtime reaches the solver or the tracer"]
    assert "autopar.runtime.model -> pulp" in r["the runtime reaches the solver or the tracer"]
    assert r["function-level import"] == ["autopar.cost.table:4 imports autopar.cost.native inside a function"]
    assert r["stale allow-list entry"] == ["FUNCTION_LEVEL_ALLOWED('autopar.x', 'autopar.y'): no such import any more"]


def test_checker_honours_the_allow_lists(tmp_path):
    planted = dict(CLEAN)
    planted["autopar/solve/ilp.py"] = "def solve():\n    from ..calibrate import run\n"
    planted["autopar/solve/a.py"] = "from . import b\n"
    planted["autopar/solve/b.py"] = "from . import a\n"
    _write(tmp_path, planted)
    key = ("autopar.solve.ilp", "autopar.calibrate.run")
    why = "a planted, explained exception"
    r = check_tree(tmp_path, Contract(function_level_allowed={key: why}, planning_exceptions={("autopar.solve", "*"): why},
                                      circles_allowed={"autopar.solve": why}))
    assert _broken(r) == {}
    r = check_tree(tmp_path, Contract(function_level_allowed={key: why}, planning_exceptions={("autopar.solve", "*"): why},
                                      circles_allowed={"autopar.cost": why}))
    assert r["circle"] == r["circle at import time"] == ["autopar.solve.a <-> autopar.solve.b"]
    assert r["stale allow-list entry"] == ["CIRCLES_ALLOWED['autopar.cost']: no such circle any more"]
