"""Integration tests: a real local Ray (the Trainer, actors, Tune, Serve) or a real outside part
(robosuite / MuJoCo episodes, headless Chromium, the GFN2-xTB and MMFF force fields, QM9, W&B and
MLflow stores), and the slower in-process runs."""
