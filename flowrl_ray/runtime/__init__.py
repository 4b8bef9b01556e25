"""Ray lives here and nowhere else: the driver loop (trainer.py), which Ray a run uses
(cluster.py), the rollout worker and learner actors (actors.py), the metrics sinks (metrics.py,
tracking.py for W&B / MLflow, dashboard.py for the Ray dashboard's gauges), Ray Tune sweeps
(tune.py), seed-controlled comparisons (compare.py) and Ray Serve deployment (serve.py).
Import the submodules directly."""
