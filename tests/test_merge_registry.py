"""The merge-method registry: `merge.merge(name, ...)` is exactly the method's function, the
declared options cannot drift from the functions' signatures, and every misuse is refused with an
error that names it."""

import inspect
import math

import jax
import numpy as np
import pytest
from test_merge import fisher_stats, gram_stats, make

import rotsym_jax as rj
from rotsym_jax import merge, otfusion
from rotsym_jax.merging import mergekit, registry, tensorwise
from rotsym_jax.pytree import flatten

NAMES = {"average", "fisher", "regmean", "task_arithmetic", "ties", "dare", "slerp", "ot_fusion"}
# The function each method wraps (the others are registered as the function itself).
IMPLEMENTATIONS = {"slerp": merge.slerp, "ot_fusion": otfusion.ot_fuse}

SPEC = rj.Spec(
    rules=(
        (r"blocks/(\d+)/attn/q/kernel", (None, "attn.q")),
        (r"blocks/(\d+)/attn/k/kernel", (None, "attn.k")),
        (r"blocks/(\d+)/attn/v/kernel", (None, "attn.v")),
        (r"blocks/(\d+)/attn/o/kernel", ("attn.o", None)),
        (r"blocks/(\d+)/mlp/fc1/kernel", (None, "ffn")),
        (r"blocks/(\d+)/mlp/fc1/bias", ("ffn",)),
        (r"blocks/(\d+)/mlp/fc2/kernel", ("ffn", None)),
        (r".*", None),
    ),
    heads={"attn": rj.HeadGeometry(num_heads=2, num_kv_heads=2, head_dim=2)},
)


def tiny_transformer(seed):
    """One attention block (2 heads of width 2) and one FFN (6 units) for SPEC."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: rng.normal(size=shape).astype(np.float32)
    attn = {role: {"kernel": r(4, 4)} for role in "qkvo"}
    mlp = {"fc1": {"kernel": r(4, 6), "bias": r(6)}, "fc2": {"kernel": r(6, 4)}}
    return {"blocks": {0: {"attn": attn, "mlp": mlp}}, "head": {"kernel": r(4, 3)}}


def case(name):
    """(models, inputs, non-default options, direct call) for one method."""
    models, base, key = [make(0), make(1)], make(100), jax.random.key(3)
    if name == "average":
        return models, dict(weights=[1, 2]), {}, lambda: merge.average(models, [1, 2])
    if name == "fisher":
        fishers = [fisher_stats(m, i) for i, m in enumerate(models)]
        return models, dict(fishers=fishers, weights=[3, 1]), dict(eps=1e-3), lambda: merge.fisher(models, fishers, [3, 1], eps=1e-3)
    if name == "regmean":
        grams = [gram_stats(m, i) for i, m in enumerate(models)]
        return models, dict(grams=grams), dict(alpha=0.7, jitter=0.1), lambda: merge.regmean(models, grams, alpha=0.7, jitter=0.1)
    if name == "task_arithmetic":
        return models, dict(base=base), dict(lam=0.4), lambda: merge.task_arithmetic(base, models, lam=0.4)
    if name == "ties":
        return models, dict(base=base), dict(density=0.5, lam=0.8), lambda: merge.ties(base, models, density=0.5, lam=0.8)
    if name == "dare":
        options = dict(drop=0.5, then="task_arithmetic", lam=0.7)  # then="ties": 5 s more to compile
        return models, dict(base=base, key=key), options, lambda: merge.dare(base, models, key, **options)
    if name == "slerp":
        return models[:2], {}, dict(t=0.3), lambda: merge.slerp(models[0], models[1], 0.3)
    if name == "ot_fusion":
        tiny = [tiny_transformer(0), tiny_transformer(1)]
        options = dict(transport="soft", sinkhorn_reg=0.5)
        return tiny, dict(spec=SPEC, weights=[2, 1]), options, lambda: otfusion.ot_fuse(tiny, SPEC, weights=[2, 1], **options).params
    raise AssertionError(name)


def assert_bitwise_equal(p, q):
    leaves_p, leaves_q = jax.tree_util.tree_leaves_with_path(p), jax.tree_util.tree_leaves_with_path(q)
    assert [path for path, _ in leaves_p] == [path for path, _ in leaves_q]
    for (path, x), (_, y) in zip(leaves_p, leaves_q):
        assert np.asarray(x).dtype == np.asarray(y).dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_the_registry_lists_every_method():
    assert set(merge.METHODS) == NAMES
    with pytest.raises(TypeError):
        merge.METHODS["mine"] = merge.METHODS["average"]  # read-only; `register` adds methods
    with pytest.raises(ValueError, match="'ties' is already registered"):
        merge.register(merge.METHODS["ties"])


@pytest.mark.parametrize("name", sorted(NAMES))
def test_merge_is_the_methods_function(name):
    models, inputs, options, direct = case(name)
    assert_bitwise_equal(merge.merge(name, models, **inputs, **options), direct())


@pytest.mark.parametrize("name", sorted(NAMES))
def test_declarations_match_the_signatures(name):
    """Every option with a default is declared with that default, and the inputs are the
    function's; so a declaration cannot drift from its function."""
    method = merge.METHODS[name]
    signature = inspect.signature(IMPLEMENTATIONS.get(name, method.fn)).parameters
    options = {k: p.default for k, p in signature.items() if p.default is not p.empty and k not in merge.INPUTS}
    assert options.pop("task_head") == "anchor"
    assert options == {k: p.default for k, p in method.params.items()}
    assert all(type(p.default) is p.type for p in method.params.values())
    inputs = {k for k in signature if k in merge.INPUTS}
    assert method.needs | method.optional == inputs
    assert {k for k in inputs if signature[k].default is signature[k].empty} == method.needs


@pytest.mark.parametrize("name", sorted(NAMES))
def test_declared_ranges_are_the_functions(name):
    """A value just outside each declared interval, or outside the choices, is refused by the
    function itself with the same message as by `merge`."""
    models, inputs, _, _ = case(name)
    impl = IMPLEMENTATIONS.get(name, merge.METHODS[name].fn)
    bad = []
    for p in merge.METHODS[name].params.values():
        if p.type is str:
            bad.append((p.name, "nonsense"))
        if p.low is not None:
            bad.append((p.name, p.low if p.low_open else p.low - 0.5))
        if p.high is not None:
            bad.append((p.name, p.high if p.high_open else p.high + 0.5))
        if p.type is float:
            bad.append((p.name, math.inf))
    for option, value in bad:
        with pytest.raises(ValueError) as via_merge:
            merge.merge(name, models, **inputs, **{option: value})
        assert f"{option}={value!r}" in str(via_merge.value)
        if name == "slerp":
            call = lambda option=option, value=value: impl(*models, **inputs, **{option: value})
        else:
            call = lambda option=option, value=value: impl(params_list=models, **inputs, **{option: value})
        with pytest.raises(ValueError) as direct:
            call()
        assert str(direct.value) == str(via_merge.value)


def test_misuse_is_refused_by_name():
    models, base = [make(0), make(1)], make(100)
    with pytest.raises(ValueError, match=r"unknown merge method 'soup'; known methods: \['average', 'dare'"):
        merge.merge("soup", models)
    with pytest.raises(ValueError, match=r"'ties' has no parameter 'lambda'; its parameters: \['density', 'lam'\]"):
        merge.merge("ties", models, base=base, **{"lambda": 0.5})
    with pytest.raises(ValueError, match=r"'average' has no parameter 'lam'; its parameters: \[\]"):
        merge.merge("average", models, lam=0.5)
    with pytest.raises(ValueError, match="merge method 'task_arithmetic' needs a base model: the model the others were fine-tuned from$"):
        merge.merge("task_arithmetic", models)
    with pytest.raises(ValueError, match="merge method 'dare' needs base and key"):
        merge.merge("dare", models)
    with pytest.raises(ValueError, match="merge method 'fisher' needs fishers"):
        merge.merge("fisher", models)
    with pytest.raises(ValueError, match="merge method 'regmean' needs grams"):
        merge.merge("regmean", models)
    with pytest.raises(ValueError, match="merge method 'ot_fusion' needs spec"):
        merge.merge("ot_fusion", models)
    with pytest.raises(ValueError, match=r"'average' does not use base: it takes \['weights'\]; the methods that take base: \['dare', 'task_arithmetic', 'ties'\]"):
        merge.merge("average", models, base=base)
    with pytest.raises(ValueError, match=r"'slerp' does not use weights: it takes no other inputs; the methods that take weights: \['average', 'fisher'"):
        merge.merge("slerp", models, weights=[1, 1])
    with pytest.raises(ValueError, match=r"density='high'; density must be a finite number in \(0, 1\]"):
        merge.merge("ties", models, base=base, density="high")
    with pytest.raises(ValueError, match=r"density=1.5; density must be a finite number in \(0, 1\]"):
        merge.merge("ties", models, base=base, density=1.5)
    with pytest.raises(ValueError, match=r"then=3; choose one of \('task_arithmetic', 'ties'\)"):
        merge.merge("dare", models, base=base, key=jax.random.key(0), then=3)
    with pytest.raises(ValueError, match=r"task_head='both'; choose one of"):
        merge.merge("average", models, task_head="both")
    with pytest.raises(ValueError, match="'slerp' merges at most 2 models; got 3"):
        merge.merge("slerp", [*models, base])
    with pytest.raises(ValueError, match=r"params_list has 1 model; merging needs at least 2"):
        merge.merge("average", models[:1])


def test_params_parse_their_text():
    ties, dare = merge.METHODS["ties"].params, merge.METHODS["dare"].params
    assert ties["density"].parse("0.25") == 0.25 and dare["then"].parse("ties") == "ties"
    with pytest.raises(ValueError, match=r"density='dense'; expected a number"):
        ties["density"].parse("dense")
    with pytest.raises(ValueError, match=r"density=0.0; density must be"):
        ties["density"].parse("0")
    with pytest.raises(ValueError, match=r"then='mean'; choose one of"):
        dare["then"].parse("mean")
    count = merge.Param("count", int, 1, "a count", low=1)
    assert count.parse("3") == 3 and count.check(np.int64(2)) == 2
    with pytest.raises(ValueError, match="count=1.5; count must be an int"):
        count.check(1.5)
    with pytest.raises(ValueError, match=r"count=0; count must be a finite number in \[1, inf\)"):
        count.parse("0")


def test_methods_declare_what_a_leaf_of_their_result_reads():
    """The granularities decide what a streamed run may do (streaming.streamed_method): entry by
    entry methods take row blocks, tensor-wise ones chunks of layers, OT fusion the models whole;
    a method needing an input a chunk cannot give is refused by name."""
    grain = {name: m.granularity for name, m in merge.METHODS.items()}
    assert grain == {"average": "element", "fisher": "element", "task_arithmetic": "element", "regmean": "tensor", "ties": "tensor",
                     "dare": "tensor", "slerp": "tensor", "ot_fusion": "model"}
    assert {name: m.statistics for name, m in merge.METHODS.items() if m.statistics} == {"fisher": "fishers", "regmean": "grams"}
    assert [name for name, m in merge.METHODS.items() if m.unstreamed()] == ["ot_fusion"]
    fn = merge.METHODS["average"].fn
    assert "spec" in merge.Method("x", fn, {}, needs=frozenset({"spec"}), granularity="tensor").unstreamed()
    assert "in-memory path only" in merge.Method("y", fn, {}, needs=frozenset({"fishers"}), granularity="element").unstreamed()
    with pytest.raises(ValueError, match=r"granularity='leaf'; choose one of \('element', 'tensor', 'model'\)"):
        merge.Method("z", fn, {}, granularity="leaf")
    # `merge` tells inputs from options by name: an option named as an input is refused where it is declared
    with pytest.raises(ValueError, match=r"method 'w': parameters \['weights'\] are named as inputs"):
        merge.Method("w", fn, {"weights": merge.Param("weights", float, 1.0, "a weight")})
    ties = merge.METHODS["ties"]
    assert ties.bind(2, {"density": 0.5}, {"base"}) == {"density": 0.5}
    with pytest.raises(ValueError, match="give at least two models to merge, got 1"):
        ties.bind(1, {}, {"base"})


# ---- one registry for rotsym's methods and mergekit's ---------------------------------------------------

def _mean_leaves(params_list, *, scale=1.0, task_head="anchor"):
    """A user's method, in memory: the models' mean times `scale` (the head merged too)."""
    return jax.tree.map(lambda *xs: (sum(np.asarray(x, np.float32) for x in xs) / len(xs) * np.float32(scale)).astype(np.asarray(xs[0]).dtype),
                        *params_list)


def _mean_tensor(tensors, base, shared, inputs, rng):
    """The same method, one tensor at a time."""
    return (sum(tensors) / len(tensors) * np.float32(shared["scale"])).astype(np.float32)


def test_both_vocabularies_hold_methods_of_one_declaration_type():
    """rotsym's methods and mergekit's are `registry.Method`s with `registry.Param`s: one
    declaration type, one registry, a vocabulary per implementation."""
    assert merge.Method is registry.Method and merge.Param is registry.Param and merge.METHODS is registry.METHODS
    assert tensorwise.METHODS is registry.MERGEKIT
    for vocabulary, methods in (("rotsym", merge.METHODS), ("mergekit", tensorwise.METHODS)):
        for name, m in methods.items():
            assert type(m) is registry.Method and m.name == name and vocabulary in m.vocabularies, name
            assert all(type(p) is registry.Param for p in m.params.values()), name
    assert all(m.jax is not None and m.tensorwise is None for m in merge.METHODS.values())
    assert all(m.tensorwise is not None and m.jax is None for m in tensorwise.METHODS.values())


def test_a_name_in_both_vocabularies_is_two_methods_whose_difference_is_written_down():
    """rotsym's ties, slerp and task_arithmetic are not mergekit's: other parameters (ties: lam and
    one density; mergekit's: per-model weight and density, normalize, lambda) and other arithmetic.
    Each pair is two declarations; the pairs that differ say why (mergekit.NOT_MERGEKIT, refused by
    the converters), the one that agrees (task_arithmetic) converts, which test_mergekit checks on
    the merged tensors."""
    shared = set(merge.METHODS) & set(tensorwise.METHODS)
    assert shared == {"slerp", "task_arithmetic", "ties"}
    for name in shared:
        ours, theirs = merge.METHODS[name], tensorwise.METHODS[name]
        assert ours is not theirs and set(ours.params) != set(theirs.params), name
    assert set(mergekit.NOT_MERGEKIT) == {"ties", "slerp", "dare"}  # dare: mergekit's dare_linear and dare_ties
    assert {name for name in shared if name not in mergekit.NOT_MERGEKIT} == {"task_arithmetic"}  # converts: test_mergekit
    assert merge.METHODS["ties"].params["density"].default == 0.2 and tensorwise.METHODS["ties"].params["density"].default == 1.0
    assert tensorwise.METHODS["ties"].params["weight"].required and tensorwise.METHODS["ties"].params["weight"].scope == "non_base"


def test_a_method_declared_once_runs_both_implementations():
    """One declaration with a jax and a tensorwise implementation enters both vocabularies under
    its one name and parameters; `merge.merge` runs the jax one, `merge_tensor` the other, and
    both agree on every leaf. A jax-only method may take a mergekit name (rotsym's vocabulary is
    its own), and a name is registered once per vocabulary."""
    scale = merge.Param("scale", float, 1.0, "a factor", low=0.0)
    try:
        both = merge.register(merge.Method("scaled_mean", _mean_leaves, {"scale": scale}, granularity="element", tensorwise=_mean_tensor))
        assert merge.METHODS["scaled_mean"] is both is tensorwise.METHODS["scaled_mean"]
        models = [make(0), make(1), make(2)]
        flat = [flatten(m) for m in models]
        for path, leaf in flatten(merge.merge("scaled_mean", models, scale=0.5, task_head="merge")).items():
            got = tensorwise.merge_tensor(both, [f[path] for f in flat], None, {"scale": 0.5}, [{}] * 3, None)
            np.testing.assert_allclose(got, np.asarray(leaf), rtol=1e-6, err_msg=path)
        with pytest.raises(ValueError, match="'scaled_mean' is already registered as a mergekit method"):
            merge.register(merge.Method("scaled_mean", None, {"scale": scale}, tensorwise=_mean_tensor))
        linear = merge.register(merge.Method("linear", _mean_leaves, {}))  # mergekit's linear is another vocabulary's
        assert tensorwise.METHODS["linear"] is not linear and merge.METHODS["linear"] is linear
    finally:
        registry._VOCABULARIES["rotsym"].pop("scaled_mean", None)
        registry._VOCABULARIES["mergekit"].pop("scaled_mean", None)
        registry._VOCABULARIES["rotsym"].pop("linear", None)
    assert "scaled_mean" not in merge.METHODS and "linear" not in merge.METHODS and "linear" in tensorwise.METHODS


def test_a_declaration_is_refused_where_an_implementation_cannot_take_it():
    fn = merge.METHODS["average"].jax
    with pytest.raises(ValueError, match="'none' has no implementation: give jax"):
        merge.Method("none", None, {})
    weight = merge.Param("weight", float, 1.0, "a weight", scope="non_base")
    with pytest.raises(ValueError, match=r"parameters \['weight'\] are per model; its jax implementation takes shared parameters only"):
        merge.Method("per_model", fn, [weight])
    merge.Method("per_model", None, [weight], needs={"base"}, tensorwise=_mean_tensor)  # a tensorwise implementation takes them
    with pytest.raises(ValueError, match=r"inputs \['fishers'\]; a tensorwise implementation takes \['base', 'key'\] only"):
        merge.Method("stats", None, {}, needs={"fishers"}, tensorwise=_mean_tensor)
    with pytest.raises(ValueError, match=r"bad declaration of 'x'"):
        merge.Method("scoped", fn, {"x": merge.Param("x", float, 1.0, scope="everywhere")})
    with pytest.raises(ValueError, match="min_models=3, max_models=2"):
        merge.Method("counts", fn, {}, min_models=3, max_models=2)
    with pytest.raises(ValueError, match=r"unknown merge method 'linear'; known methods: \['average'"):
        merge.merge("linear", [make(0), make(1)])  # mergekit's linear is not rotsym's to run
    flag = merge.Param("flag", bool, False, "a flag")
    assert flag.parse("true") is True and flag.check(np.bool_(False)) is False
    with pytest.raises(ValueError, match="flag=1; flag must be true or false"):
        flag.check(1)
    with pytest.raises(ValueError, match=r"where: flag = 2; expected true or false"):
        flag.read(2, "where")
    ranged = merge.Param("share", float, 0.5, low=0.0, high=1.0)
    assert ranged.read("0.25", "where") == 0.25  # text read as mergekit's pydantic reads it
    with pytest.raises(ValueError, match=r"where: share=1.5; share must be a finite number in \[0, 1\]"):
        ranged.read(1.5, "where")


def test_mergekit_methods_declared_entry_by_entry_merge_row_blocks_as_the_whole():
    """The granularity a mergekit method declares is what its kernel reads: an "element" method's
    result on a block of rows is that block of its result on the whole tensor; a "tensor" one
    (ties' trim, slerp's angle) differs, so the check can fail."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(8, 5)).astype(np.float32)
    others = [base + rng.normal(size=(8, 5)).astype(np.float32) * s for s in (0.1, 0.2, 0.3)]
    differs = set()
    for name, m in tensorwise.METHODS.items():
        n = 1 if m.max_models == 1 else 2
        tensors = [base, *others[:n]] if m.base != "ignored" else others[:max(n, m.min_models)]
        base_index = 0 if m.base != "ignored" else None
        shared = {p.name: 0.5 if p.required else p.default for p in m.shared()}
        values = {"density": 0.5}  # a trim that trims (the default, 1, keeps every entry)
        per_input = [{p.name: 0.7 if p.required else values.get(p.name, p.default) for p in m.per_input() if i != base_index or p.scope == "input"}
                     for i in range(len(tensors))]
        run = lambda rows, m=m, tensors=tensors, base_index=base_index, shared=shared, per_input=per_input: tensorwise.merge_tensor(
            m, [x[rows] for x in tensors], base_index, shared, per_input, np.random.default_rng)
        whole, top = run(slice(None)), run(slice(0, 3))
        if m.granularity == "element":
            np.testing.assert_array_equal(top, whole[:3], err_msg=name)
        elif not np.array_equal(top, whole[:3]):
            differs.add(name)
    assert {name for name, m in tensorwise.METHODS.items() if m.granularity == "element"} == {
        "linear", "passthrough", "nearswap", "ram", "task_arithmetic"}
    assert {"ties", "slerp", "model_stock", "karcher"} <= differs
