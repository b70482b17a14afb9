"""The calibration report: a table of every fit's held-out error and the plots beside it."""


def test_report_lists_every_fit_and_its_plots(tmp_path, profile):
    from autopar.calibrate.report import write_report
    profile.samples["insitu_latency_by_world_s"] = {"2": {"2": 0.001}, "4": {"2": 0.003, "4": 0.008}}
    path = write_report(profile, tmp_path / "rep", "synthetic.json")
    text = path.read_text()
    assert "# Calibration report: `synthetic.json`" in text
    for op in profile.kernels:
        if op != "runtime_op":
            assert f"| {op} |" in text
    for kind, levels in profile.collectives.items():
        for level, sizes in levels.items():
            for p in sizes:
                assert f"| {kind} | {level} | {p} |" in text
    assert "| 4 | 3.00 ms | 8.00 ms |" in text      # in-situ row: w = 4, p = 2 and 4
    for png in (tmp_path / "rep").glob("*.png"):
        assert f"]({png.name})" in text


def test_report_shows_the_slowdown_readings_beside_the_time_shared_factors(tmp_path, profile):
    from autopar.calibrate.report import write_report
    from autopar.calibrate.run import time_shared_slowdown
    read = {"1": 1.0, "2": 1.05, "4": 2.9}
    profile.compute_slowdown = time_shared_slowdown(read, 2)
    profile.samples["compute_slowdown_measured"] = read
    profile.samples["cores"] = 2
    text = write_report(profile, tmp_path / "rep", "p.json").read_text()
    assert "| factor | 1.00 | 1.05 | 2.10 |" in text
    assert "| measured | 1.00 | 1.05 | 2.90 |" in text
    assert "time sharing of the cores" in text
    # nothing restated (as many cores as ranks): no second row
    profile.compute_slowdown = dict(read)
    again = write_report(profile, tmp_path / "rep2", "p.json").read_text()
    assert "| measured | 1.00 |" not in again and "time sharing of the cores" not in again


def test_the_report_states_the_measured_gradient_reducer_and_its_rows():
    from autopar.calibrate.report import report_markdown
    from fakes import synthetic_profile
    prof = synthetic_profile()
    assert "DDP's reducer" not in report_markdown(prof, "p", [])
    prof.samples["grad_reducer"] = {"fixed_s": 2.5e-4, "per_tensor_s": 4.5e-6, "per_byte_s": 2e-10,
                                    "rows": [{"tensors": 4, "elements": 64, "reducer_s": 2.7e-4}]}
    md = report_markdown(prof, "p", [])
    assert "250 us a step + 4.50 us per parameter tensor + 200 us per MB of gradients" in md
    assert "4 x 64 floats 270 us" in md
