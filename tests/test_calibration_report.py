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
