#!/usr/bin/env bash
# Create .venv (if missing) and install autopar with torch 2.13.0 CPU first, so that no
# dependency can resolve a newer, multi-GB torch. Idempotent; prints what it does.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build)"
  python -m pip install -q torch==2.13.0
fi
echo "setup: installing autopar and its dependencies"
python -m pip install -q -e ".[test]"
python -c "import torch, autopar; print('setup: torch', torch.__version__, '| autopar', autopar.__version__)"
