"""Which of transformers' decoders without a record of ours are read with an inferred one.

Phase 1 (`--scan`): every model type in transformers' CONFIG_MAPPING without a record of ours, whose
causal LM builds from its config class with small sizes, is compared by tensor names with the small
models of our decoder types; the types with exactly the names of one of ours are listed (the
candidates `infer_record` would consider). Phase 2: for each listed type (or
`--types`), a small random model of the type is saved and `rotsym_jax.infer_record` run on it: read
as which record, with which element kinds proven, or refused and why. No downloads. Prints a table
and writes benchmarks/results/inferred_records.json.

    python benchmarks/inferred_records.py --scan
"""

from __future__ import annotations

import argparse
import re
import signal
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers as tf

from rotsym_experiments.results_io import provenance, write_json
from rotsym_jax.io.hf import CheckpointError, supported_model_types
from rotsym_jax.verify import infer_record

HERE = Path(__file__).resolve().parent
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# a scan's result at transformers 5 (phase 1), for runs without --scan
KNOWN = ("granite", "internlm3", "iquestcoder", "ministral3", "smollm3", "seed_oss", "olmo3")


def small_config(model_type: str):
    """The type's config class with the sizes small, its layer lists cut to match, and token ids
    inside the vocabulary."""
    config = tf.CONFIG_MAPPING[model_type]()
    layers = getattr(config, "num_hidden_layers", None)
    for key, value in SMALL.items():
        if hasattr(config, key):
            setattr(config, key, value)
    if getattr(config, "head_dim", None):
        config.head_dim = 8
    if getattr(config, "kv_lora_rank", None):  # multi-head latent attention: every head reads the latent (kv heads = heads)
        config.num_key_value_heads = config.num_attention_heads
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and layers and len(value) == layers:
            setattr(config, key, value[: SMALL["num_hidden_layers"]])
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= SMALL["vocab_size"]:
            setattr(config, key, None)
    return config


def names(model) -> set:
    return {re.sub(r"\.\d+\.", ".{i}.", n) for n in model.state_dict()}


def scan() -> dict:
    """{model type without a record: our types whose small models have exactly its tensor names}."""

    def give_up(*_):
        raise TimeoutError

    signal.signal(signal.SIGALRM, give_up)
    built = {}
    for model_type in sorted(tf.CONFIG_MAPPING.keys()):
        signal.alarm(10)  # a type whose small model does not build in 10 s is not a small decoder
        try:
            built[model_type] = frozenset(names(tf.AutoModelForCausalLM.from_config(small_config(model_type))))
        except BaseException:  # noqa: BLE001 (any failure: the type is not a decoder this scan can build)
            continue
        finally:
            signal.alarm(0)
    ours = {t: n for t, n in built.items() if t in supported_model_types()}
    return {t: sorted(o for o, on in ours.items() if on == n) for t, n in built.items()
            if t not in ours and any(on == n for on in ours.values())}


def infer(model_type: str) -> dict:
    torch.manual_seed(0)
    start = time.perf_counter()
    try:
        model = tf.AutoModelForCausalLM.from_config(small_config(model_type))
    except Exception as e:  # noqa: BLE001
        return {"outcome": "not built", "why": f"{type(e).__name__}: {str(e)[:300]}"}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        try:
            record = infer_record(tmp)
        except CheckpointError as e:
            return {"outcome": "refused", "why": str(e).removeprefix(tmp).lstrip(": ")[:600], "seconds": round(time.perf_counter() - start, 1)}
    return {"outcome": "read", "read_as": record.read_as, "proven": record.proven, "seconds": round(time.perf_counter() - start, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scan", action="store_true", help="find the candidates in CONFIG_MAPPING (else the list found at transformers 5)")
    parser.add_argument("--types", nargs="*", help="these model types instead")
    parser.add_argument("--out", default=str(HERE / "results" / "inferred_records.json"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    tf.utils.logging.set_verbosity_error()
    scanned = scan() if args.scan else None
    types = args.types or (sorted(scanned) if scanned is not None else list(KNOWN))
    rows = {}
    for model_type in types:
        rows[model_type] = infer(model_type)
        row = rows[model_type]
        detail = f"as {row['read_as']}, {len(row['proven'])} kinds proven" if row["outcome"] == "read" else row["why"][:160]
        names_of = f" (tensor names of {', '.join(scanned[model_type])})" if scanned else ""
        print(f"{model_type:14s} {row['outcome']:9s} {detail}{names_of}", flush=True)
    write_json({
        **provenance(), "device": "CPU (transformers' PyTorch models)", "transformers": tf.__version__,
        "scan": scanned,  # {type: our types with its tensor names}
        "types": rows,
    }, Path(args.out))


if __name__ == "__main__":
    main()
