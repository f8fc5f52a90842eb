"""The `rotsym` command line. Subcommands:

    rotsym align A B OUT [--attention ...] [--heads ...] [--rescale ...] [--ffn ...] [--layers 0,3] [--dtype ...]
        Write OUT, a Hugging Face checkpoint folder holding B moved as close as possible to A by
        the symmetries (same function as B, B's dtypes or --dtype, B's tokenizer), with rotsym_report.json
        (inputs, options, distances before/after per kind and per layer, timings, versions), a
        model card (README.md) and the recipe (rotsym_config.yaml).
    rotsym align RECIPE.yaml OUT
        Replay the recipe an align wrote (its models, options, data, seed, dtype and format).
    rotsym merge --method NAME A B [C ...] OUT [--align none|anchor|many] [--base BASE]
                 [--param k=v ...] [--weights W1,W2,...] [--seed N] [--dtype ...] [--format hf|orbax]
    rotsym merge CONFIG.yml OUT [--align none|anchor|many ...]
        A rotsym recipe, or a mergekit config run as it is (mergekit's methods, parameters, filters
        and gradients; its optional `rotsym:` block, or --align, aligns the models first).
    rotsym merge --method average RUN OUT --last K
        Checkpoint averaging: the last K steps of an Orbax training run, unaligned.
        Merge the models (A, the first, is the anchor: its task head and tokenizer are kept) with a
        registered merge method (`rotsym_jax.merge.METHODS`), after aligning them to A (anchor)
        or to a common reference (many), and write OUT like `align` does.
    rotsym barrier A B --data FILE --out DIR [--align none|anchor] [--points 11]
        The loss along the straight path from A to B, and to B aligned to A: barrier.json + .png.
    rotsym extract-lora BASE TUNED OUT [--rank R] [--sv-epsilon E] [--embed-lora] [--align ...]
        A PEFT LoRA adapter taking BASE towards TUNED, as mergekit-extract-lora extracts it (each
        linear module's delta by truncated SVD); --align first moves TUNED as close to BASE as the
        symmetries allow.
    rotsym moe CONFIG.yml OUT [--align ...] [--seed N]
        A Mixtral (from Llama or Mistral) or Qwen3-MoE (from Qwen3) mixture of experts, as mergekit-moe
        builds it from its config (the base's attention, norms and embeddings; each expert's FFN; routers from
        the experts' prompts); --align first moves each expert's model onto the base.
    rotsym convert-config IN.yaml OUT.yaml
        A rotsym recipe as a mergekit config (alignment in its rotsym: block), or a mergekit config
        as a recipe, where both compute the same merge (average = linear, task_arithmetic).
    rotsym inspect A [B] [--verify]
        Family, shapes, heads, parameter count and the symmetry groups of A; with B, the
        distances per kind and per layer before and after matching (nothing is written); with
        --verify, each group proven on A's weights in transformers.
    rotsym demo [--cache-dir DIR] [--epochs N] [--seeds A B]
        Train (or load from the cache) two small ViTs on scikit-learn's digits from different
        seeds, align the second to the first (per-head rotations of Q/K and V/O, rescaling, FFN
        permutations) and report each model's test accuracy, the distance between them before and
        after alignment, and the accuracy of their parameter average without and with alignment.
        Needs the experiments package: pip install 'rotsym_jax[experiments]'.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import os
import sys
import time
import warnings
from pathlib import Path

import rotsym_jax as rj

from .. import options
from ..errors import InputError
from ..version import version
from . import signals


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the message and where the usage is, not the usage itself)
    and, with `help_tail`, more help computed when --help asks for it."""

    def __init__(self, *args, help_tail=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._help_tail = help_tail

    def error(self, message):
        # a refusal raised while a signal's cleanup removes the run's files may be its doing: the
        # watcher ends the process with its one line (the fault trial's SIGINT as the temporary
        # folder appeared printed both)
        signals.wait_if_stopping()
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)\n")

    def format_help(self):
        return super().format_help() + (self._help_tail() if self._help_tail else "")


def _unrecognized(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    known = [o for action in parser._actions for o in action.option_strings]
    hints = [close[0] for u in unknown if u.startswith("-") and (close := difflib.get_close_matches(u.split("=")[0], known, n=1))]
    parser.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean {' / '.join(hints)}?)" if hints else ""))


def _merge_methods_help() -> str:
    """The registered merge methods and their parameters (imported for --help only: they need JAX,
    the parsers do not)."""
    lines = []
    for m in rj.merge.METHODS.values():
        needs = sorted(set(m.needs) & {"base", "fishers", "grams"})
        lines.append(f"  {m.name:<16} {m.help}" + (f"; needs {', '.join('--base' if n == 'base' else 'data (a recipe)' for n in needs)}" if needs else ""))
        lines += [f"  {'':<16}   {p.name}={p.default!r}: {p.help}" for p in m.params.values()]
    return "\nmerge methods (--method NAME, --param NAME=VALUE):\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The `rotsym` command. SIGINT, SIGTERM and SIGHUP end it with one line, its temporary files
    removed (`signals`); an OSError (a full disk, a folder that cannot be written) is one line too.
    A reader of the output that went away (`rotsym inspect A | head -1`) ends it quietly, with the
    code of a process that SIGPIPE ended (141), as other command-line tools end."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = " ".join(["rotsym", *[a for a in argv if not a.startswith("-")][:1]])
    with signals.handled(prog), warnings.catch_warnings():
        warnings.showwarning = functools.partial(_show_warning, prog)
        try:
            return _run(argv)
        except BrokenPipeError:
            return CLOSED_PIPE
        except OSError as e:
            signals.wait_if_stopping()
            print(f"{prog}: error: {os_error_line(e)}", file=sys.stderr)
            return 1


# 128 + SIGPIPE: the shell's code for a writer whose reader closed the pipe.
CLOSED_PIPE = 141


def console() -> None:
    """The `rotsym` executable: `main`, then the process ends at once, its output flushed, without
    Python's teardown, in which JAX frees every buffer and program and joins its threads (0.2-0.5 s
    of a small command: 3.6 -> 3.1 s for a MiniLM merge, benchmarks/overhead.py). Nothing of the
    command's is left to it: files are written, published and their temporary parts removed before
    `main` returns. A multi-process run's distributed client is shut down first (the other
    processes wait for it)."""
    code = main()
    jax = sys.modules.get("jax")  # not imported by --help and usage errors
    if jax is not None and jax.distributed.is_initialized():
        jax.distributed.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a reader that went away (a closed pipe): nothing left to tell it
            pass
    os._exit(0 if code is None else code)  # as SystemExit(None)


def _show_warning(prog, message, category, filename, lineno, file=None, line=None) -> None:
    """A warning on the command line is one line for its reader (a note as it is, another warning
    named so), not Python's file, line number and source line."""
    text = one_line(str(message))
    print(text if text.startswith("note: ") else f"{prog}: warning: {text}", file=sys.stderr if file is None else file)


def os_error_line(e: OSError) -> str:
    """An OSError in one line: what failed, on which path, and the notes added on the way."""
    what = e.strerror or str(e) or type(e).__name__
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    line = f"{' -> '.join(paths)}: {what}" if paths else what
    return one_line("; ".join([line, *getattr(e, "__notes__", ())]))


def one_line(message: str, limit: int = 4000) -> str:
    """`message` on one line, at most `limit` characters (the rest counted, not shown)."""
    message = " ".join(str(message).split("\n"))
    return message if len(message) <= limit else f"{message[:limit]}... ({len(message) - limit} more characters)"


def _run(argv: list[str]) -> int:
    args = parse(argv)
    return args.run(args)


def build_parser():
    """The `rotsym` parser and its subcommands' action (`.choices`: each command's parser)."""
    parser = _Parser(
        prog="rotsym", description="Align and merge transformers through their parameter-space symmetries.",
        epilog=f"Every command keeps the programs it compiles in JAX's persistent cache, ~/.cache/rotsym_jax/xla (under "
               f"$XDG_CACHE_HOME when set), so that a second run on models of the same shapes skips most compilation: "
               f"{COMPILATION_CACHE}=DIR moves it, {COMPILATION_CACHE}=off turns it off.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="align two ViTs trained on digits from different seeds (weights, activations, learned), then average them"
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
    demo.add_argument("--steps", type=_positive, default=options.AlignOptions().steps,
                      help=f"learned alignment: Adam steps (default {options.AlignOptions().steps})")
    demo.set_defaults(run=_demo, error=demo.error)
    _add_commands(commands)
    parser.add_argument("--version", action="version", version=f"rotsym_jax {version()}")
    return parser, commands


def parse(argv: list[str]):
    """`argv` parsed as the `rotsym` command parses it (its `.run(args)` runs it); a bad command
    line exits with argparse's message, as the command does."""
    parser, commands = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if any(not u.startswith("-") for u in unknown):
        # argparse takes a command's paths in one run: `merge A B --base X OUT` left OUT over. Its
        # intermixed parsing takes them wherever they are, but not under a parser with subcommands.
        command = commands.choices[args.command]
        args, unknown = command.parse_known_intermixed_args(argv[argv.index(args.command) + 1:], argparse.Namespace(command=args.command))
    if unknown:  # named by the subcommand's parser, with the options it has that come close
        _unrecognized(getattr(getattr(args, "error", None), "__self__", parser), unknown)
    args.argv = argv
    return args


DRY_RUN = "check everything from the configs and safetensors headers (no weights read), print the plan and a memory estimate, write nothing"


def _add_extract_lora(commands) -> None:
    """`rotsym extract-lora`: mergekit-extract-lora's flags (merging/lora.LoraOptions), --align first."""
    lora_cmd = commands.add_parser("extract-lora", help="a PEFT LoRA adapter from TUNED's delta to BASE, as mergekit-extract-lora extracts it")
    lora_cmd.add_argument("base", help="the base checkpoint (a Hugging Face folder, or an Orbax checkpoint or run)")
    lora_cmd.add_argument("tuned", help="the fine-tuned checkpoint (same architecture)")
    lora_cmd.add_argument("out", help="the adapter folder to write (adapter_config.json + adapter_model.safetensors)")
    lora_cmd.add_argument("--rank", type=_positive, default=128, help="the largest rank of a module's factors (mergekit's --max-rank; default 128)")
    lora_cmd.add_argument("--sv-epsilon", type=float, default=0.0,
                          help="keep only singular values above this (absolute, as mergekit's; default 0: keep --rank)")
    lora_cmd.add_argument("--no-distribute-scale", dest="distribute_scale", action="store_false",
                          help="A = S Vh, B = U (default: sqrt(S) on each side)")
    lora_cmd.add_argument("--embed-lora", action="store_true", help="factor the embeddings too (default: kept whole, in modules_to_save)")
    lora_cmd.add_argument("--save-module", dest="save_modules", action="append", default=[], metavar="NAME",
                          help="a module (its name's last part, e.g. lm_head) kept whole; repeatable")
    lora_cmd.add_argument("--include", action="append", default=[], metavar="REGEX", help="factor only the modules this matches; repeatable")
    lora_cmd.add_argument("--exclude", action="append", default=[], metavar="REGEX", help="leave out the modules this matches; repeatable")
    lora_cmd.add_argument("--skip-undecomposable", action="store_true",
                          help="leave out modules that are neither linear nor embeddings (norms, GPT-2's Conv1D) instead of keeping them whole")
    lora_cmd.add_argument("--align", action="store_true",
                          help="first move TUNED as close as possible to BASE by the symmetries (same function), then extract")
    lora_cmd.add_argument("--overwrite", action="store_true", help="replace OUT if it is an adapter folder")
    lora_cmd.add_argument("--quiet", action="store_true", help="print nothing but errors")
    _align_options(lora_cmd)
    _step_option(lora_cmd, output=False)
    lora_cmd.set_defaults(run=_lazy('_extract_lora'), error=lora_cmd.error)


def _add_moe(commands) -> None:
    """`rotsym moe`: mergekit-moe's config and the flags of it that change the output; --align first."""
    moe_cmd = commands.add_parser("moe", help="a mixture of experts (Mixtral, Qwen3-MoE) from dense models, as mergekit-moe builds it")
    moe_cmd.add_argument("config", help="a mergekit-moe config (base_model, experts with their prompts, gate_mode, ...)")
    moe_cmd.add_argument("out", help="the folder to write (a Mixtral or Qwen3-MoE checkpoint, the base's tokenizer)")
    moe_cmd.add_argument("--align", action=argparse.BooleanOptionalAction, default=None,
                         help="first move each expert's model onto the base by the symmetries (same function); over the config's "
                              "rotsym.align (default: the config's, else no)")
    moe_cmd.add_argument("--seed", "--random-seed", type=_seed, default=None,
                         help="the key of random gates and of noise_scale (default 0, or the config's rotsym.seed)")
    moe_cmd.add_argument("--i-understand-this-is-not-useful-without-training", dest="allow_all_same", action="store_true",
                         help="allow experts that are all one model (mergekit's flag)")
    moe_cmd.add_argument("--max-memory", type=parse_size, default=None, metavar="SIZE",
                         help="stream: each output tensor computed from the tensors it needs as they are read, refused where a step "
                              "needs more than SIZE (e.g. 3G); not with --align (default: the models read whole)")
    moe_cmd.add_argument("--overwrite", action="store_true", help="replace OUT if it is a checkpoint folder")
    moe_cmd.add_argument("--quiet", action="store_true", help="print nothing but errors")
    _align_options(moe_cmd)
    moe_cmd.set_defaults(run=_lazy('_moe'), error=moe_cmd.error)


def _add_commands(commands) -> None:
    align_cmd = commands.add_parser("align", help="move checkpoint B as close as possible to A (same function as B)")
    align_cmd.add_argument("paths", nargs="+", metavar="PATH",
                           help="A B OUT: the anchor (a Hugging Face checkpoint folder, or an Orbax checkpoint or training run folder), "
                                "the checkpoint to move (same architecture as A) and the folder to write (B moved); or RECIPE.yaml OUT: "
                                "replay the recipe an align wrote into its output (rotsym_config.yaml)")
    _align_options(align_cmd, options.METHODS)
    method = align_cmd.add_argument_group("alignment from data (MATH §10)")
    method.add_argument("--method", dest="align_method", default="weights", choices=options.METHODS,
                        help="weights: closed forms on the weights (the paper, the default); activations: both models run on "
                             "--data, every site matched by what flows through it; learned: from those, every transform trained "
                             "inside its group on the merged model's loss on --data")
    _data_options(method, required=False, what="the data the models run on (--method activations or learned)")
    method.add_argument("--label-field", default="label", help="the JSONL key holding each label (learned's task loss; default label)")
    _learned_options(method)
    align_cmd.add_argument("--dtype", default=None, choices=options.DTYPES, help=_dtype_help("B's"))
    _output_options(align_cmd)
    _processes_options(align_cmd)
    _step_option(align_cmd)
    _record_option(align_cmd)
    align_cmd.set_defaults(run=_lazy('_align'), error=align_cmd.error)

    merge_cmd = commands.add_parser("merge", help="align, then merge checkpoints with a registered method", help_tail=_merge_methods_help)
    merge_cmd.add_argument("--method", default=None, help="a registered merge method, e.g. ties (listed below); without it: a recipe or a mergekit config, CONFIG.yaml OUT")
    merge_cmd.add_argument("paths", nargs="+", metavar="PATH", help="CONFIG.yaml OUT, or with --method the models (the first is the anchor), then OUT")
    merge_cmd.add_argument("--align", default=None, choices=options.ALIGN_MODES,
                           help="none; anchor: each model aligned to the first (default; none with --last); many: align_many; over a "
                                "mergekit config's rotsym: block (default: the block's align, else none)")
    merge_cmd.add_argument("--last", type=_positive, default=None, metavar="K",
                           help="with one PATH, an Orbax training run (CheckpointManager folder): merge its last K steps, oldest "
                                "first, task heads too (checkpoint averaging: rotsym merge --method average RUN OUT --last 5)")
    merge_cmd.add_argument("--weights", type=_weights, default=None, metavar="W1,W2,...",
                           help="one weight per model, in their order (normalised to sum to 1): average, fisher, ot_fusion")
    merge_cmd.add_argument("--base", default=None, help="the shared base model (task_arithmetic, ties, dare)")
    merge_cmd.add_argument("--param", action="append", default=[], metavar="K=V", help="a method parameter, e.g. density=0.5")
    merge_cmd.add_argument("--seed", type=_seed, default=None,
                           help="the random key of methods that draw (dare; mergekit's dare_* and della*; default 0, or a config's own)")
    merge_cmd.add_argument("--dtype", default=None, choices=options.DTYPES, help=_dtype_help("the anchor's"))
    merge_cmd.add_argument("--task-head", default=None, choices=options.TASK_HEADS,
                           help="anchor: keep the anchor's head (default); merge: merge the heads (same shapes; the default with --last)")
    _align_options(merge_cmd)
    _output_options(merge_cmd)
    _processes_options(merge_cmd)
    _step_option(merge_cmd)
    _record_option(merge_cmd)
    merge_cmd.set_defaults(run=_lazy('_merge'), error=merge_cmd.error)

    barrier_cmd = commands.add_parser("barrier", help="loss along the straight path from A to B, without and with alignment")
    barrier_cmd.add_argument("a", help="a Hugging Face checkpoint folder, or an Orbax checkpoint or training run folder")
    barrier_cmd.add_argument("b", help="a checkpoint of the same architecture (and task head)")
    _data_options(barrier_cmd, required=True, what="the data the loss is measured on")
    barrier_cmd.add_argument("--label-field", default="label",
                             help="the JSONL key holding each label (default label; language-model texts label themselves)")
    barrier_cmd.add_argument("--out", required=True, help="the folder for barrier.json and barrier.png")
    barrier_cmd.add_argument("--align", default="anchor", choices=("none", "anchor"), help="anchor: also the path to B aligned to A (default)")
    barrier_cmd.add_argument("--points", type=int, default=11, help="points on the path, ends included (default 11)")
    barrier_cmd.add_argument("--overwrite", action="store_true", help="replace barrier.json and barrier.png of an earlier run in --out")
    _align_options(barrier_cmd, options.METHODS)
    method = barrier_cmd.add_argument_group("alignment from data (MATH §10)")
    method.add_argument("--method", dest="align_methods", default="weights", type=_methods,
                        help=f"a curve of B aligned by each of these comma-separated methods ({', '.join(options.METHODS)}; default weights)")
    method.add_argument("--align-data", default=None,
                        help="the data the data methods align on (activations, learned): never the --data the loss is measured on")
    _learned_options(method)
    _step_option(barrier_cmd, output=False)
    barrier_cmd.set_defaults(run=_lazy('_barrier'), error=barrier_cmd.error)

    inspect_cmd = commands.add_parser("inspect", help="describe a checkpoint; with B, the distances before and after matching")
    inspect_cmd.add_argument("a", help="a Hugging Face checkpoint folder, or an Orbax checkpoint or training run folder")
    inspect_cmd.add_argument("b", nargs="?", default=None, help="a second checkpoint of the same architecture")
    _align_options(inspect_cmd)
    _step_option(inspect_cmd, output=False)
    inspect_cmd.add_argument("--verify", action="store_true",
                             help="prove each symmetry group on A: a random element of each kind applied to its weights, run in "
                                  "transformers beside A (needs torch; A a Hugging Face folder); exit 1 if one changes the outputs")
    inspect_cmd.set_defaults(run=_lazy('_inspect'), error=inspect_cmd.error)

    _add_extract_lora(commands)
    _add_moe(commands)

    convert_cmd = commands.add_parser("convert-config", help="a rotsym recipe as a mergekit config, or back, where both say the same merge")
    convert_cmd.add_argument("source", help="a rotsym recipe (.yaml) or a mergekit config (one with merge_method)")
    convert_cmd.add_argument("out", help="the YAML file to write (the other format; paths made absolute)")
    convert_cmd.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    convert_cmd.set_defaults(run=_lazy('_convert_config'), error=convert_cmd.error)


def _dtype_help(default: str) -> str:
    return (f"the dtype of the tensors written (default: {default}, each tensor as stored); a model stored narrower than float32 "
            "is then computed in float32 and rounded once, to it")


def _record_option(parser) -> None:
    parser.add_argument("--record", action="append", metavar="FILE",
                        help="an inferred record (JSON, as the note of a model type without a record of its own prints it) to read "
                             "that model type by, instead of proving one in transformers on every run (seconds); repeatable")


def _step_option(parser, output: bool = True) -> None:
    group = parser.add_argument_group("Orbax checkpoints")
    group.add_argument("--step", type=int, default=None, metavar="N",
                       help="the step N of every input that is an Orbax training run (CheckpointManager folder; default: its latest "
                            "step); a step folder (RUN/N) may also be given as the input itself")
    if output:
        group.add_argument("--format", default="hf", choices=options.FORMATS,
                           help="hf: a Hugging Face folder, config.json + safetensors (default); orbax: config.json + params/ "
                                "written by Orbax (rotsym_jax.load_orbax reads it, as every rotsym command does)")


def _weights(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive numbers, one per model") from None
    if not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every weight must be a positive number")
    return values


def _data_options(parser, *, required: bool, what: str) -> None:
    parser.add_argument("--data", required=required, default=None,
                        help=f"{what}: a JSONL of texts (+ labels), tokenized with A's tokenizer, or an .npz of pixel_values "
                             "(+ labels), of token ids (input_ids + attention_mask, token_type_ids, labels), or of Whisper's "
                             "input_features with decoder_input_ids (its decoder's tokens: required); T5's and BART's "
                             "decoder_input_ids (+ decoder_attention_mask) may go beside their input_ids (default: the ids shifted "
                             "right, as their task classes make them)")
    parser.add_argument("--batch-size", type=_positive, default=8, help="examples per forward pass (default 8)")
    parser.add_argument("--count", type=_positive, default=None, help="examples used (default: all)")
    parser.add_argument("--max-length", type=_positive, default=128, help="texts are cut to this many tokens by A's tokenizer (default 128)")
    parser.add_argument("--text-field", default="text", help="the JSONL key holding each text (default text)")


def _learned_options(group) -> None:
    _declared_flags(group, lambda methods: methods == options.LEARNED)
    group.add_argument("--seed", dest="align_seed", type=_seed, default=0, help="learned: the random key (alpha uniform; default 0)")


def _declared_flags(group, chosen) -> None:
    """The flags of the alignment options (`options.DECLARED`: flag, help, default, how its text is
    read) whose methods (`Declared.methods`) `chosen(methods)` takes."""
    defaults = options.AlignOptions()
    for name, declared in options.DECLARED.items():
        if declared.flag is None or not chosen(declared.methods):
            continue
        default = getattr(defaults, name)
        helped = declared.help.format(default=default)
        if isinstance(default, bool):
            group.add_argument(declared.flag, dest=name, action="store_false" if declared.flag.startswith("--no-") else "store_true", help=helped)
        elif declared.choices:
            group.add_argument(declared.flag, dest=name, default=default, choices=declared.choices, help=helped)
        else:
            group.add_argument(declared.flag, dest=name, default=default, type=functools.partial(_declared_value, name), help=helped,
                               metavar=name.upper() if name != "layers" else "L1,L2,...")


def _declared_value(name: str, text: str):
    try:
        return options.DECLARED[name].from_text(name, text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None


def _methods(text: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in methods if m not in options.METHODS]
    if not methods or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated methods among {', '.join(options.METHODS)}")
    return methods


def _output_options(parser) -> None:
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it is a checkpoint folder (files rotsym did not write are kept)")
    parser.add_argument("--dry-run", action="store_true", help=DRY_RUN)
    parser.add_argument(
        "--max-memory", type=parse_size, default=None, metavar="SIZE",
        help="stream from disk to disk a few layers at a time, as many as fit SIZE (e.g. 3G); without it, streaming is "
             "used when the in-memory run would not fit the memory available (see docs/guides/big-checkpoints.md)")
    parser.add_argument(
        "--quiet", action="store_true",
        help="no progress bars and no summary (errors still go to stderr); bars show only on a terminal: the steps "
             "(loading each model, aligning, statistics, merging, saving) and, inside them, statistics batches, models "
             "aligned and align_many passes; an alignment shows no per-layer progress (all layers are solved in one "
             "batched computation)")


def _processes_options(parser) -> None:
    group = parser.add_argument_group(
        "many processes, one run (docs/guides/processes.md)",
        "Run N copies of the command, one per process (a host or a GPU each), which split the layers between them: the "
        "run streams, each process reads, solves and writes its layers, and process 0 publishes OUT (a shared folder).")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="process 0's address, which every process reaches (with --num-processes and --process-id)")
    group.add_argument("--num-processes", type=_positive, default=None, metavar="N", help="how many processes run together")
    group.add_argument("--process-id", type=int, default=None, metavar="I", help="this process's index, 0 to N-1")
    group.add_argument("--distributed", action="store_true",
                       help="join a multi-process run as JAX detects it from the cluster (SLURM, Open MPI, ...): no other flag needed")


def _align_options(parser, methods: tuple = ("weights",)) -> None:
    """The flags of every alignment option that one of `methods` (those the command runs) reads
    (not only those every method reads: a merge honours --maps and --latents), learned's alone
    aside (`_learned_options`, beside --method)."""
    _declared_flags(parser.add_argument_group("alignment (rotsym_jax.align's options)"),
                    lambda read_by: read_by != options.LEARNED and bool(set(read_by) & set(methods)))


def parse_size(text: str) -> int:
    """'3G', '2.5GiB', '800M', '3000000000' -> bytes (K, M, G, T: powers of 1024)."""
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    s = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    unit = s[-1] if s and s[-1] in units else ""
    try:
        value = float(s[: len(s) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 3G, 2500M or 3000000000") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive size")
    return int(value * units[unit])


def _lazy(name: str):
    """The command `name` of `commands`, imported when it runs: the parsers above need no JAX."""

    def run(args):
        enable_compilation_cache()
        return getattr(importlib.import_module(".commands", __package__), name)(args)

    return run


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


COMPILATION_CACHE = "ROTSYM_COMPILATION_CACHE"


def compilation_cache_dir() -> Path | None:
    """Where every `rotsym` command keeps its compiled XLA programs: $ROTSYM_COMPILATION_CACHE (a
    folder; "off" keeps none), else $XDG_CACHE_HOME/rotsym_jax/xla, else ~/.cache/rotsym_jax/xla."""
    value = os.environ.get(COMPILATION_CACHE)
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0", "no", "false", "none") else Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rotsym_jax" / "xla"


def enable_compilation_cache(directory=None) -> None:
    """Keep compiled XLA programs on disk (JAX's persistent compilation cache) in `directory`
    (default: `compilation_cache_dir()`; None there: off), so that a command run again on models
    of the same shapes skips compilation (the MiniLM pair's `align`: most of its seconds). Every
    program is kept, however fast it compiled. A cache directory the user set for JAX
    (JAX_COMPILATION_CACHE_DIR) wins."""
    directory = compilation_cache_dir() if directory is None else directory
    if directory is None:
        return
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _seed(text: str) -> int:
    value = int(text)
    if not -2**63 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must fit in 64 bits (a random key), got {len(text)} digits")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _demo(args) -> int:
    """`rotsym demo`: the arguments checked here, the training, alignments and merges in
    `rotsym_experiments.demo`."""
    start = time.perf_counter()
    if args.seeds[0] == args.seeds[1]:
        args.error("--seeds must differ: the point is two independently trained models")
    digits = _experiments("digits", args.error)
    # Checked before anything is set or trained: the cache is first written after training.
    problem = _cache_dir_problem(digits.cache_root, args.cache_dir)
    if problem:
        args.error(problem)
    enable_compilation_cache()
    _experiments("demo", args.error).run(tuple(args.seeds), args.epochs, args.steps, args.cache_dir, start)
    return 0
