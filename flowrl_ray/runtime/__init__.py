"""Ray lives here and nowhere else: the driver loop (trainer.py), the rollout worker and learner
actors (actors.py), and the metrics sinks (metrics.py). Import the submodules directly."""
