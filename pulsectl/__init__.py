"""pulsectl: lossless, compact diffs of safetensors checkpoints."""

__version__ = "0.2.1"
