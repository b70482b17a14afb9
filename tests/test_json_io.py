"""JSON files are read and written in one module, ``autopar/io.py`` (issue 39 item 5; the rule is
in ``autopar.io``'s docstring). Read from the source by AST, nothing imported.

Flagged outside ``io.py``: a call of ``json.load`` or ``json.dump`` (the file forms), a
``from json import load/dump``, and ``json.loads`` of what a file read returned (an argument
that calls ``read_text``, ``read_bytes`` or ``read``). ``json.dumps``/``json.loads`` of strings
in memory (hash keys, messages, checkpoint entries) are allowed. The checker is run on planted
violations so that one that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = ("autopar/io.py",)
_FILE_READS = ("read_text", "read_bytes", "read")


def _json_attr(node: ast.AST, names: dict[str, str]) -> str | None:
    """``load`` for ``json.load`` (``json`` under any alias), or for a name imported from json."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and names.get(node.value.id) == "json":
        return node.attr
    if isinstance(node, ast.Name) and names.get(node.id, "").startswith("json."):
        return names[node.id][len("json."):]
    return None


def _reads_a_file(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _FILE_READS
               for n in ast.walk(node))


def violations(source: str, rel: str) -> list[str]:
    """Where ``source`` reads or writes a JSON file itself, as ``rel:line what``."""
    tree = ast.parse(source)
    names: dict[str, str] = {}            # local name -> "json" or "json.<attr>"
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name == "json":
                    names[a.asname or "json"] = "json"
        elif isinstance(n, ast.ImportFrom) and n.module == "json":
            for a in n.names:
                names[a.asname or a.name] = f"json.{a.name}"
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        attr = _json_attr(n.func, names)
        if attr in ("load", "dump"):
            out.append(f"{rel}:{n.lineno} json.{attr} (a JSON file: use autopar.io)")
        elif attr == "loads" and n.args and _reads_a_file(n.args[0]):
            out.append(f"{rel}:{n.lineno} json.loads of a file read (use autopar.io.read_json / load_json_file)")
    return out


def scan(root: Path) -> list[str]:
    out = []
    for path in sorted((root / "autopar").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel not in ALLOWED:
            out += violations(path.read_text(encoding="utf-8"), rel)
    return out


def test_only_io_reads_and_writes_json_files():
    assert scan(ROOT) == []


def test_the_scan_reads_the_real_tree():
    files = list((ROOT / "autopar").rglob("*.py"))
    assert len(files) > 50
    # io.py itself does what the rule forbids elsewhere: the checker would flag it
    assert violations((ROOT / "autopar/io.py").read_text(encoding="utf-8"), "autopar/io.py")


def test_checker_catches_planted_violations(tmp_path):
    planted = {
        "a.py": "import json\ndef f(p):\n    with open(p) as fh:\n        return json.load(fh)\n",
        "b.py": "import json as j\ndef f(p, o):\n    with open(p, 'w') as fh:\n        j.dump(o, fh)\n",
        "c.py": "from json import load as ld\ndef f(fh):\n    return ld(fh)\n",
        "d.py": "import json\ndef f(path):\n    return json.loads(path.read_text())\n",
        "e.py": "import json\ndef f(p):\n    return json.loads(open(p).read())\n",
    }
    pkg = tmp_path / "autopar"
    pkg.mkdir()
    for name, src in planted.items():
        (pkg / name).write_text(src)
    (pkg / "ok.py").write_text("import json, hashlib\n"
                               "def key(o):\n    return hashlib.sha256(json.dumps(o).encode()).hexdigest()\n"
                               "def msg(s):\n    return json.loads(s)\n")
    found = scan(tmp_path)
    assert sorted(f.split(":")[0] for f in found) == [f"autopar/{n}" for n in sorted(planted)]
