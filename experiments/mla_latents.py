"""MLA's latents rotated or permuted (MATH §17, `--latents rotation`): the weight distance after
alignment of two tiny DeepSeek-V3 causal LMs, with the latents' permutations (the default) and with
their rotations (each latent's RMSNorm gain folded into its readers first), on two kinds of pair:

- "seeds": two inits of different seeds, each trained the same steps on the same synthetic text;
- "fine-tunes": one init trained, then fine-tuned twice on two other synthetic texts.

Training moves the latents' gains off 1, so the fold is not trivial. Both alignments run on the
folded models (the same function as stored), so their distances are in the same coordinates; the
permutation on the models as stored is listed beside them (other coordinates: the gains unfolded).
Each row also gives the loss of the midpoint (A + B') / 2 on held-out text.

    PYTHONPATH=.:experiments python experiments/mla_latents.py [--steps 300] [--out experiments/results/mla_latents.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import transformers as tf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import rotsym_jax as rj  # noqa: E402
from rotsym_experiments.results_io import device_result_path, provenance, write_json  # noqa: E402
from rotsym_jax.pytree import flatten  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
              n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
              max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False)
SEQ, BATCH = 32, 16


def markov_text(seed: int, n: int) -> np.ndarray:
    """(n, SEQ) tokens of a random sparse Markov chain (each token followed by one of 4 others)."""
    rng = np.random.default_rng(seed)
    vocab = CONFIG["vocab_size"]
    nxt = rng.integers(1, vocab, size=(vocab, 4))
    x = np.zeros((n, SEQ), np.int32)
    x[:, 0] = rng.integers(1, vocab, n)
    for t in range(1, SEQ):
        x[:, t] = nxt[x[:, t - 1], rng.integers(0, 4, n)]
    return x


def lm_loss(ck, params, ids):
    logits = ck.apply(params, input_ids=ids)["logits"]
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def train(ck, params, text: np.ndarray, steps: int, seed: int, lr: float = 3e-3):
    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(params, state, ids):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(ck, p, ids))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(seed)
    loss = None
    for _ in range(steps):
        params, state, loss = step(params, state, jnp.asarray(text[rng.integers(0, len(text), BATCH)]))
    return params, float(loss)


def gain_spread(spec, params) -> float:
    """The largest std of a latent's norm gain: how far training moved the gains off uniform."""
    bound, flat = rj.bind(spec, params), flatten(params)
    return max(float(np.std(np.asarray(flat[p]))) for g in bound.perms if g.rotatable for m in g.members if m.role == "norm" for p in m.paths)


def compare(ck, spec, a, b, held_out) -> dict:
    fa, fb = rj.fold_latents(spec, a), rj.fold_latents(spec, b)
    out = {"gain_std": {"A": gain_spread(spec, a), "B": gain_spread(spec, b)}}
    runs = {"permutation (as stored)": (a, b, "permutation"), "permutation (folded)": (fa, fb, "permutation"),
            "rotation (folded)": (fa, fb, "rotation")}
    for name, (pa, pb, latents) in runs.items():
        t0 = time.perf_counter()
        r = rj.align(pa, pb, spec, latents=latents, heads="permute", fallback=False)
        seconds = time.perf_counter() - t0
        mid = jax.tree.map(lambda x, y: (x + y) / 2, pa, r.params)
        latent_kinds = {k: v for k, v in r.report["after"].items() if k in ("q_latent", "kv_latent", "qk", "vo")}
        out[name] = {"before": r.report["before"]["total"], "after": r.report["after"]["total"], "after_by_kind": latent_kinds,
                     "midpoint_loss": float(lm_loss(ck, mid, held_out)), "seconds": seconds}
        print(f"  {name:26s} distance {r.report['before']['total']:.4f} -> {r.report['after']['total']:.4f}   "
              f"midpoint loss {out[name]['midpoint_loss']:.4f}", flush=True)
    out["endpoint_loss"] = {"A": float(lm_loss(ck, a, held_out)), "B": float(lm_loss(ck, b, held_out))}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps of each model (the fine-tunes: half as many on top)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    config = tf.DeepseekV3Config(**CONFIG)
    ck = rj.init_checkpoint(config, jax.random.key(0), head="lm")
    spec = rj.spec_for(ck)
    text, held_out = markov_text(0, 2048), jnp.asarray(markov_text(0, 4096)[-64:])
    results = {**provenance(), "device": jax.devices()[0].device_kind, "config": CONFIG, "steps": args.steps, "pairs": {}}

    print("seeds: two inits, trained alike", flush=True)
    trained = []
    for seed in (0, 1):
        init = rj.init_checkpoint(config, jax.random.key(seed), head="lm").params
        params, loss = train(ck, init, text, args.steps, seed)
        trained.append(params)
        print(f"  seed {seed}: training loss {loss:.3f}", flush=True)
    results["pairs"]["seeds"] = compare(ck, spec, *trained, held_out)

    print("fine-tunes: one init trained, then two fine-tunes on other texts", flush=True)
    base = trained[0]
    tuned = [train(ck, base, markov_text(10 + i, 2048), args.steps // 2, 10 + i)[0] for i in (0, 1)]
    results["pairs"]["fine-tunes"] = compare(ck, spec, *tuned, held_out)
    out = args.out or device_result_path(HERE / "results", "mla_latents")
    write_json(results, out)


if __name__ == "__main__":
    main()
