"""``autopar execute``: ``runner`` (launch the ranks, write run.json) runs ``validate`` (one step
against one process), ``timing`` (timed and instrumented steps) and ``baseline`` (torch DDP)."""
