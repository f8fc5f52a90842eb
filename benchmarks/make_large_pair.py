"""Write large random Llama-architecture (Llama, Qwen3, Mixtral) checkpoint pairs to disk without holding a model in memory.

    python benchmarks/make_large_pair.py OUT_DIR [--shape llama-3.2-3b] [--layers N] [--partners finetune independent]
        [--noise 0.01] [--seed 0] [--max-shard-gb 5]

OUT_DIR gets `a/` (a random model: weights N(0, 0.02), norm gains 1 + N(0, 0.02), bf16), and for
each partner asked for:
  `finetune/`: a fine-tune-like partner, B = T(A) + noise, T a random symmetry transform planted
      per layer (FFN permutations, per-kv-group QK rotations in the RoPE group or, under Qwen3's
      QK-norm, rotary-pair signs, VO rotations; under Mixtral the experts shuffled, with each expert's units;
      heads stay in place, as `heads="fixed"` assumes), the noise N(0, (noise * 0.02)^2) on
      every tensor; `finetune.json` holds the noise level ||B - T(A)|| over the body (what a
      perfect alignment leaves: the distance floor) and the distance before, and
      `finetune-planted.npz` the planted transforms;
  `independent/`: another random model (another seed): nothing to recover.
Each model is written layer by layer (`rotsym_jax.io.hf.ShardWriter`, shards <= --max-shard-gb), so
the generator's memory is that of one layer of three models.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.families.family import Layout
from rotsym_jax.pytree import flatten, unflatten

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=300, tie_word_embeddings=False),
    # Qwen3 (QK-norm: the planted QK elements are rotary-pair signs, MATH §9)
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645),
    # Mixtral (a sparse mixture of experts: the planted "perm" element shuffles the experts, with the
    # router's rows, and each expert's units)
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                         tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2),
    # Mixtral-8x7B at a quarter of its width (its experts' FLOPs per layer / 64)
    "mixtral-mini": dict(model_type="mixtral", hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=128, intermediate_size=3584, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                         tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2),
    "mixtral-tiny": dict(model_type="mixtral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, vocab_size=300, tie_word_embeddings=False,
                         max_position_embeddings=64),
    "qwen3-tiny": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=96, vocab_size=300, tie_word_embeddings=False, max_position_embeddings=64),
}
COMMON = dict(model_type="llama", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
              bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
STD = 0.02
PLANTED = ("qk", "vo", "perm")


def config_of(shape: str, layers: int | None) -> dict:
    raw = {**COMMON, **SHAPES[shape]}
    if shape == "tiny":
        raw["max_position_embeddings"] = 64
    if layers is not None:
        raw["num_hidden_layers"] = layers
    return raw


class _Model:
    """One output checkpoint being written: its folder, config and shard writer."""

    def __init__(self, folder: Path, raw: dict, rules, shapes: dict, max_shard_bytes: int, architecture: str):
        folder.mkdir(parents=True, exist_ok=False)
        (folder / "config.json").write_text(json.dumps({**raw, "architectures": [architecture]}, indent=2, sort_keys=True) + "\n")
        specs = {r.hf: (np.dtype(ml_dtypes.bfloat16), shapes[r.hf]) for r in rules}
        self.writer = hf.ShardWriter(folder, specs, max_shard_bytes)

    def write(self, rule, leaves: dict):
        tensor = rule.to_hf(tuple(np.asarray(leaves[p], np.float32) for p in rule.ours))
        self.writer.write(rule.hf, np.ascontiguousarray(tensor.astype(ml_dtypes.bfloat16)))


def _random(rng, shape, path) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(STD)
    if path.endswith("/scale"):  # RMSNorm gains around 1
        x += np.float32(1.0)
    return x


def _bf16(x) -> np.ndarray:
    """Rounded to bf16 and back: what the file holds, as the transform sees it."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="llama-3.2-3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (default: all)")
    parser.add_argument("--partners", nargs="+", default=["finetune", "independent"], choices=("finetune", "independent"))
    parser.add_argument("--noise", type=float, default=0.01, help="fine-tune noise, relative to the weights' std (default 0.01)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-gb", type=float, default=5.0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    raw = config_of(args.shape, args.layers)
    config = hf.read_config(raw)
    layout = Layout(prefix="model.", head="lm")
    family = hf.family_for(config.model_type)
    architecture = family.architecture(config, layout)
    rules = family.tensors(config, layout)
    shapes = family.shapes(config, layout)
    hf_shapes = {r.hf: tuple(r.to_hf(tuple(np.broadcast_to(np.zeros((), np.float32), shapes[p]) for p in r.ours)).shape) for r in rules}
    layer_of = {}
    for r in rules:
        parts = r.ours[0].split("/")
        layer_of[r.hf] = int(parts[1]) if parts[0] == "layers" else None
    max_shard = int(args.max_shard_gb * 2**30)
    args.out.mkdir(parents=True, exist_ok=True)
    models = {"a": _Model(args.out / "a", raw, rules, hf_shapes, max_shard, architecture)}
    for partner in args.partners:
        models[partner] = _Model(args.out / partner, raw, rules, hf_shapes, max_shard, architecture)
    rngs = {name: np.random.default_rng([args.seed, i]) for i, name in enumerate(["a", "noise", "independent"])}
    spec = dataclasses.replace(rj.spec_for(config), residual=None)
    noise_sq, before_sq, planted = 0.0, 0.0, {}
    key = jax.random.key(args.seed + 1)
    sigma = np.float32(args.noise * STD)

    def finetune(leaves_a: dict, moved: dict):
        """B's leaves: A moved by the planted transform plus noise; the noise level and the
        distance before, over every leaf (what `rotsym align` measures), as the files hold them."""
        nonlocal noise_sq, before_sq
        out = {}
        for p, x in moved.items():
            b = _bf16(np.asarray(x, np.float32) + sigma * rngs["noise"].standard_normal(x.shape, dtype=np.float32))
            out[p] = b
            noise_sq += float(np.sum(np.square((b - np.asarray(x, np.float32)).astype(np.float64))))
            before_sq += float(np.sum(np.square((b - leaves_a[p]).astype(np.float64))))
        return out

    layers = sorted({layer for layer in layer_of.values() if layer is not None})
    for layer in [None, *layers]:
        names = [r for r in rules if layer_of[r.hf] == layer]
        paths = [p for r in names for p in r.ours]
        leaves_a = {p: _bf16(_random(rngs["a"], shapes[p], p)) for p in paths}
        if "finetune" in models:
            moved = leaves_a
            if layer is not None:  # the planted transform, on this layer alone (renamed layer 0)
                local = {p.replace(f"layers/{layer}/", "layers/0/", 1): x for p, x in leaves_a.items()}
                key, k = jax.random.split(key)
                t = rj.random_transform(spec, unflatten(local), k, PLANTED)
                moved_local = flatten(rj.apply_transform(spec, unflatten(local), t))
                moved = {p: np.asarray(moved_local[p.replace(f"layers/{layer}/", "layers/0/", 1)]) for p in leaves_a}
                for name, element in t.items():
                    for field, value in dataclasses.asdict(element).items():
                        if value is not None:  # an orthogonal map has no inverse stored
                            planted.setdefault(f"{name}.{field}", []).append(np.asarray(value)[0])
            leaves_b = finetune(leaves_a, moved)
        for r in names:
            models["a"].write(r, leaves_a)
            if "finetune" in models:
                models["finetune"].write(r, leaves_b)
            if "independent" in models:
                models["independent"].write(r, {p: _bf16(_random(rngs["independent"], shapes[p], p)) for p in r.ours})
        print(f"layer {layer}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    for m in models.values():
        m.writer.finish()
    if "finetune" in models:
        np.savez(args.out / "finetune-planted.npz", **{k: np.stack(v) for k, v in planted.items()})
        info = {"shape": args.shape, "config": raw, "noise": args.noise, "seed": args.seed, "planted": list(PLANTED),
                "noise_level": math.sqrt(noise_sq), "distance_before": math.sqrt(before_sq),
                "note": "distances over every leaf, in float32 from the bf16 values written"}
        (args.out / "finetune.json").write_text(json.dumps(info, indent=2) + "\n")
    sizes = {name: sum(f.stat().st_size for f in (args.out / name).glob("*.safetensors")) for name in models}
    print(json.dumps({"seconds": time.perf_counter() - start, "bytes": sizes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
