"""Store in a profile file the kernel models that loading it would otherwise fit again.

A profile made before the shape- and cache-aware kernel models gets them fitted from its own
raw samples every time it is loaded (``profile.fit.add_shape_models``: NNLS fits, and the
scipy import they need, about 0.5 s of every ``autopar plan``). This writes the fitted models
(and the "fitted, not better" markers) into the file, changing nothing else: the loaded
profile, and so every price, is the same as before.

    python calibration/store_fitted_models.py calibration/cpu-2core-gloo.json
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path


def main(argv=None) -> int:
    from autopar.profile import load_profile
    from autopar.io import atomic_write_text
    for path in (argv if argv is not None else sys.argv[1:]):
        text = Path(path).read_text(encoding="utf-8")
        raw = json.loads(text)
        indent = 1 if text.startswith("{\n \"") else 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof = load_profile(path, check_machine=False)
        added = []
        for cls, k in prof.kernels.items():
            for m in ("shape_model", "cache_model"):
                if isinstance(k, dict) and m in k and m not in raw["kernels"].get(cls, {}):
                    raw["kernels"][cls][m] = k[m]
                    added.append(f"{cls}.{m}")
        if added:
            atomic_write_text(Path(path), json.dumps(raw, indent=indent) + "\n")
        print(f"{path}: stored {', '.join(added) if added else 'nothing (already there)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
