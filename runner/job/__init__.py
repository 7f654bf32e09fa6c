"""The job around the training processes: compose and resolve it (job), check what it composed
before Hydra acts on it (composed), check it before it runs (preflight), launch its processes on
one node or several (launch, rendezvous), sweep it (sweep), follow and stop it (lifecycle), write
a cluster's job files (cluster) and re-run it (repro)."""
