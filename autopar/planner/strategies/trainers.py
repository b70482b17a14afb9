"""Tournament training (LTFB) as a job-level strategy (``autopar plan --trainers T|auto``): each
trainer count T (the given one, or every divisor of the world with ``auto``) a candidate, one
trainer of ``world / T`` ranks planned by ``make_plan`` (the ordinary per-layer ILP and
plan-level strategies) and the job priced by ``autopar.tournament.pricing.price_trainers``; the
one chooser (``planner.strategies.choose``) picks:

* ``cost_s`` = 1 / the job's predicted samples per second (the tournament's objective: most
  samples per second);
* memory = the trainer plan's predicted memory + the partner's state received in an exchange
  (held to the limit by the chooser's rule);
* priority = T (ties keep fewer trainers).

A T whose trainer cannot be planned is a candidate illegal with the planner's reason. When none
is legal, ``refuse`` raises ``TrainersError`` naming the trainer counts that fit, then every
candidate's reason. ``realize`` writes the chosen trainer plan with its trainer level (and
every T priced first in its ``strategies`` list)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...artifacts import StrategyAlternative, TrainerLevel, check_trainer_level
from ...errors import AutoparError
from ...modelfile import load_model_file
from ...tournament.pricing import (IngestionModel, TournamentPlanResult, TrainersError, check_tournament_data,
                                   divisors, model_buffers, price_trainers, sample_bytes_of)
from ..load import load_calibration
from ..write import default_plan_dir, rel_path, write_module, write_plan_file
from .registry import Candidate, LevelPrediction, choose, register_strategy, why_none_fits

NAME = "trainers"
PER = "sample of the whole job (1 / predicted samples per second)"


@dataclass(frozen=True)
class _Job:
    """What every trainer count of one offer shares (kept in each candidate's ``detail``)."""
    mf: Any
    profile: Any
    rpn: int
    topts: Any               # TournamentOptions with the ingestion model resolved
    metric: str
    auto: bool


@register_strategy
class Trainers:
    name = NAME
    priority = 0
    level = "job"
    cli_flag = "--trainers"      # the ``autopar plan`` option that asks for this level

    def _candidate(self, job, sh: _Job, T: int) -> Candidate:
        """Trainer count ``T`` planned and priced (illegal with the planner's reason when a
        trainer of ``N / T`` ranks cannot be planned)."""
        options, N = job.options, job.options.world_size
        n = N // T
        o = dataclasses.replace(options, world_size=n, write=False, nodes=None, ranks_per_node=sh.rpn)
        label = f"{T} trainer(s) x {n} ranks"
        try:
            res = job.make_plan(job.model_file, o, dataclasses.replace(job.hooks, progress=None, profile=sh.profile))
        except AutoparError as e:
            row = {"trainers": T, "ranks_per_trainer": n, "error": str(e).splitlines()[0][:120]}
            return Candidate(NAME, label, illegal=row["error"], runtime="tournament", priority=T, detail=(row, None, sh))
        B = res.plan.model.batch_size
        row = price_trainers(res.plan, T, sh.profile, sh.topts, sh.rpn, options.memory_limit_bytes,
                             sh.topts.sample_bytes or sample_bytes_of(sh.mf, B), options.optimizer_state_per_param,
                             buffers=model_buffers(sh.mf, res.plan))
        sps = row["samples_per_s"]
        pred = LevelPrediction(1.0 / sps if sps > 0 else float("inf"), PER, row["step_s"], row["memory_per_rank_bytes"])
        return Candidate(NAME, label, pred, runtime="tournament", priority=T, detail=(row, res.plan, sh))

    def offer(self, job):
        options, topts, say = job.options, job.level_options, job.say
        N = options.world_size
        auto = topts.trainers == "auto"
        if not auto and N % int(topts.trainers):
            raise TrainersError(f"--trainers {topts.trainers} does not divide the world size {N}",
                                f"choose T among the divisors {divisors(N)} (smallest feasible T: 1), or --trainers auto")
        mf = load_model_file(job.model_file)
        profile = job.hooks.profile
        if profile is None:
            _, profile = load_calibration(options.calibration)
        rpn = int(options.ranks_per_node or profile.topology.get("ranks_per_node", N))
        metric = topts.metric or ("model_file" if hasattr(mf.module, "tournament_metric") else "loss")
        ing = topts.ingestion or IngestionModel.from_profile(profile)
        sh = _Job(mf, profile, rpn, dataclasses.replace(topts, ingestion=ing), metric, auto)
        out = []
        for T in (divisors(N) if auto else [int(topts.trainers)]):
            c = self._candidate(job, sh, T)
            row = c.detail[0]
            say(f"T = {T}: " + (row["error"] if row.get("error") else
                                f"{row['samples_per_s']:.1f} samples/s predicted ({row['ranks_per_trainer']} ranks "
                                f"per trainer)"))
            out.append(c)
        return tuple(out)

    @staticmethod
    def _rows(choice) -> list[dict]:
        """Every T priced, ``fits_memory`` as the chooser's rule said."""
        rows = []
        for c in choice.candidates:
            row = dict(c.detail[0])
            if not row.get("error"):
                row["fits_memory"] = c.illegal is None
            rows.append(row)
        return rows

    def refuse(self, job, choice):
        """No T legal: name the trainer counts that fit (the smaller ones: more ranks per
        trainer), then every candidate's reason."""
        options, topts = job.options, job.level_options
        N = options.world_size
        first = choice.candidates[0]
        sh = first.detail[2]
        tried = {c.priority for c in choice.candidates}
        feas = [T for T in divisors(N) if T not in tried
                and choose([self._candidate(job, sh, T)], options.memory_limit_bytes).chosen is not None]
        row = first.detail[0]
        why = row.get("error") or (f"needs {row['memory_per_rank_bytes'] / 2**20:.1f} MiB per rank (plan + the "
                                   f"partner's model received in the exchange) over the limit "
                                   f"{options.memory_limit_bytes / 2**20:.1f} MiB")
        lines = why_none_fits(choice.candidates, "job")
        e = TrainersError(
            f"--trainers {topts.trainers} leaves trainers of {N // first.priority} ranks too small "
            f"for the plan's memory: {why}; every trainer count priced: "
            + "; ".join(ln for ln in lines if ln.startswith(NAME)),
            (f"use --trainers {max(feas)} or fewer (smallest feasible T: {min(feas)}; feasible: {feas})"
             if feas else "no trainer count fits: raise --memory-limit"))
        e.strategies = tuple(lines)
        raise e

    def realize(self, job, choice) -> TournamentPlanResult:
        """Write the chosen trainer plan with its trainer level."""
        options, topts = job.options, job.level_options
        N = options.world_size
        best, plan, sh = choice.chosen.detail
        rows = self._rows(choice)
        T = best["trainers"]
        B = plan.model.batch_size
        tour = sh.topts.tournament_samples or 2 * B
        train = sh.topts.train_samples_per_trainer or 8 * B
        chosen_row = next(r for r in rows if r["trainers"] == T)
        level = TrainerLevel(
            trainers=T, ranks_per_trainer=N // T, interval_steps=sh.topts.interval_steps,
            pairing_seed=sh.topts.pairing_seed, exchange=sh.topts.exchange, metric=sh.metric,
            train_samples_per_trainer=int(train), tournament_samples=int(tour), data_seed=sh.topts.data_seed,
            predicted={k: v for k, v in chosen_row.items() if not isinstance(v, (list, dict))},
            candidates=tuple(rows) if sh.auto else (),
            extra={"world_size": N, "ingestion_model": dataclasses.asdict(sh.topts.ingestion),
                   "pricing": "autopar.tournament.pricing (formulas in its docstring)"})
        check_trainer_level(level, plan.world_size, B, "the tournament plan")
        check_tournament_data(sh.mf, B, T * (level.train_samples_per_trainer + level.tournament_samples))
        out_dir = Path(options.out_dir) if options.out_dir is not None else Path(
            str(default_plan_dir(sh.mf.name, N)) + f"-t{T}")
        alts = tuple(StrategyAlternative.from_json(c.to_json(c is choice.chosen)) for c in choice.candidates)
        plan = dataclasses.replace(plan, trainers=level, strategies=alts + tuple(plan.strategies))
        plan_path = module_path = None
        if options.write:
            # the model path is relative to the plan's folder
            plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model,
                                                                       path=rel_path(Path(job.model_file), out_dir)))
            module_path = write_module(plan, out_dir)
            plan_path = write_plan_file(plan, out_dir)
        return TournamentPlanResult(plan, plan_path, module_path, rows, T)
