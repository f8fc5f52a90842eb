"""The `rotsym` command line. Subcommands:

    rotsym align A B OUT [--attention ...] [--heads ...] [--rescale ...] [--ffn ...] [--layers 0,3]
        Write OUT, a Hugging Face checkpoint folder holding B moved as close as possible to A by
        the symmetries (same function as B, B's dtypes and tokenizer), with rotsym_report.json
        (inputs, options, distances before/after per kind and per layer, timings, versions), a
        model card (README.md) and the recipe (rotsym_config.yaml).
    rotsym merge --method NAME A B [C ...] OUT [--align none|anchor|many] [--base BASE]
                 [--param k=v ...] [--seed N] [--dtype ...]
        Merge the models (A, the first, is the anchor: its task head and tokenizer are kept) with a
        registered merge method (`rotsym_jax.merge.METHODS`), after aligning them to A (anchor)
        or to a common reference (many), and write OUT like `align` does.
    rotsym barrier A B --data FILE --out DIR [--align none|anchor] [--points 11]
        The loss along the straight path from A to B, and to B aligned to A: barrier.json + .png.
    rotsym inspect A [B]
        Family, shapes, heads, parameter count and the symmetry groups of A; with B, the
        distances per kind and per layer before and after matching (nothing is written).
    rotsym demo [--cache-dir DIR] [--epochs N] [--seeds A B]
        Train (or load from the cache) two small ViTs on scikit-learn's digits from different
        seeds, align the second to the first (per-head rotations of Q/K and V/O, rescaling, FFN
        permutations) and report each model's test accuracy, the distance between them before and
        after alignment, and the accuracy of their parameter average without and with alignment.
        Needs the experiments package: pip install 'rotsym_jax[experiments]'.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time

import jax
import numpy as np

from . import commands as commands_cli
from .align import align
from .hf import spec_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rotsym", description="Align and merge transformers through their parameter-space symmetries."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="align two ViTs trained on digits from different seeds, then average them"
    )
    demo.add_argument(
        "--cache-dir", default=None,
        help="root of the trained-model cache (default: $ROTSYM_CACHE, else ./.cache/rotsym_jax)",
    )
    demo.add_argument(
        "--epochs", type=_positive, default=None,
        help="training epochs per model (default: the experiments' TrainSettings().epochs, 30)",
    )
    demo.add_argument(
        "--seeds", type=int, nargs=2, default=(0, 1), metavar=("A", "B"),
        help="the two models' seeds (default: 0 1)",
    )
    demo.set_defaults(run=_demo, error=demo.error)
    commands_cli.add_commands(commands)
    parser.add_argument("--version", action="version", version=f"rotsym_jax {commands_cli.version()}")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    return args.run(args)


def _experiments(module: str, error):
    """`rotsym_experiments.<module>`, imported when a command needs it (not with rotsym_jax)."""
    try:
        return importlib.import_module(f"rotsym_experiments.{module}")
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if missing not in ("rotsym_experiments", "sklearn"):
            raise
        error(f"this command needs the experiments extra ({missing} is not installed): "
              "pip install 'rotsym_jax[experiments]'")


def _cache_dir_problem(cache_root, cache_dir) -> str | None:
    """Why the cache root cannot hold the cache (it is created when missing), or None."""
    root = cache_root(cache_dir)
    if cache_dir:
        name = f"--cache-dir {root}"
    elif os.environ.get("ROTSYM_CACHE"):
        name = f"$ROTSYM_CACHE={root}"
    else:
        name = f"the default cache directory {root}"
    if root.exists() and not root.is_dir():
        return f"{name}: is not a directory (it exists as a file); give a directory for the trained-model cache"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{name}: cannot be created ({e.strerror or e}); give a writable directory"
    if not os.access(root, os.W_OK | os.X_OK):
        return f"{name}: is not writable; give a writable directory"
    return None


def enable_compilation_cache(directory) -> None:
    """Keep compiled XLA programs on disk (JAX's persistent compilation cache), so that a command
    run again on models of the same shapes skips compilation: on a GPU most of a first `align`.
    Every program is kept, however fast it compiled. A cache directory the user set for JAX
    (JAX_COMPILATION_CACHE_DIR) wins."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _demo(args) -> int:
    start = time.perf_counter()
    if args.seeds[0] == args.seeds[1]:
        args.error("--seeds must differ: the point is two independently trained models")
    digits = _experiments("digits", args.error)
    # Checked before anything is set or trained: the cache is first written after training.
    problem = _cache_dir_problem(digits.cache_root, args.cache_dir)
    if problem:
        args.error(problem)
    enable_compilation_cache(digits.cache_root(args.cache_dir) / "jax")
    data = digits.load_digits()
    config = digits.vit_config()
    settings = digits.TrainSettings()
    if args.epochs is not None:
        settings = dataclasses.replace(settings, epochs=args.epochs)
    print(
        f"digits: {len(data.train_labels)} train / {len(data.test_labels)} test images, 8x8, 10 classes\n"
        f"ViT: d={config.hidden_size}, {config.num_attention_heads} heads, {config.num_hidden_layers} layers, "
        f"mlp {config.intermediate_size}, patch {config.patch_size}; {settings.epochs} epochs of AdamW\n"
        f"cache: {digits.cache_root(args.cache_dir).absolute() / 'digits'}\n"
    )
    models = [digits.train_or_load(config, settings, s, data, args.cache_dir) for s in args.seeds]

    def score(checkpoint, params):
        return digits.accuracy(checkpoint, params, data.test_images, data.test_labels)

    rows = [
        (f"seed {m.seed}", score(m.checkpoint, m.params), "cache" if m.from_cache else "trained", m.seconds)
        for m in models
    ]
    # Leaf-wise mean (in NumPy: eager JAX would compile one kernel per leaf shape, for a one-off sum).
    average = lambda a, b: jax.tree.map(lambda x, y: (np.asarray(x) + np.asarray(y)) / 2, a, b)
    anchor, other = models[0].params, models[1].params
    rows.append(("plain average", score(models[0].checkpoint, average(anchor, other)), "", None))
    result = align(anchor, other, spec_for(models[0].checkpoint), attention="rotation", rescale="sequential", ffn="permutation")
    rows.append(("aligned average", score(models[0].checkpoint, average(anchor, result.params)), "", result.report["timings"]["total"]))
    moved_acc = score(models[1].checkpoint, result.params)

    print(f"{'model':<16}{'test acc':>9}  {'source':<8}{'time':>8}")
    for name, acc, source, seconds in rows:
        print(f"{name:<16}{acc:>9.1%}  {source:<8}{'' if seconds is None else f'{seconds:.1f} s':>8}")
    before, after = result.report["before"], result.report["after"]
    print(f"\nseed {args.seeds[1]} aligned to seed {args.seeds[0]} (rotation + rescale + FFN permutation); "
          f"its accuracy after alignment: {moved_acc:.1%} (function unchanged)")
    print(f"{'distance':<10}" + "".join(f"{k:>9}" for k in ("qk", "vo", "ffn", "other", "total")))
    for label, d in (("before", before), ("after", after)):
        print(f"{label:<10}" + "".join(f"{d[k]:>9.2f}" for k in ("qk", "vo", "ffn", "other", "total")))
    print(
        "\nThese two models start from different random initialisations, so their residual streams\n"
        "(embeddings, norms, the 'other' distance) live in unrelated bases that per-head rotations and\n"
        "FFN permutations do not touch: alignment brings the attention and FFN weights closer but the\n"
        "average stays poor. Matching pays off for models that share their residual stream, such as\n"
        "fine-tunes of one pretrained model (the paper's setting)."
    )
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
