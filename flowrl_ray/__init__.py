"""flowrl_ray: RL fine-tuning of generative policies on Ray."""
__version__ = "0.1.0"
