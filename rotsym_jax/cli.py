"""The `rotsym` command line. Subcommands:

    rotsym demo [--cache-dir DIR] [--epochs N] [--seeds A B]
        Train (or load from the cache) two small ViTs on scikit-learn's digits from different
        seeds and report each one's test accuracy and that of their plain parameter average.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

from . import digits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rotsym", description="Align and merge transformers through their parameter-space symmetries."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="two ViTs trained on digits from different seeds, and their naive average"
    )
    demo.add_argument(
        "--cache-dir", default=None,
        help="root of the trained-model cache (default: $ROTSYM_CACHE, else ./.cache/rotsym_jax)",
    )
    demo.add_argument(
        "--epochs", type=_positive, default=digits.TrainSettings().epochs,
        help="training epochs per model (default: %(default)s)",
    )
    demo.add_argument(
        "--seeds", type=int, nargs=2, default=(0, 1), metavar=("A", "B"),
        help="the two models' seeds (default: 0 1)",
    )
    demo.set_defaults(run=_demo, error=demo.error)
    args = parser.parse_args(argv)
    return args.run(args)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _demo(args) -> int:
    start = time.perf_counter()
    if args.seeds[0] == args.seeds[1]:
        args.error("--seeds must differ: the point is two independently trained models")
    data = digits.load_digits()
    config = digits.vit_config()
    settings = dataclasses.replace(digits.TrainSettings(), epochs=args.epochs)
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
    # The naive merge: leaf-wise mean, with no alignment of the two models' hidden units.
    # (In NumPy: eager JAX would compile one kernel per leaf shape, for a one-off sum.)
    average = jax.tree.map(lambda *leaves: np.mean(leaves, axis=0), *(m.params for m in models))
    rows.append(("plain average", score(models[0].checkpoint, average), "", None))

    print(f"{'model':<16}{'test acc':>9}  {'source':<8}{'time':>8}")
    for name, acc, source, seconds in rows:
        print(f"{name:<16}{acc:>9.1%}  {source:<8}{'' if seconds is None else f'{seconds:.1f} s':>8}")
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
