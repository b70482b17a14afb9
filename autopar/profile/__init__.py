"""The pure profile model: what a calibration profile says and how it is read, written and
evaluated. Imports nothing that measures and starts no process; ``autopar.calibrate`` measures
and writes into it, ``autopar.cost`` prices with it.

- ``schema``: the vocabulary (schema string, op classes, collectives, link levels, phases) and
  the collective cost forms (``collective_terms``);
- ``profile``: the ``Profile`` type, its JSON read / write / validation, machine fingerprints;
- ``keys``: exact-table keys (``shape_key`` of a convolution / linear shape, ``op_key`` of any
  other op on local shapes);
- ``features``: FLOPs and bytes of each op class, the shape-aware convolution models' terms;
- ``fit``: the fitted models (non-negative relative least squares) and their evaluation;
- ``straggler``: the straggler wait model; ``optimizer``: the optimizer step's model;
- ``speed``: the nominal speed a profile is stated at; ``history``: the machine's usual speed;
- ``shapes``: the shape cache beside a profile (shapes measured on demand).

Layering (``tests/test_layering.py``): schema < keys < features < fit < profile < the rest.
"""

from .profile import (COLLECTIVES, LEVELS, OP_CLASSES, PHASES, PROFILE_SCHEMA, SIMULATED, Profile, check_fingerprint,
                      collective_terms, current_fingerprint, default_profile_path, load_profile,
                      require_measured_here, save_profile, simulated_entries)

__all__ = ["COLLECTIVES", "LEVELS", "OP_CLASSES", "PHASES", "PROFILE_SCHEMA", "SIMULATED", "Profile",
           "check_fingerprint", "collective_terms", "current_fingerprint", "default_profile_path",
           "load_profile", "require_measured_here", "save_profile", "simulated_entries"]
