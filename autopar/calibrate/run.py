"""Calibration driver: measure kernels, compute slowdown and collectives; fit; write a profile.

Order (every measurement runs in freshly forked ranks via ``runtime.launch.run_ranks``; this
process only imports torch and fits, so it stays safe to fork from):

1. kernels: one 1-rank run per op class (``kernels.benchmark_op_class`` over a size sweep),
   then the exact shapes, if any (``kernels.measure_exact``);
2. compute slowdown: in one launch of ``world`` ranks, k = 1..world of them at once run
   ``kernels.slowdown_kernel_set`` for the same wall-clock window, in rounds; factor(k) = the
   median over rounds of t(k) / t(1) of the same round, t(k) = median over the k ranks of each
   rank's MEAN time per kernel-set run (see ``_slowdown_rank``; the mean, because time
   slicing hides the waiting from a per-run median); on a CPU, counts beyond one rank per core
   are priced as time sharing of the cores (``time_shared_slowdown``);
3. collectives: one run of p ranks for each group size p = 2..world, or for the divisors of
   the world in quick mode (``collective_group_sizes``, ``collectives.measure_rank``);
4. fits (``fit.fit_kernel``, ``fit.fit_collective``), then ONE atomic write of the profile.

Nothing is written before the end: an interrupted or failed calibration (Ctrl-C included)
leaves any previous profile at ``out`` untouched.
"""

from __future__ import annotations

import datetime as _dt
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ..errors import CalibrationError
from . import collectives as coll, kernels, speed
from ..profile import fit
from ..profile.profile import (COLLECTIVES, OP_CLASSES, PROFILE_SCHEMA, Profile, current_fingerprint,
                               load_profile, require_measured_here, save_profile)
from ..profile.history import record
from ..profile.keys import shape_key
from ..runtime import launch as rank_launch  # looked up at each call: tests replace run_ranks
from .insitu import describe_step_costs, measure_step_costs
from .overhead import (add_runtime_overhead, measure_grad_reducer, measure_runtime_overhead_by_family,
                       measure_runtime_overhead_s)
from .plots import plot_fits


@dataclass(frozen=True)
class Sweep:
    """How much to measure. ``QUICK`` (~1 min at world 4 on 2 cores), ``FULL`` (~5 min)."""

    kernel_configs: int = 48            # sizes per op class
    kernel_repeats: int = 11
    kernel_warmup: int = 2
    kernel_max_flops: float = 1e9       # cap per kernel call
    conv_min_flops: float = 1e6         # floor for conv sizes (see kernels.sweep_configs)
    kernel_max_numel: int = 1 << 23     # cap on elements of the largest operand(s)
    kernel_budget_s: float = 0.25       # max time per size (slow kernels get fewer repeats)
    message_sizes: tuple = tuple(4 ** i for i in range(1, 13))   # 4 B .. 16 MiB
    coll_repeats: int = 61
    coll_warmup: int = 2
    coll_groups: str = "all"           # group sizes of the collectives (``collective_group_sizes``)
    slowdown_window_s: float = 2.0     # wall time every rank runs the kernel set, per k
    slowdown_rounds: int = 12          # ... split into this many rounds over every k: six
                                       # repeats of the same 2 s read 2 ranks at 0.94-1.10 in
                                       # 3 rounds, 1.00-1.08 in 12; 4 ranks 1.96-2.23 and
                                       # 2.08-2.54, about 8 % higher and no steadier
                                       # (reports/benchmarks/calibration_noise.txt, git 172578b^); the
                                       # shipped full profiles of 3 rounds read 0.87-1.17 and
                                       # 1.83-2.63 over one day
    exact_repeats: int = 11
    insitu_iters: int = 30              # timed repeats of each in-situ probe (``calibrate.insitu``)
    op_classes: tuple = OP_CLASSES
    kinds: tuple = COLLECTIVES
    conv_configs: int | None = None     # sizes per conv class (default kernel_configs): the
                                        # shape-aware conv model has 14 constants to fit
    conv_max_flops: float | None = None  # cap per convolution (default kernel_max_flops)


FULL = Sweep(conv_configs=160)     # 14 constants of conv_shape/3: with 96 sizes its held-out
                                   # error beat the flat fit's by 0.7 points on 28 test sizes
QUICK = Sweep(kernel_configs=24, kernel_repeats=5, kernel_warmup=1, kernel_max_flops=2e8,
              kernel_max_numel=1 << 21, kernel_budget_s=0.06,
              # fewer sizes, but up to 16 MiB: on an oversubscribed node everything below
              # ~1 MiB is latency, and beta needs the large messages to be identifiable
              message_sizes=(4, 64, 1024, 16384, 262144, 1 << 20, 4 << 20, 16 << 20),
              coll_repeats=21, coll_warmup=1, slowdown_window_s=0.6, slowdown_rounds=8,
              # the group sizes a mesh of the world can have: at world 4 the group of 3 took
              # 5.7 of 59.5 s and no plan of 4 ranks uses it
              coll_groups="divisors",
              exact_repeats=5, conv_configs=160,
              # 10 in-situ repeats read the latency at 2 ranks 1.7-3.4 ms in three back-to-back
              # measurements, 30 read 2.7 ms twice; 20 costs about 3 s more than 10
              insitu_iters=20,
              # CNN layers reach 1e9 FLOPs at batch 16: capped at 2e8, the fit extrapolated
              # and priced the shipped CNNs' layers 15-35 % low in sum (about 6 s more)
              conv_max_flops=1e9)
TINY = Sweep(kernel_configs=4, kernel_repeats=3, kernel_warmup=1, kernel_max_flops=2e7,
             conv_min_flops=1e5,
             kernel_max_numel=1 << 16, kernel_budget_s=0.02,
             message_sizes=(4, 256, 4096, 65536), coll_repeats=3, coll_warmup=1,
             # 0.15 s per window: at 0.05 s a loaded machine finished no kernel-set run in one
             slowdown_window_s=0.45, slowdown_rounds=3, exact_repeats=3, insitu_iters=10)
"""For tests only: a few sizes of everything (seconds, not minutes)."""


# ---- rank functions (module level so that spawn can pickle them) -------------------------

def _kernel_rank(rank, world, op_class, configs, sweep, device):
    """The op class's sweep rows (each with the probe time around it) and the probe readings."""
    track = speed.SpeedTrack(device)
    rows = kernels.benchmark_op_class(op_class, configs, device, sweep.kernel_repeats,
                                      sweep.kernel_warmup, budget_s=sweep.kernel_budget_s, track=track)
    return rows, track.readings_s


def _exact_rank(rank, world, specs, repeats, device):
    """(medians, samples with each key's probe time, the probe readings) of the exact shapes."""
    track = speed.SpeedTrack(device)
    exact, samples = kernels.measure_exact(specs, device, repeats, return_samples=True, track=track)
    return exact, samples, track.readings_s


def _exact_probes(samples: dict) -> dict:
    return {k: v.get("probe_s") for k, v in samples.items() if isinstance(v, dict)}


def _slowdown_rank(rank, world, window_s, device, rounds=1):
    """The fixed kernel set under k = 1..world ranks at once, ``rounds`` times over, in ONE
    launch of ``world`` ranks: in each round, for each k in turn, the first k ranks run it for
    the same ``window_s`` of wall time while the others wait at the next broadcast. Returns
    ``{k: [run times of each round]}`` for the k this rank took part in.

    Each window starts at an instant rank 0 picks on the machine-wide monotonic clock
    (``perf_counter`` is CLOCK_MONOTONIC on Linux) and broadcasts, so all k ranks compete for the
    whole window; only kernel-set runs that finish inside it count. Every count is measured
    next to a 1-rank window of the same round: one window per count, each in its own launch,
    read 0.87-1.14 for 2 ranks on the 2-core VM between calibrations (the machine's speed
    drifting between the windows), which moved every world-2 prediction by as much.
    """
    import torch
    import torch.distributed as dist

    run = kernels.slowdown_kernel_set(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        run()
    sync()
    out: dict[int, list] = {k: [] for k in range(rank + 1, world + 1)}
    for j in range(rounds):
        # the order of the counts alternates round by round, so that a drift of the machine
        # over a round does not fall on the large counts alone
        for k in (range(1, world + 1) if j % 2 == 0 else range(world, 0, -1)):
            start = torch.tensor([time.perf_counter() + 0.02 if rank == 0 else 0.0], dtype=torch.float64)
            if device == "cuda":
                start = start.cuda()
            dist.broadcast(start, 0)
            if rank >= k:
                continue
            t_begin = float(start.item())
            t_end = t_begin + window_s
            time.sleep(max(0.0, t_begin - time.perf_counter()))
            times = []
            t0 = time.perf_counter()
            while True:
                run()
                sync()
                t1 = time.perf_counter()
                if t1 > t_end:
                    break
                times.append(t1 - t0)
                t0 = t1
            out[k].append(times)
    return out


def collective_group_sizes(world: int, groups: str = "all") -> list[int]:
    """The group sizes whose collectives calibration measures, one launch each: every p in
    2..world (``"all"``), or the divisors of the world from 2 (``"divisors"``, quick): the sizes
    the dims of a mesh of ``world`` ranks, and so its plans' groups, can have. A plan for
    another world prices an unmeasured size with the nearest measured size's constants
    (``Profile.collective_time_s``), as quick in-step costs are taken for the nearest measured
    number of ranks."""
    if groups not in ("all", "divisors"):
        raise ValueError(f"collective groups {groups!r}: 'all' or 'divisors'")
    return [p for p in range(2, world + 1) if groups == "all" or world % p == 0]


def slowdown_factors(per_rank, world: int, rounds: int, window_s: float):
    """(``{str(k): factor}``, ``{k: [per-round ratio]}``, the run times per count and rank) of
    ``_slowdown_rank``'s result: factor(k) = the median over rounds of t(k) / t(1) of the same
    round. A count's time in a round: the median over its ranks of each rank's MEAN time per
    kernel-set run (the OS deschedules a rank for whole time slices, so most runs go at full
    speed and a few absorb the waiting; the mean counts it; the median over ranks ignores one
    rank luckier than the others). The unpaired alternative (the median over rounds of t(k) over
    that of t(1)) read as well or slightly worse in six repeats of each on this VM: coefficients
    of variation 0.8-14 % against 1.0-11 % paired."""
    slow_times: dict[str, list] = {}
    per_round: dict[int, list] = {}
    for k in range(1, world + 1):
        rows = [r[k] for r in per_rank[:k]]          # rank -> rounds -> run times
        slow_times[str(k)] = [[float(f"{t:.6g}") for rnd in r for t in rnd] for r in rows]
        per_round[k] = []
        for j in range(rounds):
            means = [sum(r[j]) / len(r[j]) for r in rows if r[j]]
            if not means:
                raise CalibrationError(f"compute slowdown at {k} ranks: no kernel-set run finished "
                                       f"within {window_s:.2f} s", "use a longer window")
            per_round[k].append(statistics.median(means))
    ratios = {k: [t / b for t, b in zip(v, per_round[1])] for k, v in per_round.items()}
    slowdown = {str(k): round(statistics.median(v), 4) for k, v in ratios.items()}
    slowdown["1"] = 1.0
    return slowdown, ratios, slow_times


def usable_cores() -> int:
    """The CPU cores this process (and so every rank it starts) may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):      # not Linux
        return max(1, os.cpu_count() or 1)


def time_shared_slowdown(measured: dict[str, float], cores: int) -> dict[str, float]:
    """The compute slowdown a CPU profile prices, from the measured one (``slowdown_factors``):
    as measured up to one rank per core, and beyond it the cores' time sharing,

        factor(k) = max(1, measured(c)) * k / c      for k > c = min(cores, largest count),

    every rank getting c/k of a core whose contention the c-rank reading holds.

    Why not the oversubscribed counts' own readings: on the 2-core VM the quick profile's
    4-rank factor read 1.98-2.96 over ten calibrations (2.07 in the full shipped one), and the
    readings above about 2.3 were the machine's state in those seconds (a calibration right
    after a heavy job read 2.96), not its state while plans ran: every world-4 plan priced
    with them came out 10-40 % slow. Repriced over the same 100 pairings of ten runs' measured
    steps and fresh quick profiles, the world-4 plans' median |error| went 10.6 -> 7.4 %
    (in-sample) and 14.2 -> 12.6 % (held-out), one profile's median signed error -6..+39 % ->
    -7..+10 % (``benchmarks/cross_reprice.py --time-shared-slowdown 2`` (removed; git 172578b^),
    ``reports/benchmarks/prediction_cross_reprice_ten_runs_time_shared*.txt`` (removed; git 172578b^)). The readings
    stay in the profile (``samples["compute_slowdown_measured"]``) and its calibration report."""
    table = {str(k): float(v) for k, v in measured.items()}
    counts = sorted(int(k) for k in table)
    if not counts:
        return table
    c = max((k for k in counts if k <= max(1, int(cores))), default=counts[0])
    base = max(1.0, table[str(c)])
    out = dict(table)
    for k in counts:
        if k > c:
            out[str(k)] = round(base * k / c, 4)
    return out


def _collective_rank(rank, world, kinds, sizes, repeats, warmup, device):
    return coll.measure_rank(rank, world, kinds, sizes, repeats, warmup, device)


# ---- driver -------------------------------------------------------------------------------

def _overhead_rank(rank, world, prof):
    return (measure_runtime_overhead_s(profile=prof), *measure_runtime_overhead_by_family(prof),
            measure_grad_reducer())


def _check_backend(backend: str, world_size: int) -> str:
    """Return the device for ``backend``; CalibrationError if it cannot run here."""
    if backend == "gloo":
        return "cpu"
    if backend != "nccl":
        raise CalibrationError(f"unknown backend {backend!r}", "use gloo (CPU) or nccl (CUDA)")
    import torch

    if not torch.cuda.is_available():
        raise CalibrationError("backend nccl needs CUDA, and no CUDA device is available here",
                               "use --backend gloo on this machine")
    n = torch.cuda.device_count()
    if world_size > n:
        raise CalibrationError(f"nccl calibration at world size {world_size} needs {world_size} "
                               f"GPUs, this machine has {n}", f"use --world-size {n} or less")
    return "cuda"


def default_output_path(backend: str = "gloo") -> Path:
    """``<repo>/calibration/cpu-<cores>core-gloo.json`` (or ``cuda-<gpus>gpu-nccl.json``)."""
    folder = Path(__file__).resolve().parents[2] / "calibration"
    if backend == "nccl":
        import torch

        return folder / f"cuda-{torch.cuda.device_count()}gpu-nccl.json"
    return folder / f"cpu-{os.cpu_count()}core-{backend}.json"


def calibrate(quick: bool, world_size: int, backend: str, out: Path | None,
              progress: Callable[[str], None] = print, exact_specs: list | None = None, *,
              sweep: Sweep | None = None, command: str | None = None,
              timeout_s: float = 600.0, start_method: str | None = None) -> Path:
    """Measure this machine and write a profile to ``out`` (atomically, at the very end).

    ``out=None`` means ``default_output_path(backend)`` (calibration/cpu-2core-gloo.json here).

    ``sweep`` overrides the QUICK/FULL presets (tests pass ``TINY``); ``command`` is recorded
    in the provenance (default: this process's argv); ``start_method`` defaults to fork for
    gloo and spawn for nccl (CUDA cannot be used in forked children).

    Call it from a process that has not trained or run kernels itself (the command,
    ``python -m autopar.calibrate.run``, or ``autopar calibrate``): forked ranks inherit the
    caller's malloc state (``runtime.memory``). Measured in a process that had just run one
    small training step, the 2-rank straggler sigma read 0.0050 s^0.5 against 0.0109 from a
    fresh process, and the in-situ latency 1.98 against 2.33 ms (medians of four, alternated:
    ``benchmarks/bench_calibration_caller.py`` (removed; git 172578b^)), and the prediction benchmark, which had
    calibrated that way, predicted its world-2 plans low.
    """

    t_start = time.perf_counter()
    if world_size < 1:
        raise CalibrationError(f"world size must be >= 1, got {world_size}", "use --world-size 2 or more")
    device = _check_backend(backend, world_size)
    out = Path(out) if out is not None else default_output_path(backend)
    sw = sweep or (QUICK if quick else FULL)
    method = "spawn" if device == "cuda" else rank_launch.start_method_for(backend, start_method)
    import torch  # noqa: F401  (imported before forking, so that children start fast)
    import torch.distributed  # noqa: F401

    load_before = os.getloadavg()
    mode = "quick" if quick else "full"
    progress(f"calibrating ({mode}, world size {world_size}, {backend}/{device}) -> {out}")
    if load_before[0] > 0.5:
        progress(f"  note: load average {load_before[0]:.2f}: other work on this machine skews "
                 "the timings; calibrate on a quiet machine")

    def launch(fn, world, args):
        return rank_launch.run_ranks(fn, world, args, backend=backend, timeout_s=timeout_s,
                         start_method=method)

    def stamp() -> str:
        return f"[{time.perf_counter() - t_start:6.1f}s]"

    # 1. kernels
    kernel_samples: dict[str, list] = {}
    probe_readings: list[float] = []
    for op in sw.op_classes:
        t0 = time.perf_counter()
        n_cfg = (sw.conv_configs or sw.kernel_configs) if op.startswith("conv") else sw.kernel_configs
        max_flops = (sw.conv_max_flops or sw.kernel_max_flops) if op.startswith("conv") else sw.kernel_max_flops
        configs = kernels.sweep_configs(op, n_cfg, max_flops,
                                        sw.kernel_max_numel, conv_min_flops=sw.conv_min_flops)
        kernel_samples[op], readings = launch(_kernel_rank, 1, (op, configs, sw, device))[0]
        probe_readings += readings
        progress(f"{stamp()} kernels {op}: {len(configs)} sizes in {time.perf_counter() - t0:.1f} s")
    exact, exact_samples = {}, {}
    if exact_specs:
        t0 = time.perf_counter()
        exact, exact_samples, readings = launch(_exact_rank, 1, (list(exact_specs), sw.exact_repeats, device))[0]
        probe_readings += readings
        progress(f"{stamp()} exact shapes: {len(exact)} in {time.perf_counter() - t0:.1f} s")
    # every kernel time stated at one speed of the machine: the median probe reading
    speed_probe = speed.speed_entry(probe_readings)
    for rows in kernel_samples.values():
        speed.normalize_rows(rows, speed_probe["nominal_s"])
    exact = speed.normalize_exact(exact, _exact_probes(exact_samples), speed_probe["nominal_s"])
    if speed_probe["nominal_s"]:
        progress(f"{stamp()} machine speed probe: {len(probe_readings)} readings, nominal "
                 f"{speed_probe['nominal_s'] * 1e3:.2f} ms, spread {100 * speed_probe['spread']:.0f} % "
                 "(kernel times stated at the nominal speed)")

    # 2. compute slowdown: every count next to a 1-rank window of the same round
    window_s = sw.slowdown_window_s / sw.slowdown_rounds
    per_rank = launch(_slowdown_rank, world_size, (window_s, device, sw.slowdown_rounds))
    measured_slowdown, ratios, slow_times = slowdown_factors(per_rank, world_size, sw.slowdown_rounds, window_s)
    cores = usable_cores()
    slowdown = time_shared_slowdown(measured_slowdown, cores) if device == "cpu" else measured_slowdown
    progress(f"{stamp()} compute slowdown ({sw.slowdown_rounds} rounds): " + ", ".join(
        f"{k} ranks x{v:.2f}" + (f" ({min(ratios[int(k)]):.2f}-{max(ratios[int(k)]):.2f})" if int(k) > 1 else "")
        + (f" -> x{slowdown[k]:.2f} (time sharing {cores} cores)" if slowdown[k] != v else "")
        for k, v in measured_slowdown.items()))

    # 3. collectives
    coll_samples: dict[str, dict] = {kind: {} for kind in sw.kinds}
    for p in collective_group_sizes(world_size, sw.coll_groups):
        t0 = time.perf_counter()
        per_rank = launch(_collective_rank, p, (tuple(sw.kinds), tuple(sw.message_sizes),
                                                sw.coll_repeats, sw.coll_warmup, device))
        for kind, rows in coll.combine_ranks(per_rank).items():
            coll_samples[kind][str(p)] = rows
        progress(f"{stamp()} collectives, group size {p}: {len(sw.kinds)} kinds x "
                 f"{len(sw.message_sizes)} sizes in {time.perf_counter() - t0:.1f} s")

    # 4. fits
    kernel_models, coll_models = fit_models(kernel_samples, coll_samples)

    elapsed = time.perf_counter() - t_start
    prof = Profile(
        schema=PROFILE_SCHEMA,
        fingerprint=current_fingerprint(backend),
        provenance={
            "kind": "measured",
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command if command is not None else " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "notes": (f"{mode} calibration at world size {world_size} on one node "
                      f"({os.cpu_count()} CPU cores visible); kernels on 1 thread per rank; "
                      "collectives.*.inter are NOT measured (copies of intra, measured=false)"),
            "mode": mode,
            "world_size": world_size,
            "elapsed_s": round(elapsed, 1),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "sweep": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(sw).items()},
        },
        topology={"ranks_per_node": world_size, "nodes": 1},
        kernels=kernel_models,
        collectives=coll_models,
        exact=exact,
        compute_slowdown=slowdown,
        samples={"kernels": kernel_samples, "collectives": coll_samples,
                 "compute_slowdown": slow_times, "compute_slowdown_measured": measured_slowdown,
                 "cores": cores, "exact": exact_samples, "speed_probe": speed_probe},
    )
    fitted = derived_models(prof, kernel_samples)
    intense = [c for c in fit.INTENSITY_BYTES_PER_FLOP if (prof.kernels.get(c) or {}).get("intensity_model")]
    if intense:
        progress(f"{stamp()} arithmetic-intensity kernel models (index per element, per-edge products), mean of "
                 "per-form held-out medians: " + ", ".join(
                     f"{c} {100 * prof.kernels[c]['intensity_model']['stratified_heldout_median_rel_err']:.0f} % "
                     f"(otherwise {100 * prof.kernels[c]['intensity_model']['previous_stratified_heldout_median_rel_err']:.0f} %)"
                     for c in intense))
    if fitted:
        progress(f"{stamp()} shape- and cache-aware kernel models, held-out median error: " + ", ".join(
            f"{c} {100 * ((prof.kernels[c].get('shape_model') or prof.kernels[c].get('cache_model'))['heldout_median_rel_err'] or 0):.0f} % "
            f"(flat {100 * (prof.kernels[c].get('heldout_median_rel_err') or 0):.0f} %)" for c in fitted))
    backward = [c for c in prof.kernels if (prof.kernels[c] or {}).get("bwd_model")]
    if backward:
        progress(f"{stamp()} measured backward (instead of 2 x forward), held-out median error: " + ", ".join(
            f"{c} {100 * (prof.kernels[c]['bwd_model']['heldout_median_rel_err'] or 0):.0f} %" for c in backward))
    steps = measure_step_costs(prof, world_size, iters=sw.insitu_iters, launch=launch,
                               worlds=sorted({2, world_size}) if quick and world_size >= 2 else None)
    progress(f"{stamp()} in-step costs (blocking-collective latency in situ, straggler factor, "
             f"optimizer): {describe_step_costs(steps)}")
    overhead_s, by_family, native_by_family, reducer = launch(_overhead_rank, 1, (prof,))[0]
    add_runtime_overhead(prof, overhead_s, by_family, native_by_family)
    progress(f"{stamp()} runtime per-op cost beyond the kernel model: {overhead_s * 1e6:.1f} us; per family "
             + ", ".join(f"{f} {v * 1e6:.1f}" for f, v in by_family.items()) + " us (natively: "
             + ", ".join(f"{f} {v * 1e6:.1f}" for f, v in native_by_family.items()) + " us)")
    if reducer is not None:
        prof.samples["grad_reducer"] = reducer
        progress(f"{stamp()} torch DDP's reducer beyond its all-reduces: {reducer['fixed_s'] * 1e6:.0f} us a step + "
                 f"{reducer['per_tensor_s'] * 1e6:.2f} us per parameter tensor + "
                 f"{reducer['per_byte_s'] * 1e12:.0f} us per MB of gradients")
    # the whole calibration (kernels, collectives, in-step costs, per-op overhead), as timed
    # by a caller around ``calibrate``; ``elapsed`` above stopped before the in-step costs
    prof.provenance["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    prof.provenance["elapsed_kernels_collectives_s"] = round(elapsed, 1)
    save_profile(prof, out)
    if device == "cpu":      # this machine's speed history (``profile.history``): CPU probes only
        record(speed_probe.get("nominal_s"), "calibrate")
    progress(f"{stamp()} wrote {out} (calibration took {prof.provenance['elapsed_s']:.1f} s; kernels and "
             f"collectives {elapsed:.1f} s of it)")
    return out


def fit_models(kernel_samples: dict, coll_samples: dict) -> tuple[dict, dict]:
    """The flat kernel models (``fit.fit_kernel``) and the collective models
    (``fit.fit_collective``, intra-node; "inter" a marked copy) of the raw samples."""
    kernel_models = {}
    for op, rows in kernel_samples.items():
        if len(rows) < 3:
            raise CalibrationError(f"only {len(rows)} sizes measured for {op}",
                                   "increase the sweep")
        m = fit.fit_kernel([r["flops"] for r in rows], [r["bytes"] for r in rows],
                           [r["median_s"] for r in rows])
        kernel_models[op] = {**m, "measured": True}
    return kernel_models, fit_collective_models(coll_samples)


def fit_collective_models(coll_samples: dict, stat: str = "median_s") -> dict:
    """The collective models (``fit.fit_collective`` of each kind and group size's sweep rows,
    by their ``stat`` time: the median, as calibration fits them; ``benchmarks/cross_reprice.py
    --collective-stat mean``, removed, git 172578b^, tried the mean), intra-node, "inter" a marked copy."""
    coll_models: dict[str, dict] = {}
    for kind, per_p in coll_samples.items():
        intra = {}
        for p, rows in per_p.items():
            m = fit.fit_collective(kind, int(p), [r["nbytes"] for r in rows],
                                   [r[stat] for r in rows])
            intra[p] = {**m, "measured": True, "source": f"measured, {p} ranks on one node"}
        if not intra:
            continue
        # One node measured: "inter" is NOT measured. It repeats the intra constants so that a
        # plan can still be priced, and says so in every entry.
        inter = {p: {**e, "measured": False,
                     "heldout_median_rel_err": None, "heldout_max_rel_err": None,
                     "source": "NOT MEASURED: copy of intra (single-node calibration)"}
                 for p, e in intra.items()}
        coll_models[kind] = {"intra": intra, "inter": inter}
    return coll_models


def derived_models(prof, kernel_samples: dict) -> list[str]:
    """The shape-, cache-, intensity-aware and backward models fitted on ``prof``'s flat ones
    (``fit.add_shape_models``), and per class swept in several forms (the GNN kernels) each
    form's held-out error under the model the cost model uses. Returns the classes whose shape-
    or cache-aware model was kept."""
    fitted = fit.add_shape_models(prof)
    for op, rows in kernel_samples.items():
        forms = fit.heldout_by_form(rows, features=fit.model_features(prof.kernels[op]))
        if len(forms) > 1:
            prof.kernels[op]["by_form"] = forms
    return fitted


def refit_profile(prof) -> None:
    """Fit every kernel and collective model of ``prof`` again from its raw samples, in place,
    with the fits of this autopar (what a profile measured before a change of ``fit`` would
    have been fitted to); the measured in-step costs and per-op overheads are kept. Only a
    profile measured on one node (``calibrate``), whose samples hold every sweep."""
    ks = (prof.samples or {}).get("kernels") or {}
    cs = (prof.samples or {}).get("collectives") or {}
    if not ks or not cs:
        raise CalibrationError("the profile has no raw kernel or collective samples to fit again",
                               "calibrate this machine again")
    kernel_models, coll_models = fit_models(ks, cs)
    for op, m in kernel_models.items():
        prof.kernels[op] = m
    prof.collectives.update(coll_models)
    derived_models(prof, ks)


def refit_conv_shape_models(prof) -> list[str]:
    """Fit the shape-aware convolution models of ``prof`` again, from its sweep rows and every
    exact shape in it (``fit.conv_shape_rows``), so that the layers measured on this machine
    teach the generic model what the sweep's random shapes do not: a model never measured is
    then priced from real layers too (with the fit of ``fit.nnls_relative``, the held-out CNNs'
    convolutions measured 1.00 / 1.08 / 0.95x their generic price, forward / backward-data /
    backward-filter, against 1.38 / 1.58 / 1.24x before: ``benchmarks/reprice_prediction.py
    --before relative-fit``, removed, git 172578b^). Returns the classes that have a shape-aware model after it (one that does not
    generalise better than the flat roofline is not kept, ``fit.add_conv_shape_models``)."""
    for cls in ("conv_fwd", "conv_bwd_data", "conv_bwd_filter"):
        if isinstance(prof.kernels.get(cls), dict):
            prof.kernels[cls].pop("shape_model", None)
    return [c for c in fit.add_conv_shape_models(prof) if prof.kernels[c].get("shape_model")]


def add_exact_shapes(profile_path, specs: list, progress: Callable[[str], None] = print,
                     repeats: int | None = None, timeout_s: float = 600.0) -> Path:
    """Measure exact layer shapes (``kernels.measure_exact``) into an existing profile.

    Shapes already in the profile are skipped. The profile must have been measured on this
    machine (a datasheet profile, or one from another host, would mix two machines' numbers:
    CalibrationError). The updated profile replaces the old one atomically.
    """

    path = Path(profile_path)
    prof = load_profile(path, check_machine=False)
    backend = prof.fingerprint.get("backend") or "gloo"
    require_measured_here(prof, path, "exact shapes")
    device = _check_backend(backend, 1)
    todo, seen = [], set(prof.exact)
    for spec in specs:
        key = shape_key(spec)
        if key not in seen:
            seen.add(key)
            todo.append(spec)
    if not todo:
        progress(f"exact shapes: all {len(specs)} already in {path}")
        return path
    import torch  # noqa: F401  (before forking)

    reps = repeats or int(prof.provenance.get("sweep", {}).get("exact_repeats", FULL.exact_repeats))
    t0 = time.perf_counter()
    progress(f"exact shapes: measuring {len(todo)} new shape(s) ({len(specs) - len(todo)} known)")
    exact, samples, readings = rank_launch.run_ranks(_exact_rank, 1, (todo, reps, device), backend=backend,
                                         timeout_s=timeout_s,
                                         start_method="spawn" if device == "cuda" else None)[0]
    nominal = speed.profile_nominal_s(prof)    # stated at the speed the profile's kernels are
    exact = speed.normalize_exact(exact, _exact_probes(samples), nominal)
    prof.exact.update(exact)
    prof.samples.setdefault("exact", {}).update(samples)
    refitted = refit_conv_shape_models(prof)
    prof.provenance.setdefault("exact_added", []).append(
        {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
         "shapes": len(exact), "repeats": reps, "conv_models_refitted": refitted,
         "speed_probe_readings_s": [float(f"{x:.6g}") for x in readings],
         "stated_at_nominal_s": nominal})
    save_profile(prof, path)
    progress(f"exact shapes: {len(exact)} measured in {time.perf_counter() - t0:.1f} s, "
             f"written to {path}" + (f"; the generic convolution models refitted with them ({', '.join(refitted)})"
                                     if refitted else ""))
    return path


def main(argv=None) -> int:
    """``python -m autopar.calibrate.run [--quick] [--world-size N] [--backend B] [--out P]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m autopar.calibrate.run")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--out", type=Path, default=None, help="default: calibration/cpu-<cores>core-gloo.json")
    ap.add_argument("--plots", type=Path, default=None, help="also write fit plots to this folder")
    a = ap.parse_args(argv)
    cmd = "python -m autopar.calibrate.run " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        path = calibrate(a.quick, a.world_size, a.backend, a.out, command=cmd)
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if a.plots:

        for p in plot_fits(load_profile(path), a.plots):
            print(f"plot: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
