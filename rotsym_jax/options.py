"""The choices of `align` and of the command line, in a module that imports nothing heavy (the
`rotsym` command builds its parsers from it before JAX is loaded), and `AlignOptions`: every
alignment option, defaulted and checked here once for every path (in memory, streaming,
`align_many`, recipes, the command line)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Collection, Mapping

from .errors import InputError, InputTypeError

ATTENTION = ("rotation", "permutation", "none")
# "auto": the best measured choice for the method (`AlignOptions.settled`; docs/guides/choosing.md).
MAPS = ("auto", "orthogonal", "invertible")
HEADS = ("fixed", "permute")
RESCALE = ("none", "sequential", "joint")
# "scaled": the permutation, then each gated unit's scale (up times s, down divided by s; MATH §1)
FFN = ("permutation", "scaled", "none")
# The units of a permutation group that pass an RMSNorm read by linear layers alone (MLA's latents, `Spec.unit_norms`):
# permuted (the norm's gain with them), or rotated once the gain is folded into the readers (MATH §17)
LATENTS = ("permutation", "rotation")
# The most bytes of float32 cost matrices an experts block holds at once (its pairs are batched up
# to it; one pair's matrix at least): the memory model counts it.
EXPERT_PAIR_BYTES = 2**28


def expert_pairs_at_once(num_experts: int, units: int) -> int:
    """How many expert pairs' (units, units) float32 cost matrices are held at once."""
    return max(1, min(num_experts, EXPERT_PAIR_BYTES // (4 * units * units)))
RESIDUAL = ("auto", "none", "permutation", "signed_permutation", "rotation")
# How the transforms are found: closed forms on the weights (the paper) or on the models' activations
# on data, or learned on data (gradient descent on the merged model's loss, from a closed form).
METHODS = ("weights", "activations", "learned")
# method="learned": the interpolation weight of B in the merged model at each step, the loss it is
# trained on ("auto": the task loss where the data has labels, else distillation), where it starts: "best" the
# start (identity, weight or activation matching) with the lowest held-out loss, or the closed form named (or the
# identity, where that is lower).
ALPHAS = ("half", "uniform")
OBJECTIVES = ("auto", "task", "distill")
INITS = ("best", "weights", "activations")
# method="learned": the optax optimizers `optimizer` names, each made as `optax.<name>(learning_rate)`.
OPTIMIZERS = ("adam", "adamw", "nadam", "adabelief", "lion", "lamb", "sgd", "rmsprop", "adagrad")
POLAR_METHODS = ("svd", "newton", "newton_schulz", "qdwh")
# Newton-Schulz: the fastest on CPU and GPU, as accurate as the SVD (see solvers' note on it).
DEFAULT_POLAR_METHOD = "newton_schulz"
# How a merge aligns its models: not at all, each to the first (the anchor), or all to their mean.
ALIGN_MODES = ("none", "anchor", "many")
# OT fusion's unit costs and transports.
OT_SOURCES = ("weights", "activations")
OT_TRANSPORTS = ("hard", "soft")
DTYPES = ("float32", "bfloat16", "float16", "float64")
TASK_HEADS = ("anchor", "merge")
# What the pipelines write: a Hugging Face folder (safetensors) or an Orbax checkpoint folder.
FORMATS = ("hf", "orbax")


@dataclasses.dataclass(frozen=True)
class Declared:
    """An alignment option, declared once: `ok(value)` checks it and `expected` says what it takes
    (`AlignOptions`, recipes and mergekit configs refuse with it), `concern` is the part of a run
    it sets ("groups", "solver", "method", "learning", "policy"), `methods` the methods that read
    it (a report records it where its method does, and its recipe replays it), `flag` its
    command-line flag (None: Python and recipes only; method: each command names its own), `help`
    the flag's help ("{default}" the default's place), `text` how the flag's text becomes the
    value that `ok` then checks (None: the text itself, one of `choices`; a "--no-..." flag of a
    bool takes no text). The command line's flags are built from these (`cli.parsers`)."""

    ok: Callable
    expected: str
    concern: str
    methods: tuple = METHODS
    flag: str | None = None
    choices: tuple | None = None
    help: str = ""
    text: Callable[[str], object] | None = None

    def refusal(self, name: str, value) -> str:
        only_choices = self.choices and self.expected == f"one of {self.choices}"
        return f"{name}={value!r}; " + (f"choose one of {self.choices}" if only_choices else f"expected {self.expected}")

    def from_text(self, name: str, text: str):
        """The value of the flag's `text`, checked (InputError saying what it takes)."""
        try:
            value = text if self.text is None else self.text(text)
        except ValueError as e:  # a converter's own "expected ..." says it for the command line
            raise InputError(f"{self.flag} {text!r}: {e if str(e).startswith('expected') else 'expected ' + self.expected}") from None
        if not self.ok(value):
            raise InputError(f"{self.flag} {text!r}: expected {self.expected}")
        return value


def _choice(choices: tuple, concern: str, **declared) -> Declared:
    return Declared(lambda v: isinstance(v, str) and v in choices, f"one of {choices}", concern, choices=choices, **declared)


def _integer(minimum: int, expected: str, concern: str, **declared) -> Declared:
    return Declared(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum, expected, concern, text=int, **declared)


def _number(ok: Callable, expected: str, concern: str, **declared) -> Declared:
    return Declared(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and ok(v), expected, concern, text=float, **declared)


def _layer_list(text: str) -> list[int]:
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        layers = []
    if not layers:
        raise InputError("expected comma-separated layer indices, e.g. 0,3,5")
    return layers


def is_transformation(value) -> bool:
    """An optax.GradientTransformation (its init and update), told apart without importing optax."""
    return not isinstance(value, (str, Mapping)) and callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))


def _is_layers(value) -> bool:
    if value is None:
        return True
    try:
        _layer_labels(value)
    except InputTypeError:
        return False
    return True


LEARNED = ("learned",)
# Every field of AlignOptions, in its order (tests/test_align.py checks they agree).
DECLARED = {
    "attention": _choice(ATTENTION, "groups", flag="--attention", help="per-head symmetry of Q/K and V/O (default {default})"),
    "heads": _choice(HEADS, "groups", flag="--heads",
                     help="fixed: head i <-> head i (the paper, the default: on fine-tunes and shared inits permute changed nothing in "
                          "our experiments); permute: match heads first, which undoes head permutations"),
    "rescale": _choice(RESCALE, "groups", flag="--rescale", help="per-head scale (default {default}, the paper's)"),
    "ffn": _choice(FFN, "groups", flag="--ffn", help="FFN hidden-unit matching (default {default}); scaled: then each gated unit's scale, "
                                                          "its up row times s and its down column divided by s"),
    "layers": Declared(_is_layers, "a list of layer indices, or null for all", "groups", flag="--layers", text=_layer_list,
                       help="comma-separated layer indices to match (default: all)"),
    "residual": _choice(RESIDUAL, "groups", flag="--residual",
                        help="align the residual stream too: permutation (every family), signed_permutation (RMSNorm families, gains "
                             "unfolded; what Gemma 2/3's sandwich norms allow), rotation (pre-norm families: norm gains folded first; "
                             "GPT-2 and ViT keep the ones vector; a tied LM head is written untied; not post-LN BERT/RoBERTa); none "
                             "(the paper); default auto: none for --method weights, the strongest the family allows (rotation where "
                             "pre-norm, else permutation) for activations and learned, and for a mergekit config's stacked layers"),
    "residual_sweeps": _integer(1, "a positive integer", "solver", flag="--residual-sweeps",
                                help="with a residual group: at most this many sweeps of the descent over (per-layer groups, residual stream) "
                                     "(default {default})"),
    "polar_method": _choice(POLAR_METHODS, "solver", flag="--polar-method",
                            help="how the rotations' polar factors are computed (default {default}: as accurate as the SVD, and faster "
                                 "on CPU and GPU)"),
    "method": _choice(METHODS, "method"),
    "fallback": Declared(lambda v: isinstance(v, bool), "True or False", "policy", flag="--no-fallback",
                         help="keep the method's own result even where the identity or another closed form is closer (weights) or "
                              "has a lower loss (activations, learned); by default the best is kept and one line says so"),
    "steps": _integer(1, "a positive integer", "learning", methods=LEARNED, flag="--steps", help="learned: Adam steps (default {default})"),
    "learning_rate": _number(lambda v: 0 < v < float("inf"), "a positive number", "learning", methods=LEARNED, flag="--learning-rate",
                             help="learned: Adam's learning rate (default {default})"),
    "patience": _integer(0, "a number of steps >= 0 (0: no early stop)", "learning", methods=LEARNED, flag="--patience",
                         help="learned: stop once this many steps have not lowered the held-out loss (0: every step; default {default})"),
    "alpha": _choice(ALPHAS, "learning", methods=LEARNED, flag="--alpha",
                     help="learned: B's weight in the merged model at each step: half, or uniform in (0, 1) (default {default})"),
    "objective": _choice(OBJECTIVES, "learning", methods=LEARNED, flag="--objective",
                         help="learned: task (the labels' loss; next tokens for a causal LM), distill (KL to the mean of A's and B's "
                              "predictions, no labels), auto (task where the data has labels; the default)"),
    "init": _choice(INITS, "learning", methods=LEARNED, flag="--init",
                    help="learned: where it starts: best (the identity, weight or activation matching, whichever has the lowest "
                         "held-out loss), or that closed form unless the identity's loss is lower; with --no-fallback, that closed "
                         "form, activation matching for best (default {default})"),
    "optimizer": Declared(lambda v: (isinstance(v, str) and v in OPTIMIZERS) or is_transformation(v),
                          f"one of {OPTIMIZERS}, or an optax.GradientTransformation", "learning", LEARNED, "--optimizer", OPTIMIZERS,
                          help="learned: the optax optimizer, made with --learning-rate (default {default})"),
    "holdout": _number(lambda v: 0 <= v < 1, "a fraction in [0, 1)", "learning", methods=LEARNED, flag="--holdout",
                       help="learned: the fraction of the batches held out for early stopping (default {default})"),
    "eval_every": _integer(1, "a positive integer", "learning", methods=LEARNED),
    "maps": _choice(MAPS, "groups", methods=("weights", "learned"), flag="--maps",
                    help="learned and weights: the Q/K and V/O maps: auto (the default: invertible for --method learned, else "
                         "orthogonal; measured in docs/guides/choosing.md), orthogonal (the paper's, with a scale) or invertible (any "
                         "invertible map per kv group, its condition number below 100; weight matching descends the distance from the "
                         "rotations, which need not lower the barrier: experiments/RESULTS.md; MATH §14)"),
    "latents": _choice(LATENTS, "groups", methods=("weights",), flag="--latents",
                       help="MLA's latent spaces (DeepSeek-V2/V3's q_lora and kv_lora, under their RMSNorms): permutation (the "
                            "default: each norm's gain moves with its entries) or rotation (each norm's gain folded into the layers "
                            "reading the latent first, same function; then an orthogonal map per layer, by Procrustes on the "
                            "latent's writer; weights only; MATH §17)"),
}


@dataclasses.dataclass(frozen=True)
class AlignOptions:
    """Every option of `align` (and of the streamed runs, `align_many`, recipes and the command
    line), defaulted and checked here once, on construction.

    Frozen and hashable: a static argument of jitted code. `AlignOptions.of(mapping, **changes)`
    builds one from the keywords the command line, recipes and `align(a, b, spec, **options)` use,
    naming unknown keys.

    attention: "rotation" (per-head orthogonal Procrustes on QK and VO; RoPE blocks use the
        SO(2)-pair solution; GQA shares one transform per kv group), "permutation" (permute head
        dimensions only: a permutation-symmetry baseline), "none".
    heads: "fixed" (head i <-> head i) or "permute" (assign heads first: exact joint optimum over
        head permutations x rotations, MATH §4; with GQA kv groups are assigned on group scores
        after matching query heads within each candidate pair, exact up to
        `engine.attention.EXACT_QUERY_MATCHINGS` matchings per pair, by per-head scores beyond).
    rescale: "none", "sequential" (the paper's quartic after rotation), "joint" (exact one-scalar
        joint optimum, never worse than sequential; needs attention="rotation").
    ffn: "permutation" (linear assignment per permutation group and layer; mixtures of experts:
        the experts matched with their router outputs, nested with each expert's units, MATH §5),
        "scaled" (then each gated unit's scale, up times s and down divided by s: from weights
        the per-unit quartic, from activations ||h_A|| / ||h_B||, learned as log-scales; it moved
        the Llama pairs' barriers by -0.011 to +0.023 nats in experiments/RESULTS.md, so the
        permutation alone stays the default) or "none".
    layers: layer indices to match; the others keep identity transforms. None: all.
    residual: "auto" (the default): "none" for method="weights" (the paper's), and for the data
        methods the strongest group both models allow as given (`engine.residual.strongest`:
        "rotation" on a pre-norm model whose norm gains are uniform, as after `rj.fold_norms`,
        else "permutation"; the command line folds the gains and unties a tied head first, so
        its pre-norm runs rotate); `report["settled"]` names the choice and why. The rest:
        "none" (the paper: the residual stream stays), "permutation" (a permutation of the
        model width, every family), "signed_permutation" (a permutation with sign flips, every
        RMSNorm family, its gains left unfolded: the group sandwich norms leave, Gemma 2 and 3),
        "rotation" (an orthogonal basis change, for pre-norm families
        with the norm gains folded first, `rj.fold_norms`: any for RMSNorm, those fixing the ones
        vector for LayerNorm, GPT-2 and ViT; post-LN BERT/RoBERTa allow permutations only). MATH §10. The stream couples every
        layer, so it is solved jointly with the per-layer groups by coordinate descent: per-layer
        groups given T, then T in closed form given them (assignment or Procrustes on the summed
        cross products), for at most `residual_sweeps` sweeps, stopping when the distance stops
        falling (inside jit: every sweep runs); the best sweep is kept, and `report["residual"]`
        gives the distance after each. The result's transforms then hold a
        `ResidualTransform` under "residual". A model without a task head outputs the stream
        itself: its last hidden state then comes out in the new basis (permuted or rotated);
        what a head reading it computes is unchanged.
    method: what the closed forms are solved on (MATH §10). "weights" (the paper: the weights'
        cross products), or "activations": A and B run on `data` with `checkpoint`'s forward pass,
        and every site is matched by its activations (`engine.activations`): each head's queries
        and keys (before RoPE) and values and attention output, each FFN's hidden units after the
        activation (standardised: their correlations), the residual stream as its readers see it.
        A symmetry moves those activations exactly as it moves the weights, and moves nothing
        else, so each site is solved once, from one forward pass of each model; with the same
        options as weight matching (head permutations, rescaling, RoPE pairs, GQA, the residual
        stream) and the same solvers. Not traceable (the forward passes read the data on the host).
        "learned" (`engine.learned`): from the best start on the held-out loss (`init="best"`:
        the identity, weight or activation matching; `init="weights"` or "activations": that
        closed form, or the identity where its loss is lower; `report["chosen"]` says which),
        every transform is trained inside its group (Cayley rotations, RoPE pair angles, exp
        scales, the straight-through estimator for the FFN permutations; head permutations and a
        residual permutation stay as the closed form found them) with optax (`optimizer`, Adam by default), on the loss of
        the merged model (1 - a) A + a B' at a = 1/2 (`alpha="half"`) or a drawn from U(0, 1)
        (`alpha="uniform"`, needs `key`): `objective` "task" (the labels' negative
        log-likelihood; next tokens for a causal LM), "distill" (the KL divergence from the mean
        of A's and B's predictions: no labels needed) or "auto" (task where the data has labels,
        or where a causal LM reads token ids: they label themselves; `learned.objective_for`, as
        the command line decides). The last `holdout` fraction of the batches is held out: every
        `eval_every` steps the merged model's held-out loss at a = 1/2 is measured and the best
        point kept (early stopping: never above the start's; without a held-out split the last
        step, unless the start's training loss is lower); with `fallback`, only where it beats
        the start by more than a tie (`engine.choice`), else the start, closer to A. A loss that is not finite before any
        step is refused as the data's or the models' (DataError), not the learning rate's.
        `steps` Adam steps at most, at `learning_rate`, stopping once `patience` steps have not
        lowered the held-out loss (0: every step runs); `progress()` is called after each. Deterministic
        for a given key. `report["learned"]` holds the training and held-out curves. B's function
        never changes; report barriers on data the transforms did not see.
    fallback: True (the default): no method ends worse than the identity (B as given) on what it
        is judged by (`engine.choice`): "weights" on the weight distance to A, "activations" (also
        against weight matching) on the merged model's divergence from A's and B's predictions on
        `data` (the weight distance where the model has no logits), a tie going to the result
        closest to A; `report["chosen"]` names the result kept, every candidate's distance (and
        loss) and why, and "note" is one line for the user where it is not the method's own or
        ends farther from A than B was. False: the method's own result, whatever it gives
        (learned: from `init`'s closed form, activation matching for "best").
    optimizer: method="learned"'s optax optimizer: a name of `OPTIMIZERS` ("adam", the default),
        made with `learning_rate`, or an `optax.GradientTransformation` (any optax chain or
        schedule; it brings its own rate, so `learning_rate` is not read, and a pipeline refuses
        it: a report or recipe cannot hold it). The same object reuses its compiled step.
    steps, learning_rate, patience, alpha, objective, init, holdout, eval_every: method="learned"'s, above
        (the defaults measured in docs/guides/choosing.md: 1000 steps at 3e-3 beat 300 at 1e-3 on
        every pair there, and the patience stops the pairs whose held-out loss settles sooner).
    maps: the group of the Q/K and V/O maps (MATH §14): "auto" (the default): "invertible" for
        method="learned" with attention="rotation", else "orthogonal"; "orthogonal" (the paper's, with a scale)
        or "invertible" (any invertible M per kv group: W_Q M, W_K M^-T, W_V N, N^-1 W_O;
        RoPE-compatible on rotary blocks, orthogonal under a QK-norm), each map a rotation times
        exp(S), S symmetric and bounded so that its condition number stays below
        `solvers.stretch.MAX_CONDITION`: learned on the merged model's loss (method="learned"), or
        from the closed form's rotations, the weight distance descended (method="weights", MATH
        §14); `report["condition_numbers"]` names the largest.
    latents: the permutation groups whose units pass an RMSNorm that linear layers alone read
        (`Spec.unit_norms`: DeepSeek-V2/V3's q_lora and kv_lora latents, MATH §17): "permutation"
        (the default; the gain moves with its units) or "rotation": an orthogonal map per layer,
        the polar factor of the cross products of the latent's writer (its kernel's columns and
        bias) in B and A. A rotation keeps the function only with the gain folded into the readers'
        rows (`rj.fold_latents` on both models; the pipelines and streamed runs fold them as they
        read): `align` refuses gains that are not uniform. Weights only; no effect on a model
        without such a group.
    """

    attention: str = "rotation"
    heads: str = "fixed"
    rescale: str = "sequential"
    ffn: str = "permutation"
    layers: tuple | None = None
    residual: str = "auto"
    residual_sweeps: int = 8
    polar_method: str = DEFAULT_POLAR_METHOD
    method: str = "weights"
    # Keep the method's result only where neither the identity nor another closed form does better (`engine.choice`).
    fallback: bool = True
    # method="learned" (`engine.learned`)
    steps: int = 1000
    learning_rate: float = 3e-3
    patience: int = 200
    alpha: str = "half"
    objective: str = "auto"
    init: str = "best"
    optimizer: object = "adam"
    holdout: float = 0.25
    eval_every: int = 10
    maps: str = "auto"
    latents: str = "permutation"

    def __post_init__(self):
        for name, declared in DECLARED.items():
            if name != "layers" and not declared.ok(getattr(self, name)):  # layers: `_layer_labels` below says which entry
                raise InputError(declared.refusal(name, getattr(self, name)))
        if self.maps == "invertible" and self.attention != "rotation":
            raise InputError("maps='invertible' generalises the rotations of Q/K and V/O: it needs attention='rotation'")
        if self.maps == "invertible" and self.method == "activations":
            raise InputError("maps='invertible' is learned (method='learned') or descends the weight distance (method='weights'); "
                             "activation matching solves the orthogonal maps only")
        if self.latents == "rotation" and self.method != "weights":
            raise InputError(f"latents='rotation' is solved from weights (Procrustes on each latent's writer); method={self.method!r} "
                             "solves the latents' permutations only: use latents='permutation'")
        if self.rescale == "joint" and self.attention != "rotation":
            raise InputError("rescale='joint' optimises over rotations: it needs attention='rotation'")
        if self.layers is not None:
            object.__setattr__(self, "layers", _layer_labels(self.layers))

    @classmethod
    def of(cls, options: AlignOptions | Mapping | None = None, **overrides) -> AlignOptions:
        """`options` (an AlignOptions, a mapping of its fields, or None for the defaults) with
        `overrides`; TypeError naming keys that are not options."""
        return _options_of(cls, options, overrides, "align")

    def settled(self, residual: str | None = None) -> AlignOptions:
        """These options with each "auto" resolved (what every path runs): residual "none" for
        method="weights" (the paper's), else `residual` (`engine.residual.strongest` of the
        models; None keeps "auto", for a caller that refuses the data methods); maps
        "invertible" for method="learned" with rotations, else "orthogonal"."""
        changes = {}
        if self.residual == "auto" and (self.method == "weights" or residual is not None):
            changes["residual"] = "none" if self.method == "weights" else residual
        if self.maps == "auto":
            changes["maps"] = "invertible" if self.method == "learned" and self.attention == "rotation" else "orthogonal"
        return dataclasses.replace(self, **changes) if changes else self

    def as_dict(self) -> dict:
        """The options as plain keywords (layers as a list): what reports and recipes record."""
        out = dataclasses.asdict(self)
        out["layers"] = None if self.layers is None else list(self.layers)
        return out


FIELDS = tuple(f.name for f in dataclasses.fields(AlignOptions))


def options_table() -> str:
    """The documentation's table of the alignment options (docs/reference/options.md), from `DECLARED`."""
    defaults = AlignOptions()
    rows = ["| option | default | takes | concern | read by | flag | recipe key | what it does (the flag's help) |",
            "|---|---|---|---|---|---|---|---|"]
    for name, declared in DECLARED.items():
        methods = ", ".join(declared.methods) if declared.methods != METHODS else "every method"
        flag = f"`{declared.flag}`" if declared.flag else ("`--method` (align, barrier)" if name == "method" else "(none)")
        default = getattr(defaults, name)
        rows.append(f"| `{name}` | `{default!r}` | {declared.expected} | {declared.concern} | {methods} | {flag} | "
                    f"`align_options.{name}` | {declared.help.format(default=default).replace('|', '/')} |")
    return "\n".join(rows)


def recorded(options: AlignOptions) -> dict:
    """Every option that `options` (settled) runs, as reports and recipes record it: each field
    its method reads (`DECLARED`), so that a recipe replays the run."""
    return {k: v for k, v in options.as_dict().items() if options.method in DECLARED[k].methods}


def moving(given: Mapping) -> dict:
    """The options of `given` (a mapping of AlignOptions fields) that are not at their default,
    as given ("auto") or as the paper's method settles it (residual "none", maps "orthogonal"):
    what an alignment that aligns nothing must not be given."""
    raw, settled = AlignOptions(), AlignOptions().settled()
    return {k: v for k, v in given.items() if getattr(raw, k, object()) != v and getattr(settled, k, object()) != v}

MANY_MODES = ("mean", "anchor")


@dataclasses.dataclass(frozen=True)
class ManyOptions:
    """How `align_many` sweeps, checked on construction (the in-memory and streamed runs and the
    merge command read these defaults). mode: "mean" (medoid initialisation, then Gauss-Seidel
    leave-one-out-mean sweeps with a monotone safeguard) or "anchor" (every model to the first,
    one pass); max_iters: at most this many sweeps (>= 1; unused by "anchor"); tol: stop when a
    sweep lowers the objective by less than this fraction of it."""

    mode: str = "mean"
    max_iters: int = 10
    tol: float = 1e-6

    def __post_init__(self):
        if not isinstance(self.mode, str) or self.mode not in MANY_MODES:
            raise InputError(f"mode={self.mode!r}; choose one of {MANY_MODES}")
        if isinstance(self.max_iters, bool) or not isinstance(self.max_iters, numbers.Integral) or self.max_iters < 1:
            raise InputError(f"max_iters={self.max_iters!r}; it must be an integer >= 1")
        if isinstance(self.tol, bool) or not isinstance(self.tol, numbers.Real) or not 0 <= self.tol < float("inf"):
            raise InputError(f"tol={self.tol!r}; it must be a finite number >= 0")


# A streamed run's row blocks: a tensor outside the layers bigger than this in float32 is read,
# moved and merged a block of rows at a time (entry-by-entry methods). Small, as each block's
# distances take float64 copies.
DEFAULT_BLOCK_BYTES = 32 * 2**20
# The largest safetensors shard written (as transformers' save_pretrained shards).
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How a streamed run (`align_to_disk`, `merge_to_disk`, `--max-memory`) reads and writes,
    checked on construction. max_memory: the bytes its estimated peak must fit (None: no bound;
    the chunk is then `chunk_layers`, else 4 layers); chunk_layers: layers per chunk (None: the
    most whose peak fits `max_memory`); block_bytes: the row blocks of big tensors outside the
    layers (None: DEFAULT_BLOCK_BYTES); max_shard_bytes: the largest shard written; overwrite:
    replace an existing output folder; progress: `progress(done, total)`, called after every chunk
    of every pass (None: nothing; the planners read neither). As `RunOptions` for the pipelines.
    `StreamOptions.of(mapping, **changes)` as `AlignOptions.of`."""

    max_memory: int | None = None
    chunk_layers: int | None = None
    block_bytes: int | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    overwrite: bool = False
    progress: Callable[[int, int], None] | None = None

    def __post_init__(self):
        if not isinstance(self.overwrite, bool):
            raise InputError(f"overwrite={self.overwrite!r}; expected True or False")
        if self.progress is not None and not callable(self.progress):
            raise InputError(f"progress={self.progress!r}; expected None or a function progress(done, total)")
        for name in ("max_memory", "chunk_layers", "block_bytes", "max_shard_bytes"):
            value = getattr(self, name)
            if value is None and name != "max_shard_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name}={value!r}; expected a positive integer" + ("" if name == "chunk_layers" else " (bytes)"))

    @classmethod
    def of(cls, options: StreamOptions | Mapping | None = None, **overrides) -> StreamOptions:
        """`options` (a StreamOptions, a mapping of its fields, or None) with `overrides`."""
        return _options_of(cls, options, overrides, "stream")


STREAM_FIELDS = tuple(f.name for f in dataclasses.fields(StreamOptions))


@dataclasses.dataclass(frozen=True)
class MergeOptions:
    """How a streamed merge (`merge_to_disk`, `plan_merge`) aligns and merges its models, checked
    on construction. align: "none", "anchor" (each model to the first) or "many" (`align_many`);
    align_options: `align`'s options (an AlignOptions or a mapping of its fields); params: the
    merge method's declared parameters; weights: one per model (the methods that take weights);
    seed: the key of the methods that draw (dare); task_head: "anchor" (the first model's kept)
    or "merge"; dtype: the dtype written (None: the anchor's); fisher_kind, fisher_key,
    fisher_samples: `stats.fisher`'s, for method "fisher". `MergeOptions.of(mapping, **changes)`
    as `AlignOptions.of`. The merge itself is the method's; `recipe.Recipe` is the same choice
    read from a file."""

    align: str = "anchor"
    align_options: AlignOptions | Mapping | None = None
    params: Mapping | None = None
    weights: tuple | None = None
    seed: int = 0
    task_head: str = "anchor"
    dtype: object = None
    fisher_kind: str = "empirical"
    fisher_key: object = None
    fisher_samples: int = 1

    def __post_init__(self):
        if not isinstance(self.align, str) or self.align not in ALIGN_MODES:
            raise InputError(f"align={self.align!r}; choose one of {ALIGN_MODES}")
        if not isinstance(self.task_head, str) or self.task_head not in TASK_HEADS:
            raise InputError(f"task_head={self.task_head!r}; choose one of {TASK_HEADS}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InputError(f"seed={self.seed!r}; expected an integer")
        if self.params is not None and not isinstance(self.params, Mapping):
            raise InputTypeError(f"params is a {type(self.params).__name__}; expected a mapping of the method's parameters")
        object.__setattr__(self, "align_options", AlignOptions.of(self.align_options).settled())

    @classmethod
    def of(cls, options: MergeOptions | Mapping | None = None, **overrides) -> MergeOptions:
        """`options` (a MergeOptions, a mapping of its fields, or None) with `overrides`."""
        return _options_of(cls, options, overrides, "merge")

    @property
    def aligning(self) -> AlignOptions | None:
        """The align options where the models are aligned, else None."""
        return None if self.align == "none" else self.align_options

    @property
    def residual(self) -> str:
        """The alignment's residual mode ("none" without alignment)."""
        return "none" if self.align == "none" else self.align_options.residual


MERGE_FIELDS = tuple(f.name for f in dataclasses.fields(MergeOptions))


def _options_of(cls, options, overrides: Mapping, what: str):
    """An options dataclass `cls` from `options` (one of it, a mapping of its fields, or None)
    with `overrides` over it; InputTypeError naming keys that are not its fields."""
    fields = [f.name for f in dataclasses.fields(cls)]
    given = {**({} if isinstance(options, cls) else dict(options or {})), **overrides}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise InputTypeError(f"unknown {what} options {unknown}; the options are {fields}")
    if isinstance(options, cls):
        return dataclasses.replace(options, **overrides) if overrides else options
    return cls(**given)


def _layer_labels(layers) -> tuple:
    """Layer indices as a sorted tuple (ints, or the strings a custom spec captures); TypeError
    for what is not a collection of indices (a bool is an int to Python: [True] would silently
    mean layer 1)."""
    if isinstance(layers, (str, bytes, int)) or not isinstance(layers, Collection):
        raise InputTypeError(f"layers={layers!r}; expected a collection of layer indices, e.g. [0, 3], or None for all")
    def is_label(layer) -> bool:  # ints (NumPy's too, named without importing NumPy) or strings, not bools
        if isinstance(layer, bool) or type(layer).__name__ == "bool_":
            return False
        return isinstance(layer, (int, str)) or type(layer).__name__.startswith(("int", "uint"))

    not_labels = [layer for layer in layers if not is_label(layer)]
    if not_labels:
        raise InputTypeError(f"layers={layers!r}: {not_labels} are not layer indices")
    labels = {layer if isinstance(layer, str) else int(layer) for layer in layers}
    return tuple(sorted(labels, key=lambda l: (isinstance(l, str), str(l) if isinstance(l, str) else l)))
