"""commlens: communication analysis for distributed transformer training."""

__version__ = "0.1.0"
