"""What ``autopar execute`` returns is one type, ``artifacts.ExecutedRun``: a ``RunResult`` for one
plan, a ``TournamentRun`` for a plan with a trainer level, each read from its run.json into typed
fields (no dict to index), written back as read, and refused by name when it is not a run."""

import copy

import pytest

from autopar.artifacts import (ExecutedRun, RunResult, TournamentRound, TournamentRun, TrainerStop,
                               load_tournament_run)
from autopar.errors import RunFileError
from autopar.io import atomic_write_json

TOUR = {
    "schema": "autopar.tournament-run/1", "created": "2026-12-04T06:00:00+00:00", "plan": "p/plan.json",
    "model": "ltfb_surrogate", "trainers": 2, "ranks_per_trainer": 2, "world_size": 4, "interval_steps": 2,
    "rounds": 2, "exchange": "weights", "metric": "loss", "dtype": "float64", "batch_per_trainer": 8,
    "options": {"rounds": 2, "seed": 0}, "wall_s": 3.5,
    "rounds_log": [{"round": 0, "step": 2, "alive": [0, 1], "pairs": [[0, 1]],
                    "results": [{"trainer": 0, "partner": 1, "metric_own": 0.5, "metric_partner": 0.7, "winner": 0,
                                 "kept": "own", "notes": "", "exchange_s": 0.001, "eval_s": 0.002, "wait_s": 0.0,
                                 "exchange_bytes": 128, "exchange_error": None},
                                {"trainer": 1, "partner": 0, "metric_own": "nan", "metric_partner": 0.5,
                                 "winner": 0, "kept": "partner", "notes": "non-finite", "exchange_s": 0.001,
                                 "eval_s": 0.002, "wait_s": 0.0, "exchange_bytes": 128, "exchange_error": None}]}],
    "trainers_detail": [{"trainer": 0, "ranks": [0, 1], "status": "finished", "stopped": None,
                         "metric_over_time": [[2, 0.5]], "step_s": 0.004},
                        {"trainer": 1, "ranks": [2, 3], "status": "stopped",
                         "stopped": {"round": 1, "step": 4, "reason": "killed", "seen_by": "the launcher",
                                     "after_s": 1.2, "launcher_saw": "exit 1"},
                         "metric_over_time": [], "step_s": None}],
    "stopped": [1],
    "measured": {"step_s": 0.004, "exchange_s": 0.001, "exchange_bytes": 256, "exchange_bytes_per_rank": 128,
                 "eval_s": 0.002, "tournament_s": 0.003, "samples_per_s": 900.0, "samples": 64, "span_s": 0.07,
                 "note": "medians"},
    "predicted": {"step_s": 0.0002, "exchange_s": 0.0001, "priced_dtype": "float64"},
    "validation": {"passed": True, "checked": 32, "max_rel_diff": 0.0, "winners_equal": True, "alive_equal": True,
                   "survivors": [0], "rule": "rtol 1e-9"},
}


def test_tournament_run_is_typed_and_written_back_as_read(tmp_path):
    run = TournamentRun.from_json(copy.deepcopy(TOUR))
    assert isinstance(run, ExecutedRun) and run.kind == "tournament" and run.passed is True
    assert isinstance(run.rounds_log[0], TournamentRound) and run.rounds_log[0].pairs == ((0, 1),)
    assert run.rounds_log[0].results[1].metric_own == "nan" and run.rounds_log[0].results[0].winner == 0
    assert isinstance(run.trainers_detail[1].stopped, TrainerStop) and run.trainers_detail[1].stopped.round == 1
    assert run.trainers_detail[0].stopped is None and run.stopped == (1,)
    assert run.measured.samples_per_s == 900.0 and run.validation.checked == 32
    assert run.to_json() == TOUR
    atomic_write_json(tmp_path / "run.json", TOUR)
    assert load_tournament_run(tmp_path / "run.json") == run


def test_a_skipped_check_is_neither_passed_nor_failed():
    obj = dict(copy.deepcopy(TOUR), validation={"skipped": "not asked (--no-validate)"})
    run = TournamentRun.from_json(obj)
    assert run.passed is None and run.validation.skipped.startswith("not asked")
    assert run.to_json()["validation"] == {"skipped": "not asked (--no-validate)"}


def test_not_a_tournament_run_is_refused_by_name():
    with pytest.raises(RunFileError, match="x.json has schema 'autopar.run/1'"):
        TournamentRun.from_json(dict(TOUR, schema="autopar.run/1"), "x.json")
    bad = copy.deepcopy(TOUR)
    del bad["trainers"]
    with pytest.raises(RunFileError, match="y.json is incomplete or malformed"):
        TournamentRun.from_json(bad, "y.json")


def test_a_plan_run_is_the_same_type():
    assert issubclass(RunResult, ExecutedRun) and RunResult.kind == "plan"
