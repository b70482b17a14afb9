"""The CLI's plan and execute paths are found through the registries, not ``if`` chains: each
job-level strategy names the ``autopar plan`` option that asks for it (``cli_flag``) and has a
planner in ``cli.JOB_PLANNERS``; each kind of run ``autopar execute`` returns has a printer."""

from autopar import cli
from autopar.artifacts import RunResult, TournamentRun
from autopar.planner.strategies import STRATEGIES, level_of


def _plan_flags() -> dict[str, str]:
    """``autopar plan``'s option strings -> their argparse dest."""
    ap = cli.build_parser()
    sub = next(a for a in ap._actions if a.__class__.__name__ == "_SubParsersAction")
    return {o: a.dest for a in sub.choices["plan"]._actions for o in a.option_strings}


def test_every_job_level_strategy_is_asked_for_by_one_plan_flag_and_has_a_planner():
    jobs = {n: s for n, s in STRATEGIES.items() if level_of(s) == "job"}
    assert set(jobs) == set(cli.JOB_PLANNERS) == {"padding_buckets", "trainers"}
    flags = _plan_flags()
    for name, s in jobs.items():
        assert s.cli_flag in flags, name
        args = cli.build_parser().parse_args(["plan", "m.py", "--world-size", "4", s.cli_flag, "2"])
        assert cli._job_level_asked(args) == name
    assert cli._job_level_asked(cli.build_parser().parse_args(["plan", "m.py", "--world-size", "4"])) is None


def test_every_run_kind_has_a_printer():
    assert set(cli.RUN_PRINTERS) == {RunResult.kind, TournamentRun.kind}
