"""Flax NNX models of the supported transformer families and their HF name maps."""

from .bert import BERT, ROBERTA

# Each family module defines a `Family`; the loader picks one by config.model_type.
FAMILIES = (BERT, ROBERTA)
