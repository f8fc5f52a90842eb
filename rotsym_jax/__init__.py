"""rotsym_jax: align and merge transformers through their parameter-space symmetries."""

from .hf import Checkpoint, CheckpointError, init_checkpoint, load_hf, save_hf

__all__ = ["Checkpoint", "CheckpointError", "init_checkpoint", "load_hf", "save_hf"]
