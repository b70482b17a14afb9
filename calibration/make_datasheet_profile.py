"""Write calibration/datasheet-a100-cluster.json: a profile derived from vendor datasheets.

This is data generation, not package code: rerun it after changing an assumption below.

    python calibration/make_datasheet_profile.py [--out calibration/datasheet-a100-cluster.json]

Nothing here was measured. Every number is either a DATASHEET value (cited) or an ASSUMPTION
(an efficiency factor or a latency, stated with the reason). The cluster is a DGX-A100-like
machine: 8 A100 40GB SXM4 GPUs per node on NVLink 3 / NVSwitch, one 200 Gb/s HDR InfiniBand
port per GPU between nodes, 128 nodes (1024 GPUs).

Model forms are those of autopar.profile (schema.collective_terms, Profile); the kernel model is a SUM
``t0 + flops/F + bytes/B`` (not a roofline max), so for a layer where both terms matter it is
pessimistic by up to 2x; F and B below are therefore the achievable rates of each resource.
"""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

from autopar.profile import COLLECTIVES, OP_CLASSES, PROFILE_SCHEMA, Profile, save_profile

# ---- DATASHEET values -----------------------------------------------------------------------
DATASHEET = {
    "gpu": "NVIDIA A100 40GB SXM4",
    "fp32_flops_per_s": 19.5e12,        # A100 datasheet: FP32 19.5 TFLOPS
    "tf32_tensor_flops_per_s": 156e12,  # A100 datasheet: TF32 Tensor Core 156 TFLOPS (dense)
    "hbm_bytes_per_s": 1555e9,          # A100 40GB datasheet: GPU memory bandwidth 1,555 GB/s
    "nvlink_bytes_per_s_total": 600e9,  # A100 datasheet: NVLink 600 GB/s (both directions)
    "gpus_per_node": 8,                 # DGX A100 datasheet: 8x A100, NVSwitch
    "ib_bits_per_s_per_port": 200e9,    # DGX A100 datasheet: ConnectX-6 HDR InfiniBand 200 Gb/s
    "ib_ports_per_node": 8,             # DGX A100 datasheet: 8 single-port HCAs for compute
}
SOURCES = [
    "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
    "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)",
    "NVIDIA DGX A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
    "nvidia-dgx-a100-datasheet.pdf)",
]

# ---- ASSUMPTIONS ----------------------------------------------------------------------------
ASSUMPTIONS = {
    "conv_precision": "TF32 tensor cores: PyTorch's default torch.backends.cudnn.allow_tf32=True",
    "matmul_precision": "plain FP32: PyTorch's default torch.backends.cuda.matmul.allow_tf32=False"
                        " (attention in FP32 too)",
    "eff_conv_fwd": 0.50,          # fraction of TF32 peak reached by cuDNN on typical CNN layers
    "eff_conv_bwd_data": 0.45,
    "eff_conv_bwd_filter": 0.40,   # weight gradients reduce over N*H*W: usually the slowest
    "eff_matmul": 0.80,            # large SGEMM reaches ~80% of FP32 peak
    "eff_attention": 0.50,         # FP32 SDPA (math / mem-efficient kernels)
    "eff_hbm_streaming": 0.80,     # elementwise, and the bytes term of compute-bound classes
    "eff_hbm_norm": 0.60,          # batch-norm reads its input twice (statistics, normalise)
    "eff_hbm_pool": 0.60,
    "eff_hbm_gather_scatter": 0.35,  # random row access, atomics for index_add
    "kernel_launch_s": 5e-6,       # CUDA launch + eager PyTorch dispatch per kernel
    "eff_nvlink": 0.80,            # NCCL bus bandwidth / NVLink per-direction peak
    "alpha_intra_s": 5e-6,         # per NCCL step on NVLink/NVSwitch
    "eff_ib": 0.80,                # NCCL bus bandwidth / IB port peak
    "alpha_inter_s": 10e-6,        # per NCCL step across nodes (IB latency + proxy overhead)
    "slowdown": "1.0 for every count: each rank has its own GPU",
}


def kernels() -> dict:
    a, d = ASSUMPTIONS, DATASHEET
    stream_bps = a["eff_hbm_streaming"] * d["hbm_bytes_per_s"]
    rates = {  # op class: (flops_per_s, bytes_per_s, what)
        "conv_fwd": (a["eff_conv_fwd"] * d["tf32_tensor_flops_per_s"], stream_bps, "TF32"),
        "conv_bwd_data": (a["eff_conv_bwd_data"] * d["tf32_tensor_flops_per_s"], stream_bps, "TF32"),
        "conv_bwd_filter": (a["eff_conv_bwd_filter"] * d["tf32_tensor_flops_per_s"], stream_bps, "TF32"),
        "matmul": (a["eff_matmul"] * d["fp32_flops_per_s"], stream_bps, "FP32"),
        "attention": (a["eff_attention"] * d["fp32_flops_per_s"], stream_bps, "FP32"),
        "elementwise": (d["fp32_flops_per_s"], stream_bps, "HBM"),
        "norm": (d["fp32_flops_per_s"], a["eff_hbm_norm"] * d["hbm_bytes_per_s"], "HBM"),
        "pool": (d["fp32_flops_per_s"], a["eff_hbm_pool"] * d["hbm_bytes_per_s"], "HBM"),
        "gather_scatter": (d["fp32_flops_per_s"], a["eff_hbm_gather_scatter"] * d["hbm_bytes_per_s"],
                           "HBM"),
    }
    assert set(rates) == set(OP_CLASSES)
    return {op: {"t0_s": a["kernel_launch_s"], "s_per_flop": 1.0 / f, "s_per_byte": 1.0 / b,
                 "flops_per_s": f, "bytes_per_s": b,
                 "heldout_median_rel_err": None, "heldout_max_rel_err": None, "n_samples": 0,
                 "measured": False,
                 "source": f"datasheet peak x assumed efficiency ({what}); not measured"}
            for op, (f, b, what) in rates.items()}


def collectives() -> dict:
    a, d = ASSUMPTIONS, DATASHEET
    nvlink_dir = d["nvlink_bytes_per_s_total"] / 2           # per direction
    ib_per_gpu = d["ib_bits_per_s_per_port"] / 8 * d["ib_ports_per_node"] / d["gpus_per_node"]
    levels = {
        "intra": (a["alpha_intra_s"], 1.0 / (a["eff_nvlink"] * nvlink_dir), ["2", "4", "8"],
                  f"datasheet NVLink {nvlink_dir / 1e9:.0f} GB/s per direction x {a['eff_nvlink']}"),
        "inter": (a["alpha_inter_s"], 1.0 / (a["eff_ib"] * ib_per_gpu), ["2", "16", "128", "1024"],
                  f"datasheet HDR IB {ib_per_gpu / 1e9:.0f} GB/s per GPU x {a['eff_ib']}"),
    }
    out = {}
    for kind in COLLECTIVES:
        out[kind] = {}
        for level, (alpha, beta, sizes, what) in levels.items():
            out[kind][level] = {p: {"alpha_s": alpha, "beta_s_per_byte": beta,
                                    "heldout_median_rel_err": None, "heldout_max_rel_err": None,
                                    "n_samples": 0, "measured": False,
                                    "source": f"{what}; alpha assumed; not measured"}
                                for p in (["2"] if kind == "p2p" else sizes)}
    return out


def build(date: str | None = None) -> Profile:
    return Profile(
        schema=PROFILE_SCHEMA,
        fingerprint={"host": "datasheet (no machine measured)",
                     "cpu_model": "AMD EPYC 7742 (DGX A100; not used)",
                     "gpu_model": "NVIDIA A100-SXM4-40GB", "torch_version": None,
                     "backend": "nccl", "device": "cuda", "num_threads": None, "python": None},
        provenance={
            "kind": "datasheet",
            "date": date or dt.date.today().isoformat(),
            "command": "python calibration/make_datasheet_profile.py",
            "notes": ("Derived from vendor datasheets, NOT measured: a DGX-A100-like cluster of "
                      "128 nodes x 8 A100 40GB SXM4 (NVLink 3 + NVSwitch inside a node, one "
                      "200 Gb/s HDR InfiniBand port per GPU between nodes). 'datasheet_values' "
                      "are vendor numbers; 'assumptions' are efficiency factors and latencies "
                      "chosen by hand. Use it to plan for such a cluster, not to predict this "
                      "machine."),
            "datasheet_values": DATASHEET,
            "assumptions": ASSUMPTIONS,
            "sources": SOURCES,
        },
        topology={"ranks_per_node": DATASHEET["gpus_per_node"], "nodes": 128},
        kernels=kernels(),
        collectives=collectives(),
        exact={},
        compute_slowdown={str(k): 1.0 for k in range(1, DATASHEET["gpus_per_node"] + 1)},
        samples={},
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent / "datasheet-a100-cluster.json")
    ap.add_argument("--date", default=None, help="date to record (default: today)")
    args = ap.parse_args(argv)
    save_profile(build(args.date), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
