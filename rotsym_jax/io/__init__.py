"""Checkpoints and files: `hf` reads and writes Hugging Face folders from a family's record alone
(lazy safetensors, atomic writes), `recipe` the YAML merge recipes, `memory` the one memory model
that `--dry-run`, the automatic switch to streaming and the streaming plan share."""
