"""Placeholder: replaced by the real GPT2 family module."""

from .family import Family

GPT2 = Family(name="gpt2", model_types=(), build=None, tensors=None, detect=None, architecture=None)
