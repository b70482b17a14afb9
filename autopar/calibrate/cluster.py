"""Multi-node calibration of collectives, per link level: within a node and across nodes.

Run the same command on every node under ``torchrun`` (it is the launcher; nothing here starts
processes)::

    torchrun --nnodes K --nproc-per-node R --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m autopar.calibrate.cluster --out calibration/my-cluster.json [--quick] \\
        [--backend nccl] [--merge-into calibration/<single-node profile>.json]

Every rank reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (and torchrun's GROUP_RANK),
initialises the process group once, and all-gathers (hostname, node agent, local world size) to
find the node of every rank (``derive_node_map``; ``--ranks-per-node R`` overrides it with
``rank // R``). Then, with every subgroup created by ``new_group`` in the same order on every
rank (``plan_groups``):

* **intra**: groups of p = 2..R ranks of node 0 (a ladder of powers of two plus R when R > 8);
* **inter**: groups of one rank (local rank 0) per node on the first p = 2..K nodes (same
  ladder), and for K >= 2 the whole world (K nodes x R ranks) for reference, stored as the
  inter entry of group size K*R;
* **p2p** falls out of the p = 2 groups: local ranks 0 and 1 of node 0 (intra), local rank 0 of
  nodes 0 and 1 (inter).

Each group runs :func:`collectives.measure_rank` (same kinds, sizes, repeats and interleaving
as the single-node sweep); ranks outside the group wait in a ``gather_object`` to rank 0 (which
is in every group), so nobody deadlocks. Rank 0 combines (``combine_ranks``), fits
(``fit.fit_collective``: alpha-beta per kind, level and group size, with held-out errors) and
writes ONE profile atomically at the very end: an interrupted or failed run leaves any previous
file at ``--out`` untouched.

The profile holds collectives and the topology ``{ranks_per_node: R, nodes: K}`` only (no
kernels); ``--merge-into BASE`` writes instead BASE (a measured single-node profile: kernels,
compute slowdown, exact shapes, in-situ latency) with its collectives, collective samples and
topology replaced by the measured ones. BASE itself is rewritten only if ``--out`` is BASE.
``--from MEASURED.json --merge-into BASE --out OUT`` does the same merge later, without torchrun.

Simulation on one machine: ``--simulate-nodes K --ranks-per-node R`` (world = K*R, e.g.
``torchrun --standalone --nproc-per-node 4 -m autopar.calibrate.cluster --simulate-nodes 2
--ranks-per-node 2 --out /tmp/sim.json --quick``) treats ``rank // R`` as the node. Its "inter"
entries are then loopback between processes of ONE host: they carry ``"measured": "simulated"``
(not ``true``), a source saying so, and ``provenance.simulated = true``; loading such a profile
warns. The same marking applies whenever two "nodes" turn out to share a host.
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..errors import CalibrationError
from . import collectives as coll
from ..profile import fit
from ..profile.profile import (COLLECTIVES, PROFILE_SCHEMA, Profile, SIMULATED, current_fingerprint,
                               load_profile, save_profile)
from .run import FULL, QUICK, TINY
LADDER_ALL_UP_TO = 8  # up to this many ranks (nodes), every group size; beyond, powers of two


# ---- topology ------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeMap:
    """Which node every global rank is on, as measured (or simulated)."""

    node_ranks: tuple          # node_ranks[n] = sorted global ranks on node n (node 0 holds rank 0)
    hosts: tuple               # hostname of each node (its lowest rank's)
    simulated: bool            # some "nodes" share a host: inter-node links are loopback
    contiguous: bool           # node of rank r == r // ranks_per_node (what plans assume)

    @property
    def nodes(self) -> int:
        return len(self.node_ranks)

    @property
    def ranks_per_node(self) -> int:
        return len(self.node_ranks[0])

    @property
    def world(self) -> int:
        return sum(len(r) for r in self.node_ranks)


def rank_info(group_rank: str | None = None, local_world_size: int | None = None) -> dict:
    """What each rank contributes to ``derive_node_map`` (all-gathered)."""
    return {"host": socket.gethostname(),
            "group_rank": group_rank if group_rank is not None else os.environ.get("GROUP_RANK"),
            "local_world_size": local_world_size if local_world_size is not None
            else int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)}


def derive_node_map(infos: Sequence[dict], ranks_per_node: int | None = None,
                  simulate_nodes: int | None = None) -> NodeMap:
    """Nodes from the all-gathered ``rank_info`` of every rank (index = global rank).

    Without overrides, a node is one (hostname, torchrun agent) pair; every node must hold the
    same number of ranks. ``ranks_per_node`` (with or without ``simulate_nodes``) makes rank r's
    node ``r // ranks_per_node`` instead. Nodes that share a hostname make the layout simulated.
    """
    world = len(infos)
    if simulate_nodes is not None:
        if simulate_nodes < 1:
            raise CalibrationError(f"--simulate-nodes must be >= 1, got {simulate_nodes}",
                                   "give the number of nodes to simulate")
        r = ranks_per_node if ranks_per_node is not None else world // simulate_nodes
        if r < 1 or r * simulate_nodes != world:
            raise CalibrationError(
                f"--simulate-nodes {simulate_nodes} x --ranks-per-node {ranks_per_node or r} "
                f"!= world size {world}",
                f"launch {simulate_nodes} x R processes (torchrun --nproc-per-node)")
        ranks_per_node = r
    if ranks_per_node is not None:
        if ranks_per_node < 1 or world % ranks_per_node:
            raise CalibrationError(f"--ranks-per-node {ranks_per_node} does not divide the world "
                                   f"size {world}", "pick a divisor of the world size")
        node_ranks = [list(range(n, n + ranks_per_node)) for n in range(0, world, ranks_per_node)]
        if simulate_nodes is None:
            for ranks in node_ranks:
                hosts = {infos[r]["host"] for r in ranks}
                if len(hosts) > 1:
                    raise CalibrationError(
                        f"--ranks-per-node {ranks_per_node} puts ranks of hosts {sorted(hosts)} "
                        f"on one node", "drop --ranks-per-node to use the hosts' own layout")
    else:
        keys: dict = {}
        for r, info in enumerate(infos):
            keys.setdefault((info["host"], info.get("group_rank")), []).append(r)
        node_ranks = sorted(keys.values(), key=min)
        sizes = {len(v) for v in node_ranks}
        if len(sizes) > 1:
            raise CalibrationError(
                f"nodes hold different numbers of ranks ({sorted(len(v) for v in node_ranks)}): "
                "a profile describes R ranks on each of K nodes",
                "launch the same --nproc-per-node on every node")
        lws = {int(i.get("local_world_size") or 0) for i in infos} - {0}
        if lws and lws != sizes:
            raise CalibrationError(f"LOCAL_WORLD_SIZE {sorted(lws)} does not match the ranks "
                                   f"found per host ({sorted(sizes)})",
                                   "pass --ranks-per-node R to say how ranks map to nodes")
    hosts = tuple(infos[ranks[0]]["host"] for ranks in node_ranks)
    rpn = len(node_ranks[0])
    contiguous = all(r // rpn == n for n, ranks in enumerate(node_ranks) for r in ranks)
    simulated = simulate_nodes is not None or len(set(hosts)) < len(hosts)
    return NodeMap(tuple(tuple(v) for v in node_ranks), hosts, simulated, contiguous)


def ladder(n: int) -> list[int]:
    """Group sizes measured for n ranks (nodes): 2..n, or powers of two below n plus n."""
    if n <= LADDER_ALL_UP_TO:
        return list(range(2, n + 1))
    sizes, p = [], 2
    while p < n:
        sizes.append(p)
        p *= 2
    return sizes + [n]


@dataclass(frozen=True)
class GroupSpec:
    level: str          # "intra" or "inter" (the profile table it fills)
    ranks: tuple        # global ranks, sorted; rank 0 is always in it
    nodes_spanned: int
    what: str           # human description for the entry's source

    @property
    def size(self) -> int:
        return len(self.ranks)


def plan_groups(layout: NodeMap) -> list[GroupSpec]:
    """The measured groups, in the order every rank creates and measures them."""
    groups = []
    node0 = layout.node_ranks[0]
    for p in ladder(layout.ranks_per_node):
        groups.append(GroupSpec("intra", tuple(node0[:p]), 1, f"{p} ranks on one node (node 0)"))
    leaders = [ranks[0] for ranks in layout.node_ranks]
    for p in ladder(layout.nodes):
        groups.append(GroupSpec("inter", tuple(sorted(leaders[:p])), p,
                                f"{p} ranks, one per node on nodes 0..{p - 1}"))
    if layout.nodes >= 2 and layout.ranks_per_node >= 2:
        groups.append(GroupSpec("inter", tuple(range(layout.world)), layout.nodes,
                                f"the whole world: {layout.nodes} nodes x "
                                f"{layout.ranks_per_node} ranks"))
    return groups


# ---- measurement (inside an initialised process group) -------------------------------------

@dataclass(frozen=True)
class Options:
    out: Path
    sweep_name: str = "full"             # "full", "quick" or "tiny" (tests)
    backend: str = "gloo"
    ranks_per_node: int | None = None
    simulate_nodes: int | None = None
    merge_into: Path | None = None
    command: str = ""
    sweep: object = None                 # a ``run.Sweep`` overriding sweep_name (tests)


def _sweep(name: str):
    try:
        return {"full": FULL, "quick": QUICK, "tiny": TINY}[name]
    except KeyError:
        raise CalibrationError(f"unknown sweep {name!r}", "use full, quick or tiny") from None


def _preflight(opts: Options):
    """On rank 0, before measuring: the merge base loads and is measured; out is writable."""
    base = None
    if opts.merge_into is not None:
        base = load_profile(opts.merge_into, check_machine=False)
        if base.provenance.get("kind") != "measured":
            raise CalibrationError(
                f"--merge-into {opts.merge_into} is a {base.provenance.get('kind')!r} profile: its "
                "kernels were not measured on this cluster",
                "merge into a profile measured on one node of it (`autopar calibrate`)")
    parent = Path(opts.out).resolve().parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        raise CalibrationError(f"cannot write {opts.out}: {probe} is not writable",
                               "pass --out in a writable folder")
    return base


def run_cluster(opts: Options, device: str = "cpu",
                progress: Callable[[str], None] = print) -> Path | None:
    """Measure and (rank 0) write the profile; every rank of the initialised world calls it.

    Returns ``opts.out`` on rank 0, None elsewhere. A failure on rank 0 before or after the
    measurements is sent to every rank, which raises the same CalibrationError.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    t_start = time.perf_counter()
    say = progress if rank == 0 else (lambda s: None)
    sweep = opts.sweep if opts.sweep is not None else _sweep(opts.sweep_name)

    def stamp() -> str:
        return f"[{time.perf_counter() - t_start:6.1f}s]"

    if world < 2:
        raise CalibrationError("a world of 1 rank has no collective to measure",
                               "launch R >= 2 ranks per node, or K >= 2 nodes")
    # Control traffic (layout, errors, results, and the wait of ranks outside a measured group)
    # goes over gloo: with nccl, a rank waiting in an NCCL collective would spin its GPU and its
    # proxy thread's CPU core next to the ranks being measured.
    ctrl = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def agree(fn):
        """Run ``fn`` on rank 0 and hand its error (if any) to every rank."""
        box = [None]
        value = None
        if rank == 0:
            try:
                value = fn()
            except CalibrationError as e:
                box = [(e.message, e.hint)]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        if box[0] is not None:
            raise CalibrationError(*box[0])
        return value

    infos = [None] * world
    dist.all_gather_object(infos, rank_info(), group=ctrl)
    layout = derive_node_map(infos, opts.ranks_per_node, opts.simulate_nodes)
    base = agree(lambda: _preflight(opts))
    load_before = os.getloadavg()
    groups = plan_groups(layout)
    say(f"multi-node calibration ({opts.sweep_name if opts.sweep is None else 'custom'} sweep, "
        f"{opts.backend}/{device}): "
        f"{layout.nodes} node(s) x {layout.ranks_per_node} ranks, hosts {list(layout.hosts)}"
        f"{' (SIMULATED nodes on one host: inter = loopback)' if layout.simulated else ''} "
        f"-> {opts.out}")
    if not layout.contiguous:
        say("  note: ranks are not numbered node by node (rank // ranks_per_node); measured "
            "groups follow the real nodes, plans assume contiguous numbering")
    if layout.nodes < 2:
        say("  note: one node: nothing across nodes to measure ('inter' will copy 'intra', "
            "measured=false)")

    # Every rank creates every subgroup, in the same order (new_group is collective).
    handles = [None if g.size == world else dist.new_group(list(g.ranks)) for g in groups]
    results = []
    for spec, handle in zip(groups, handles):
        t0 = time.perf_counter()
        mine = None
        if rank in spec.ranks:
            mine = coll.measure_rank(spec.ranks.index(rank), spec.size, tuple(sweep.kinds),
                                     tuple(sweep.message_sizes), sweep.coll_repeats,
                                     sweep.coll_warmup, device, group=handle)
        # Non-members wait here (rank 0 is in every group), so nobody runs ahead.
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=ctrl)
        if rank == 0:
            results.append((spec, coll.combine_ranks([gathered[r] for r in spec.ranks])))
        say(f"{stamp()} {spec.level} p={spec.size} ({spec.what}): {len(sweep.kinds)} kinds x "
            f"{len(sweep.message_sizes)} sizes in {time.perf_counter() - t0:.1f} s")

    def finish():
        prof = build_profile(layout, results, sweep, opts, elapsed_s=time.perf_counter() - t_start,
                             loadavg_before=load_before)
        if base is not None:
            prof = merge_profiles(base, prof, opts.merge_into, command=opts.command)
        save_profile(prof, opts.out)
        return opts.out

    out = agree(finish)
    say(f"{stamp()} wrote {opts.out}" + (f" (merged into a copy of {opts.merge_into})"
                                         if base is not None else ""))
    return out


# ---- profile -------------------------------------------------------------------------------

def _source(spec: GroupSpec, layout: NodeMap) -> str:
    if spec.level == "inter" and layout.simulated:
        return (f"SIMULATED, NOT a real inter-node link: {spec.what}, but every 'node' is a set "
                f"of processes on ONE host (loopback, host {layout.hosts[0]})")
    hosts = sorted({layout.hosts[n] for n in range(layout.nodes)
                    if set(layout.node_ranks[n]) & set(spec.ranks)})
    return (f"measured, {spec.level}: {spec.what} (hosts {', '.join(hosts)}); multi-node "
            f"calibration of {layout.nodes} nodes x {layout.ranks_per_node} ranks")


def build_profile(layout: NodeMap, results: list, sweep, opts: Options, elapsed_s: float = 0.0,
                  loadavg_before=None):
    """The collectives-only profile from ``[(GroupSpec, combine_ranks output), ...]``."""

    tables: dict[str, dict] = {}
    samples = {"intra": {}, "inter": {}}
    for spec, combined in results:
        for kind, rows in combined.items():
            m = fit.fit_collective(kind, spec.size, [r["nbytes"] for r in rows],
                                   [r["median_s"] for r in rows])
            measured = SIMULATED if (spec.level == "inter" and layout.simulated) else True
            tables.setdefault(kind, {"intra": {}, "inter": {}})[spec.level][str(spec.size)] = {
                **m, "measured": measured, "source": _source(spec, layout),
                "level": spec.level, "nodes_spanned": spec.nodes_spanned}
            samples[spec.level].setdefault(kind, {})[str(spec.size)] = rows
    colls = {}
    for kind in COLLECTIVES:
        if kind not in tables:
            continue
        t = tables[kind]
        # A level that cannot be measured here (one node; one rank per node) copies the other
        # one so that plans can be priced, and says so, as the single-node calibration does.
        for missing, other, why in (("inter", "intra", "one node"),
                                    ("intra", "inter", "one rank per node")):
            if not t[missing] and t[other]:
                t[missing] = {p: {**e, "measured": False, "level": missing,
                                  "heldout_median_rel_err": None,
                                  "heldout_max_rel_err": None,
                                  "source": f"NOT MEASURED: copy of {other} ({why})"}
                              for p, e in t[other].items()}
        if t["intra"] and t["inter"]:
            colls[kind] = t
    mode = opts.sweep_name if opts.sweep is None else "custom"
    sim_note = ("SIMULATED MULTI-NODE CALIBRATION: the 'inter' entries were measured between "
                "processes on ONE host (loopback), marked measured='simulated'; they are NOT a "
                "real inter-node link. " if layout.simulated else "")
    provenance = {
        "kind": "measured",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": opts.command,
        "notes": (f"{sim_note}multi-node calibration of collectives ({mode}): {layout.nodes} "
                  f"node(s) x {layout.ranks_per_node} ranks, hosts {', '.join(layout.hosts)}; "
                  "intra = groups within node 0, inter = one rank per node plus the whole "
                  "world. Collectives only (no kernels): merge into a single-node profile "
                  "(--merge-into) to plan with it."),
        "multi_node": True,
        "nodes": layout.nodes,
        "ranks_per_node": layout.ranks_per_node,
        "hostnames": list(layout.hosts),
        "simulated": layout.simulated,
        "contiguous_ranks": layout.contiguous,
        "backend": opts.backend,
        "mode": mode,
        "world_size": layout.world,
        "groups": [{"level": g.level, "size": g.size, "nodes_spanned": g.nodes_spanned,
                    "ranks": list(g.ranks) if g.size <= 64 else f"{g.size} ranks"}
                   for g, _ in results],
        "elapsed_s": round(elapsed_s, 1),
        "loadavg_before": [round(x, 2) for x in (loadavg_before or os.getloadavg())],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "sweep": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(sweep).items()
                  if k in ("message_sizes", "coll_repeats", "coll_warmup", "kinds")},
    }
    return Profile(
        schema=PROFILE_SCHEMA,
        fingerprint=current_fingerprint(opts.backend),
        provenance=provenance,
        topology={"ranks_per_node": layout.ranks_per_node, "nodes": layout.nodes},
        kernels={},
        collectives=colls,
        exact={},
        compute_slowdown={"1": 1.0},
        samples={"collectives": samples["intra"], "collectives_inter": samples["inter"]},
    )


_MERGE_FP_FIELDS = ("cpu_model", "gpu_model", "torch_version", "device", "backend")


def merge_profiles(base, measured, base_path=None, command: str = ""):
    """A copy of ``base`` (single-node: kernels, slowdown, exact shapes, in-situ latency) whose
    collectives, collective samples and topology are ``measured``'s; neither input changes."""
    if not measured.provenance.get("multi_node"):
        raise CalibrationError("the profile to merge from is not a multi-node calibration",
                               "use the output of `python -m autopar.calibrate.cluster`")
    new = copy.deepcopy(base)
    new.collectives = copy.deepcopy(measured.collectives)
    new.topology = dict(measured.topology)
    for key in ("collectives", "collectives_inter"):
        new.samples[key] = copy.deepcopy(measured.samples.get(key, {}))
    differs = [k for k in _MERGE_FP_FIELDS
               if base.fingerprint.get(k) != measured.fingerprint.get(k)]
    prov = copy.deepcopy(base.provenance)
    mp = copy.deepcopy(measured.provenance)
    mp["fingerprint"] = measured.fingerprint
    if differs:
        mp["fingerprint_differs_from_base"] = differs
    prov["multi_node"] = mp
    prov["merged"] = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                      "base": str(base_path) if base_path is not None else None,
                      "command": command}
    base_notes = str(base.provenance.get("notes", ""))
    base_notes = base_notes.replace("; collectives.*.inter are NOT measured (copies of intra, "
                                    "measured=false)", "")
    prov["notes"] = (f"kernels, compute slowdown, exact shapes and in-situ latency: {base_notes} "
                     f"| collectives and topology replaced by: {measured.provenance['notes']}")
    new.provenance = prov
    return new


def merge_files(measured_path, base_path, out_path, command: str = "",
                progress: Callable[[str], None] = print) -> Path:
    """``merge_profiles`` on files; writes ``out_path`` atomically (never ``base_path`` unless
    it is ``out_path``)."""

    measured = load_profile(measured_path, check_machine=False)
    base = load_profile(base_path, check_machine=False)
    if base.provenance.get("kind") != "measured":
        raise CalibrationError(f"--merge-into {base_path} is a {base.provenance.get('kind')!r} "
                               "profile: its kernels were not measured on this cluster",
                               "merge into a profile measured on one node of it")
    merged = merge_profiles(base, measured, base_path, command=command)
    differs = merged.provenance["multi_node"].get("fingerprint_differs_from_base")
    if differs:
        progress(f"warning: {base_path} and {measured_path} differ in {', '.join(differs)}: "
                 "its kernels may not describe the cluster's nodes")
    save_profile(merged, out_path)
    progress(f"wrote {out_path} (kernels from {base_path}, collectives from {measured_path})")
    return Path(out_path)


# ---- entry point ---------------------------------------------------------------------------

def torchrun_command(nodes: int, ranks_per_node: int, out, quick: bool = False,
                     backend: str = "gloo", merge_into=None, endpoint: str = "HOST:29500") -> str:
    """The command to run on each of ``nodes`` nodes (``autopar calibrate --nodes``)."""
    parts = ["torchrun", f"--nnodes {nodes}", f"--nproc-per-node {ranks_per_node}",
             "--rdzv-backend c10d", f"--rdzv-endpoint {endpoint}", "-m autopar.calibrate.cluster",
             f"--out {out}"]
    if quick:
        parts.append("--quick")
    if backend != "gloo":
        parts.append(f"--backend {backend}")
    if merge_into:
        parts.append(f"--merge-into {merge_into}")
    return " ".join(parts)


def _parser():
    import argparse

    ap = argparse.ArgumentParser(
        prog="torchrun ... -m autopar.calibrate.cluster",
        description="Measure collectives within and across nodes; run on every node under "
                    "torchrun (see the module docstring).")
    ap.add_argument("--out", type=Path, required=True, help="profile to write (atomically)")
    ap.add_argument("--quick", action="store_true", help="the short sweep (as autopar calibrate --quick)")
    ap.add_argument("--sweep", choices=["full", "quick", "tiny"], default=None,
                    help="sweep preset (tiny: tests only); default full, or quick with --quick")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="override: rank r is on node r // R (default: from the hostnames)")
    ap.add_argument("--simulate-nodes", type=int, default=None,
                    help="simulate K nodes on this host (rank // R); inter is marked 'simulated'")
    ap.add_argument("--merge-into", type=Path, default=None,
                    help="write this single-node profile with its collectives and topology "
                         "replaced by the measured ones (to --out; the input is kept)")
    ap.add_argument("--from", dest="from_", type=Path, default=None,
                    help="merge this already measured cluster profile (no torchrun, no measuring)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds a rank may wait for its peers (process-group timeout)")
    return ap


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    cmd = "python -m autopar.calibrate.cluster " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        if a.from_ is not None:
            if a.merge_into is None:
                raise CalibrationError("--from needs --merge-into BASE", "name the profile to merge into")
            merge_files(a.from_, a.merge_into, a.out, command=cmd)
            return 0
        return _main_ranks(a, cmd)
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


def _main_ranks(a, cmd: str) -> int:
    from datetime import timedelta

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise CalibrationError("RANK / WORLD_SIZE are not set: this module runs under torchrun",
                               "launch it with `torchrun ... -m autopar.calibrate.cluster` on "
                               "every node (or `autopar calibrate --nodes K --ranks-per-node R` "
                               "prints the command)")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = "cpu"
    if a.backend == "nccl":
        if not torch.cuda.is_available():
            raise CalibrationError("backend nccl needs CUDA, and no CUDA device is available here",
                                   "use --backend gloo on this machine")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = "cuda"
    opts = Options(out=a.out, sweep_name=a.sweep or ("quick" if a.quick else "full"),
                   backend=a.backend, ranks_per_node=a.ranks_per_node,
                   simulate_nodes=a.simulate_nodes, merge_into=a.merge_into, command=cmd)
    dist.init_process_group(a.backend, timeout=timedelta(seconds=a.timeout))
    try:
        run_cluster(opts, device=device, progress=lambda s: print(s, flush=True))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
