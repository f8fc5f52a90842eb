"""Alignment speed: time per phase of `align` on real model shapes, batched attention solver
throughput against a per-head NumPy loop, and the peer check against the authors' numbers.

    .venv/bin/python benchmarks/align_speed.py [--shapes roberta-base bert-large llama-1b-8layers]
        [--pairs planted random] [--solver-only] [--out FILE]

Prints tables and writes benchmarks/results/align_speed.json (or --out).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import transformers as tf

import rotsym_jax as rj
from results_io import write_json
from rotsym_jax.align import _leaves, _solve_block, _unit_costs
from rotsym_jax.solvers import DEFAULT_POLAR_METHOD

SHAPES = {
    # vocab sizes are cut down: embeddings take no part in alignment and only cost memory here
    "roberta-base": lambda: tf.RobertaConfig(vocab_size=1000),
    "bert-large": lambda: tf.BertConfig(vocab_size=1000, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    # Llama-3.2-1B's layer shape (GQA 32 heads / 8 kv groups, SwiGLU 8192) with 8 of its 16 layers:
    # two full models, the moved copy and the cost matrices do not fit the 24 GiB machine.
    "llama-1b-8layers": lambda: tf.LlamaConfig(
        vocab_size=1000, hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, tie_word_embeddings=True,
    ),
}
KINDS_PLANTED = ("qk", "vo", "qk_scale", "vo_scale", "perm")  # heads stay fixed, as the paper's matching
NOISE = 0.01  # relative to each leaf's std


def make_pair(config, kind, seed=0):
    a = rj.init_checkpoint(config, jax.random.key(seed)).params
    if kind == "random":
        return a, rj.init_checkpoint(config, jax.random.key(seed + 1)).params
    spec = rj.spec_for(config)
    b = rj.apply_transform(spec, a, rj.random_transform(spec, a, jax.random.key(seed + 2), KINDS_PLANTED))
    keys = iter(jax.random.split(jax.random.key(seed + 3), 10_000))
    b = jax.tree_util.tree_map(lambda x: x + NOISE * jnp.std(x) * jax.random.normal(next(keys), x.shape, x.dtype), b)
    return a, b


def time_align(a, b, spec, repeats):
    rj.align(a, b, spec)  # compile
    runs = []
    for _ in range(repeats):
        result = rj.align(a, b, spec)
        runs.append(result.report["timings"])
    best = dict(min(runs, key=lambda t: t["total"]))
    best["perm_costs"] = min(_timed(lambda: perm_costs(a, b, spec)) for _ in range(repeats))
    return best, result.report


def perm_costs(a, b, spec):
    """The FFN cost matrices alone (inside `align` they overlap the host assignments)."""
    bound = rj.bind(spec, b)
    flat_a, flat_b = rj.pytree.flatten(a), rj.pytree.flatten(b)
    return jax.block_until_ready([_unit_costs(g, flat_a, flat_b, i) for g in bound.perms for i in range(len(g.layers))])


def numpy_loop_solve(leaves_a, leaves_b, block):
    """The straightforward loop: per layer and head, slice [W; b] of q, k (v, o), form the cross
    matrix and take its SVD (MATH §2). Multi-head attention only."""
    geo, out = block.geometry, []
    dh = geo.head_dim
    paths = {role: [m for m in block.members if m.role == role] for role in "qkvo"}

    def head_slice(leaves, role, i, h):
        parts = []
        for m in paths[role]:
            x = np.asarray(leaves[m.paths[i]])
            x = x[None] if x.ndim == 1 else (x.T if m.axis == 0 else x)
            parts.append(x[:, h * dh:(h + 1) * dh])
        return np.concatenate(parts)

    for i in range(len(block.layers)):
        for h in range(geo.num_heads):
            for a_side, b_side in (("q", "k"), ("v", "o")):
                m = head_slice(leaves_b, a_side, i, h).T @ head_slice(leaves_a, a_side, i, h)
                m += head_slice(leaves_b, b_side, i, h).T @ head_slice(leaves_a, b_side, i, h)
                u, _, vt = np.linalg.svd(m)
                out.append(u @ vt)
    return out


def solver_throughput(a, b, spec, repeats):
    """Attention solve from the raw leaves: ours (one jitted call) against the NumPy loop."""
    bound = rj.bind(spec, b)
    block = bound.attention[0]
    flat_a, flat_b = rj.pytree.flatten(a), rj.pytree.flatten(b)
    leaves_a, leaves_b = _leaves(flat_a, block), _leaves(flat_b, block)
    heads = len(block.layers) * block.geometry.num_heads
    res = {}
    for rescale in ("none", "sequential"):
        solve = lambda: jax.block_until_ready(_solve_block(block, leaves_a, leaves_b, None, "rotation", rescale, DEFAULT_POLAR_METHOD))
        solve()
        res[f"batched_{rescale}_s"] = min(_timed(solve) for _ in range(repeats))
    np_a, np_b = ({p: np.asarray(x) for p, x in leaves.items()} for leaves in (leaves_a, leaves_b))
    if block.geometry.heads_per_group == 1:
        res["numpy_loop_s"] = min(_timed(lambda: numpy_loop_solve(np_a, np_b, block)) for _ in range(max(1, repeats - 1)))
        res["speedup"] = res["numpy_loop_s"] / res["batched_none_s"]
        res["numpy_heads_per_s"] = heads / res["numpy_loop_s"]
    res["heads"] = heads
    res["batched_heads_per_s"] = heads / res["batched_none_s"]
    return res


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peer_check():
    """Two RobertaConfig() models initialised by transformers (torch seeds 0 and 1), the paper's
    matching (heads fixed, no rescale): attention and FFN distances before/after."""
    import torch

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        params = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            tf.RobertaModel(tf.RobertaConfig()).save_pretrained(f"{tmp}/{seed}")
            params.append(rj.load_hf(f"{tmp}/{seed}"))
        ck, a, b = params[0], params[0].params, params[1].params
        result = rj.align(a, b, rj.spec_for(ck), heads="fixed", rescale="none")
    for when, moved in (("before", b), ("after", result.params)):
        flat_a, flat_m = rj.pytree.flatten(a), rj.pytree.flatten(moved)
        sq = lambda pred: float(np.sqrt(sum(np.sum((np.asarray(flat_a[p], np.float64) - np.asarray(flat_m[p], np.float64)) ** 2) for p in flat_a if pred(p))))
        out[f"attention_{when}"] = sq(lambda p: "/attention/" in p)
        out[f"ffn_{when}"] = sq(lambda p: "/mlp/" in p)
    expected = {"attention_before": 150.50448, "attention_after": 136.92984, "ffn_before": 212.81400, "ffn_after": 203.30567}
    out["expected"] = expected
    out["max_rel_error"] = max(abs(out[k] - v) / v for k, v in expected.items())
    out["pass"] = out["max_rel_error"] <= 1e-4
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--pairs", nargs="+", default=["planted", "random"], choices=["planted", "random"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-peer-check", action="store_true")
    parser.add_argument("--solver-only", action="store_true", help="only the attention solve against the NumPy loop (no align timings, no peer check)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "align_speed.json"))
    args = parser.parse_args(argv)

    results = {"machine": {"platform": platform.platform(), "processor": platform.processor(), "devices": [str(d) for d in jax.devices()], "jax": jax.__version__}, "align": {}, "solver": {}}
    print(f"{'shape':14s} {'pair':8s} {'attention':>9s} {'ffn cost':>9s} {'assign':>8s} {'apply':>7s} {'total':>7s}   distance before -> after")
    for shape in args.shapes:
        config = SHAPES[shape]()
        spec = rj.spec_for(config)
        for pair in args.pairs:
            a, b = make_pair(config, pair)
            if not args.solver_only:
                timings, report = time_align(a, b, spec, args.repeats)
                results["align"][f"{shape}/{pair}"] = {"timings_s": timings, "distance_before": report["before"], "distance_after": report["after"]}
                print(f"{shape:14s} {pair:8s} {timings['attention']:9.3f} {timings.get('perm_costs', 0):9.3f} {timings.get('assignment', 0):8.3f} {timings['apply']:7.3f} {timings['total']:7.3f}   {report['before']['total']:.1f} -> {report['after']['total']:.1f}")
            results["solver"][f"{shape}/{pair}"] = solver_throughput(a, b, spec, args.repeats)
            del a, b
    print(f"\n{'shape/pair':23s} {'heads':>6s} {'batched (s)':>11s} {'+rescale (s)':>12s} {'heads/s':>8s} {'numpy loop (s)':>14s} {'speedup':>8s}")
    for shape, r in results["solver"].items():
        loop = f"{r['numpy_loop_s']:14.3f} {r['speedup']:7.1f}x" if "numpy_loop_s" in r else f"{'(GQA: n/a)':>14s}"
        print(f"{shape:23s} {r['heads']:6d} {r['batched_none_s']:11.3f} {r['batched_sequential_s']:12.3f} {r['batched_heads_per_s']:8.0f} {loop}")
    if not (args.no_peer_check or args.solver_only):
        results["peer_check"] = peer = peer_check()
        print("\npeer check (RobertaConfig(), torch seeds 0/1, heads fixed, no rescale):")
        for k, v in peer["expected"].items():
            print(f"  {k:17s} ours {peer[k]:.5f}  authors {v:.5f}")
        print(f"  max relative error {peer['max_rel_error']:.2e}: {'PASS' if peer['pass'] else 'FAIL'}")
    write_json(results, args.out)
    if not results.get("peer_check", {}).get("pass", True):
        raise SystemExit("peer check FAILED: the authors' distances are not reproduced")


if __name__ == "__main__":
    main()
