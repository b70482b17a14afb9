"""Tournament training (LTFB, Jacobs et al., CLUSTER 2019): T trainers, each a group of ranks
running its own plan on its own sub-mesh and data shard; every ``interval`` steps partners
exchange models and each keeps whichever does better on its own held-out tournament set.

* ``pricing``   plan time: price T trainers (step, exchange, evaluation, data ingestion), pick T
                (imports the planner; never imported by the runtime);
* ``runtime``   run time: pairing, exchange, evaluation, the liveness board (no solver, tracer
                or cost imports, like ``autopar.runtime``);
* ``launch``    the launcher that keeps the surviving trainers when one dies;
* ``simulate``  the single-process reference (T replicas trained in turn, same tournaments);
* ``run``       ``autopar execute`` of a plan with a trainer level: run.json, report, plot.
"""
