"""A synthetic profile with round numbers, for pure-logic tests (no calibration needed)."""

from autopar.profile import PROFILE_SCHEMA, Profile


def synthetic_profile(ranks_per_node: int = 4, nodes: int = 1, flops_per_s: float = 1e10,
                      bytes_per_s: float = 5e9, alpha_s: float = 1e-4, beta_s_per_byte: float = 1e-9,
                      inter_factor: float = 10.0) -> Profile:
    kernels = {c: {"t0_s": 1e-6, "s_per_flop": 1.0 / flops_per_s, "s_per_byte": 1.0 / bytes_per_s,
                   "measured": False}
               for c in ("conv_fwd", "conv_bwd_data", "conv_bwd_filter", "matmul", "elementwise",
                         "norm", "pool", "gather_scatter", "attention")}
    coll = {}
    for kind in ("allreduce", "allgather", "reduce_scatter", "all_to_all", "broadcast", "p2p"):
        coll[kind] = {}
        for level, f in (("intra", 1.0), ("inter", inter_factor)):
            coll[kind][level] = {str(p): {"alpha_s": alpha_s * f, "beta_s_per_byte": beta_s_per_byte * f,
                                          "measured": False} for p in (2, 4, 8)}
    return Profile(schema=PROFILE_SCHEMA,
                   fingerprint={"host": "synthetic", "cpu_model": "synthetic", "gpu_model": None,
                                "torch_version": "n/a", "backend": "gloo", "device": "cpu"},
                   provenance={"kind": "synthetic", "notes": "round numbers for tests"},
                   topology={"ranks_per_node": ranks_per_node, "nodes": nodes},
                   kernels=kernels, collectives=coll, exact={},
                   compute_slowdown={"1": 1.0}, samples={})
