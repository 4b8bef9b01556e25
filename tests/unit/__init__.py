"""Unit tests: pure Python / PyTorch / NumPy, no Ray, no CLI subprocess, no browser, no simulator
episodes; each one fast. `pytest tests/unit` (`make test-unit`) runs them in under a minute."""
