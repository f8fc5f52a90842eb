"""Placeholder: replaced by the real VIT family module."""

from .family import Family

VIT = Family(name="vit", model_types=(), build=None, tensors=None, detect=None, architecture=None)
