"""Specs: validation errors name the leaf and shapes; custom models and scanned stacks work."""

import dataclasses
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rotsym_jax as rj
from rotsym_jax import HeadGeometry, Spec, SpecError

L, D, H, DH, F = 3, 16, 4, 4, 24
GEO = {"attn": HeadGeometry(num_heads=H, num_kv_heads=H, head_dim=DH)}


def custom_params(key, scanned=False):
    """A plain-dict transformer of our own (not one of the built-in families)."""
    ks = iter(jax.random.split(key, 64))

    def w(*shape):  # divided on the host (the same float32 bits): an eager divide compiled a program per shape
        return jax.device_put(np.asarray(jax.random.normal(next(ks), shape)) * (np.float32(1) / np.float32(np.sqrt(shape[-2] if len(shape) > 1 else 1))))

    layer = lambda: {
        "attn": {"q": w(D, H * DH), "qb": w(H * DH), "k": w(D, H * DH), "v": w(D, H * DH), "o": w(H * DH, D)},
        "mlp": {"fc1": w(D, F), "b1": w(F), "fc2": w(F, D)},
    }
    layers = [layer() for _ in range(L)]
    if scanned:
        return {"stack": jax.tree_util.tree_map(lambda *x: jnp.stack(x), *layers), "emb": w(10, D)}
    return {"blocks": {i: layers[i] for i in range(L)}, "emb": w(10, D)}


def custom_forward(params, ids):
    """Pre-norm-free toy transformer: attention + ReLU MLP with residuals; works for both layouts."""
    x = params["emb"][ids]
    layers = params["blocks"].values() if "blocks" in params else [
        jax.tree_util.tree_map(lambda a, i=i: a[i], params["stack"]) for i in range(L)
    ]
    for p in layers:
        a = p["attn"]
        q = (x @ a["q"] + a["qb"]).reshape(-1, H, DH)
        k, v = (x @ a["k"]).reshape(-1, H, DH), (x @ a["v"]).reshape(-1, H, DH)
        att = jax.nn.softmax(jnp.einsum("thd,shd->hts", q, k) / np.sqrt(DH), axis=-1)
        x = x + jnp.einsum("hts,shd->thd", att, v).reshape(-1, H * DH) @ a["o"]
        x = x + jax.nn.relu(x @ p["mlp"]["fc1"] + p["mlp"]["b1"]) @ p["mlp"]["fc2"]
    return x


CUSTOM_SPEC = Spec(
    rules=(
        (r"blocks/(\d+)/attn/q", (None, "attn.q")),
        (r"blocks/(\d+)/attn/qb", ("attn.q",)),
        (r"blocks/(\d+)/attn/k", (None, "attn.k")),
        (r"blocks/(\d+)/attn/v", (None, "attn.v")),
        (r"blocks/(\d+)/attn/o", ("attn.o", None)),
        (r"blocks/(\d+)/mlp/fc1", (None, "ffn")),
        (r"blocks/(\d+)/mlp/b1", ("ffn",)),
        (r"blocks/(\d+)/mlp/fc2", ("ffn", None)),
        (r"emb", None),
    ),
    heads=GEO,
)

SCANNED_SPEC = Spec(
    rules=(
        (r"stack/attn/q", ("layer", None, "attn.q")),
        (r"stack/attn/qb", ("layer", "attn.q")),
        (r"stack/attn/k", ("layer", None, "attn.k")),
        (r"stack/attn/v", ("layer", None, "attn.v")),
        (r"stack/attn/o", ("layer", "attn.o", None)),
        (r"stack/mlp/fc1", ("layer", None, "ffn")),
        (r"stack/mlp/b1", ("layer", "ffn")),
        (r"stack/mlp/fc2", ("layer", "ffn", None)),
        (r"emb", None),
    ),
    heads=GEO,
)


@pytest.mark.usefixtures("float32_models")  # custom model outputs compared at 1e-5 (conftest)
def test_custom_model_transform_preserves_function():
    params = custom_params(jax.random.key(0))
    ids = jnp.arange(7) % 10
    t = rj.random_transform(CUSTOM_SPEC, params, jax.random.key(1))
    moved = rj.apply_transform(CUSTOM_SPEC, params, t)
    assert not np.allclose(moved["blocks"][1]["attn"]["q"], params["blocks"][1]["attn"]["q"])
    np.testing.assert_allclose(custom_forward(moved, ids), custom_forward(params, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("float32_models")  # custom model outputs compared at 1e-5 (conftest)
def test_scanned_stack_equals_unscanned():
    """A leading layer axis tagged "layer" is the same group as per-layer leaves."""
    plain = custom_params(jax.random.key(0))
    scanned = custom_params(jax.random.key(0), scanned=True)
    ids = jnp.arange(7) % 10
    np.testing.assert_allclose(custom_forward(scanned, ids), custom_forward(plain, ids), rtol=1e-6)
    t = rj.random_transform(CUSTOM_SPEC, plain, jax.random.key(2))
    moved_plain = rj.apply_transform(CUSTOM_SPEC, plain, t)
    moved_scanned = rj.apply_transform(SCANNED_SPEC, scanned, t)
    for i in range(L):
        for path in (("attn", "q"), ("attn", "o"), ("mlp", "fc1"), ("mlp", "b1")):
            a = moved_plain["blocks"][i][path[0]][path[1]]
            b = moved_scanned["stack"][path[0]][path[1]][i]
            np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(custom_forward(moved_scanned, ids), custom_forward(scanned, ids), rtol=1e-5, atol=1e-5)


def test_unmatched_leaf_is_named():
    params = custom_params(jax.random.key(0))
    spec = Spec(rules=CUSTOM_SPEC.rules[:-1], heads=GEO)  # drop the rule for "emb"
    with pytest.raises(SpecError, match=r"leaf emb \(shape \(10, 16\)\) is matched by no rule"):
        rj.bind(spec, params)


def test_wrong_tag_count():
    params = custom_params(jax.random.key(0))
    rules = ((r"blocks/(\d+)/attn/qb", (None, "attn.q")),) + CUSTOM_SPEC.rules
    with pytest.raises(SpecError, match=r"gives 2 tags .* to leaf blocks/0/attn/qb of shape \(16,\)"):
        rj.bind(Spec(rules, heads=GEO), params)


def test_head_split_must_fit():
    params = custom_params(jax.random.key(0))
    bad = {"attn": HeadGeometry(num_heads=4, num_kv_heads=4, head_dim=8)}
    with pytest.raises(SpecError, match=r"blocks/0/attn/[qk] has shape \(16, 16\).*expected 32 = 4 kv groups x 1 heads x 8"):
        rj.bind(Spec(CUSTOM_SPEC.rules, heads=bad), params)
    with pytest.raises(SpecError, match="not a multiple"):
        HeadGeometry(num_heads=6, num_kv_heads=4, head_dim=8)
    with pytest.raises(SpecError, match="rotary_dim"):
        HeadGeometry(num_heads=4, num_kv_heads=4, head_dim=8, rotary_dim=5)


def test_inconsistent_group_size():
    params = custom_params(jax.random.key(0))
    params["blocks"][2]["mlp"]["b1"] = jnp.zeros(F + 1)
    with pytest.raises(SpecError, match=r"permutation group 'ffn' has inconsistent sizes \[24, 25\]"):
        rj.bind(CUSTOM_SPEC, params)


def test_missing_role_and_unknown_block():
    params = custom_params(jax.random.key(0))
    rules = tuple((p, None if p.endswith("/o") else t) for p, t in CUSTOM_SPEC.rules)
    with pytest.raises(SpecError, match="needs q, k, v and o"):
        rj.bind(Spec(rules, heads=GEO), params)
    rules = tuple((p, (None, "self.k") if p.endswith("/k") else t) for p, t in CUSTOM_SPEC.rules)
    with pytest.raises(SpecError, match=r"names attention block 'self'"):
        rj.bind(Spec(rules, heads=GEO), params)


def test_layers_must_agree_within_a_group():
    params = custom_params(jax.random.key(0))
    rules = ((r"blocks/2/mlp/b1", None),) + CUSTOM_SPEC.rules
    with pytest.raises(SpecError, match=r"permutation group 'ffn': its rules cover different layers"):
        rj.bind(Spec(rules, heads=GEO), params)


def test_bad_regex_and_transform_shapes():
    with pytest.raises(SpecError, match="not a valid regex"):
        Spec(rules=((r"blocks/(\d+", None),))
    params = custom_params(jax.random.key(0))
    t = rj.identity_transform(rj.bind(CUSTOM_SPEC, params))
    t["ffn"] = t["ffn"].replace(perm=t["ffn"].perm[:, :-1])
    with pytest.raises(ValueError, match=r"transforms\['ffn'\]\.perm has shape \(3, 23\), expected \(3, 24\)"):
        rj.apply_transform(CUSTOM_SPEC, params, t)


def test_builtin_spec_reads_geometry_from_config():
    import transformers as tf

    spec = rj.spec_for(tf.LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=24))
    assert spec.heads["attn"] == HeadGeometry(6, 2, 24, rotary_dim=24)
    spec = rj.spec_for(tf.GPT2Config(n_embd=48, n_head=3))
    assert spec.heads["attn"] == HeadGeometry(3, 3, 16)
    assert hash(spec) == hash(rj.spec_for(tf.GPT2Config(n_embd=48, n_head=3)))


def test_a_specs_heads_are_immutable_hashable_and_pickle():
    """Spec.heads (a static jit argument's field) compares and hashes by value, refuses writes and
    survives pickling (processes send specs to each other)."""
    import pickle

    heads = {"attn": HeadGeometry(4, 2, 8)}
    spec = Spec(CUSTOM_SPEC.rules, heads)
    assert spec.heads == heads and spec == Spec(CUSTOM_SPEC.rules, dict(heads)) and hash(spec) == hash(Spec(CUSTOM_SPEC.rules, dict(heads)))
    assert hash(spec) != hash(Spec(CUSTOM_SPEC.rules, {"attn": HeadGeometry(4, 4, 8)}))
    with pytest.raises(TypeError):
        spec.heads["attn"] = HeadGeometry(4, 4, 8)
    with pytest.raises(AttributeError):
        spec.heads._items = {}
    assert pickle.loads(pickle.dumps(spec)) == spec


@pytest.mark.usefixtures("float32_models")  # custom model outputs compared at 1e-5 (conftest)
@pytest.mark.parametrize("spec,scanned", [pytest.param(CUSTOM_SPEC, False, marks=pytest.mark.slow), (SCANNED_SPEC, True)], ids=["per-layer", "scanned"])
def test_align_recovers_planted_transform_of_custom_model(spec, scanned):
    params = custom_params(jax.random.key(0), scanned=scanned)
    planted = rj.random_transform(spec, params, jax.random.key(3))
    moved = rj.apply_transform(spec, params, planted)
    result = rj.align(params, moved, spec, heads="permute", rescale="joint")
    assert result.report["before"]["total"] > 1.0
    assert result.report["after"]["total"] <= 1e-5 * result.report["before"]["total"]
    ids = jnp.arange(7) % 10
    np.testing.assert_allclose(custom_forward(result.params, ids), custom_forward(params, ids), rtol=1e-5, atol=1e-5)


def _readme_spec():
    """The spec of docs/guides/own-model.md, executed as written."""
    section = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "own-model.md").read_text()
    block = section[section.index("```python\n") + len("```python\n"):]
    namespace = {}  # nothing but what the page defines
    exec(block[:block.index("```")], namespace)
    return namespace["spec"]


class _NnxAttention(nnx.Module):
    def __init__(self, d, heads, dh, rngs):
        self.heads, self.dh = heads, dh
        self.q, self.k, self.v = (nnx.Linear(d, heads * dh, rngs=rngs) for _ in range(3))
        self.o = nnx.Linear(heads * dh, d, rngs=rngs)

    def __call__(self, x):
        split = lambda y: y.reshape(*y.shape[:-1], self.heads, self.dh)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(self.dh), axis=-1)
        return self.o(jnp.einsum("bhts,bshd->bthd", att, v).reshape(*x.shape[:-1], -1))


class _NnxBlock(nnx.Module):
    def __init__(self, d, heads, dh, f, rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = _NnxAttention(d, heads, dh, rngs)
        self.mlp = nnx.Dict(fc1=nnx.Linear(d, f, rngs=rngs), fc2=nnx.Linear(f, d, rngs=rngs))

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp["fc2"](jax.nn.gelu(self.mlp["fc1"](self.norm2(x))))


class _NnxModel(nnx.Module):
    """A user's own Flax NNX transformer, laid out as the own-model guide's spec expects."""

    def __init__(self, rngs, d=32, heads=8, dh=64, f=48, layers=2, vocab=11):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([_NnxBlock(d, heads, dh, f, rngs) for _ in range(layers)])

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x


def _nnx_model(seed):
    graphdef, state = nnx.split(_NnxModel(nnx.Rngs(seed)))
    params = jax.tree_util.tree_map(  # non-zero biases, so that forgetting one would show
        lambda x: x + 0.3 * jax.random.normal(jax.random.key(seed + 1), x.shape) if x.ndim == 1 else x,
        nnx.to_pure_dict(state),
    )

    def forward(params, ids):
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)(ids)

    return params, forward


@pytest.mark.slow  # 18 s; the custom-spec invariance tests above cover the same machinery by default
@pytest.mark.usefixtures("float32_models")  # custom model outputs compared at 1e-5 (conftest)
def test_readme_spec_on_a_flax_nnx_model():
    spec = _readme_spec()
    params, forward = _nnx_model(0)
    ids = (jnp.arange(14) % 11).reshape(2, 7)
    ref = forward(params, ids)
    planted = rj.random_transform(spec, params, jax.random.key(3))
    moved = rj.apply_transform(spec, params, planted)
    np.testing.assert_allclose(forward(moved, ids), ref, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
    result = rj.align(params, moved, spec)
    assert result.report["after"]["total"] < 0.5 * result.report["before"]["total"]
    np.testing.assert_allclose(forward(result.params, ids), ref, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
    # What the own-model guide warns about: the same spec with the Q bias left to the catch-all rule
    # still binds, but its transforms change the function.
    careless = Spec(rules=tuple(r for r in spec.rules if not r[0].endswith("q/bias")), heads=spec.heads)
    wrong = rj.apply_transform(careless, params, rj.random_transform(careless, params, jax.random.key(3)))
    assert float(jnp.max(jnp.abs(forward(wrong, ids) - ref))) > 1e-3 * float(jnp.max(jnp.abs(ref)))


def test_set_aside_is_the_task_head_and_each_optional_part_not_every_model_holds_alike():
    """One definition for `align`, `align_many` and the streamed runs' layouts: shapes alone."""
    spec = Spec((), task_head=r"head/.*", optional=r"(head|pooler|lm_head)/.*")
    a = {"head/kernel": (4, 2), "pooler/kernel": (4, 4), "pooler/bias": (4,), "lm_head/kernel": (4, 9), "body/kernel": (4, 4)}
    assert spec.set_aside([a, dict(a)]) == {"head/kernel"}
    no_pooler = {p: s for p, s in a.items() if not p.startswith("pooler/")}
    assert spec.set_aside([a, no_pooler]) == {"head/kernel", "pooler/kernel", "pooler/bias"}
    assert spec.set_aside([a, {**a, "lm_head/kernel": (4, 10)}]) == {"head/kernel", "lm_head/kernel"}
    assert spec.set_aside([a, dict(a), no_pooler]) == {"head/kernel", "pooler/kernel", "pooler/bias"}
    assert Spec(()).set_aside([a, no_pooler]) == frozenset()


def test_transforms_are_typed_pytrees():
    """Group elements are pytrees of arrays: they pass through jit, and their algebra holds there."""
    params = custom_params(jax.random.key(0))
    bound = rj.bind(CUSTOM_SPEC, params)
    t = rj.random_transform(bound, params, jax.random.key(1))
    assert isinstance(t["attn"], rj.HeadTransform) and isinstance(t["ffn"], rj.UnitPermutation)
    assert len(jax.tree_util.tree_leaves(t["attn"])) == 6 and len(jax.tree_util.tree_leaves(t["ffn"])) == 1
    undone = jax.jit(lambda x: rj.compose_transforms(x, rj.invert_transform(x)))(t)
    chex.assert_trees_all_close(undone, rj.identity_transform(bound), atol=1e-5)
    with pytest.raises(ValueError, match=r"transforms\['attn'\] is a dict; expected a HeadTransform"):
        rj.apply_transform(bound, params, {**t, "attn": dataclasses.asdict(t["attn"])})
    with pytest.raises(ValueError, match=r"transforms have groups \['attn'\], expected \['attn', 'ffn'\]"):
        rj.apply_transform(bound, params, {"attn": t["attn"]})


def test_bound_spec_is_bound_once_and_checked():
    """A BoundSpec (e.g. a result's) goes wherever a spec goes; on other params it is refused."""
    params = custom_params(jax.random.key(0))
    other = custom_params(jax.random.key(2))
    result = rj.align(params, other, CUSTOM_SPEC)
    assert result.bound == rj.bind(CUSTOM_SPEC, other)
    again = rj.align(params, other, result.bound)
    chex.assert_trees_all_equal((again.params, again.transforms), (result.params, result.transforms))
    narrow = {**other, "blocks": {**other["blocks"], 0: {**other["blocks"][0], "extra": jnp.zeros(3)}}}
    with pytest.raises(SpecError, match=r"the bound spec and params have different leaves: .*only in params \['blocks/0/extra'\]"):
        rj.align(params, narrow, result.bound)


def test_a_leaf_of_two_permutation_groups():
    """Mamba's A_log: channels and state on one leaf. The group with a leaf of its own is solved
    first, the other after it; two groups with no leaf of their own, or a leaf of two groups in a
    scanned stack, are refused by name."""
    params = {"l": {0: {"own": jnp.ones((3, 5)), "shared": jnp.ones((5, 4))}}}
    rules = ((r"l/(\d+)/own", (None, "ch")), (r"l/(\d+)/shared", ("ch", "st")))
    bound = rj.bind(Spec(rules), params)
    assert [(g.name, g.size, g.after) for g in bound.perms] == [("ch", 5, ()), ("st", 4, ("ch",))]
    assert [[m.also for m in g.members] for g in bound.perms] == [[None, ("st", 1)], [("ch", 0)]]  # each member names the other group
    assert [len(g.reads) for g in bound.perms] == [1, 1]  # "ch" costed on its own leaf, "st" on the shared one in its frame
    assert bound.transformed_paths() == ["l/0/own", "l/0/shared"]  # each leaf once
    t = rj.random_transform(bound, params, jax.random.key(0), ("perm",))
    moved = rj.apply_transform(bound, {"l": {0: {"own": jnp.ones((3, 5)), "shared": jnp.arange(20.0).reshape(5, 4)}}}, t)
    want = np.arange(20.0).reshape(5, 4)[np.asarray(t["ch"].perm[0])][:, np.asarray(t["st"].perm[0])]
    np.testing.assert_array_equal(moved["l"][0]["shared"], want)  # each group moved its own axis
    with pytest.raises(SpecError, match=r"every leaf of it carries another group's axis"):
        rj.bind(Spec(((r"l/(\d+)/own", ("st", "ch")), (r"l/(\d+)/shared", ("ch", "st")))), {"l": {0: {"own": jnp.ones((4, 5)), "shared": jnp.ones((5, 4))}}})
    with pytest.raises(SpecError, match=r"two permutation groups in a scanned layer stack"):
        rj.bind(Spec(((r"own", ("layer", "ch")), (r"shared", ("layer", "ch", "st")))), {"own": jnp.ones((2, 5)), "shared": jnp.ones((2, 5, 4))})


CHAIN = Spec(((r"l/(\d+)/up", (None, "adapter")), (r"l/(\d+)/mid", ("adapter", "out_units")), (r"l/(\d+)/out", ("out_units", None))))


def test_two_groups_with_leaves_of_their_own_sharing_a_map_are_solved_in_the_chains_order():
    """Llama 4's adapter: fc1 -> GELU -> fc2 -> GELU -> linear_1, fc1's units ("adapter") on fc2's rows,
    fc2's outputs ("out_units") on its columns and linear_1's rows. The units on the shared map's rows are
    solved first, from their own leaf; the others after, on B's shared map moved by that assignment, so
    what inspect says of each is what the driver does (each said the other was solved after it). Planted:
    linear_1 zero in both models, so that only fc2 tells the outputs' order, which align finds."""
    key = jax.random.split(jax.random.key(0), 2)
    params = {"l": {0: {"up": jax.random.normal(key[0], (3, 6)), "mid": jax.random.normal(key[1], (6, 5)), "out": jnp.zeros((5, 3))}}}
    bound = rj.bind(CHAIN, params)
    assert [(g.name, g.after, len(g.reads)) for g in bound.perms] == [("adapter", (), 1), ("out_units", ("adapter",), 2)]
    said = [g.describe() for g in bound.perms]
    assert said == ["permutation 'adapter': 1 layer, 6 units (2 leaf kinds; 1 of them also on an axis of 'out_units' (solved after this "
                    "group, from its assignment), this one solved from the other 1)",
                    "permutation 'out_units': 1 layer, 5 units (2 leaf kinds), solved after 'adapter' (1 of its leaf kinds carries that "
                    "group's axis too)"], said
    t = rj.random_transform(bound, params, jax.random.key(1), ("perm",))
    t["out_units"] = t["out_units"].replace(perm=t["out_units"].perm[:, ::-1])  # 5 entries reversed: not the identity
    result = rj.align(params, rj.apply_transform(bound, params, t), CHAIN)
    for name in ("adapter", "out_units"):
        np.testing.assert_array_equal(np.asarray(result.transforms[name].perm), np.asarray(t[name].inverse().perm), err_msg=name)
    chex.assert_trees_all_close(result.params, params, atol=1e-6)
    # OT fusion refuses groups whose every leaf is another's (Mamba's state), not this chain, each group with a leaf of its own:
    # A fused with B aligned (A's leaves) is A
    chex.assert_trees_all_close(rj.otfusion.ot_fuse([params, result.params], CHAIN).params, params, atol=1e-6)
    with pytest.raises(SpecError, match=r"each on the rows of some and the columns of others"):
        rj.bind(Spec(((r"l/(\d+)/up", (None, "a")), (r"l/(\d+)/mid", ("a", "b")), (r"l/(\d+)/back", ("b", "a")), (r"l/(\d+)/out", ("b", None)))),
                {"l": {0: {"up": jnp.ones((3, 6)), "mid": jnp.ones((6, 5)), "back": jnp.ones((5, 6)), "out": jnp.ones((5, 3))}}})
    with pytest.raises(SpecError, match=r"a chain of three groups sharing leaves is not supported"):
        rj.bind(Spec(((r"l/(\d+)/up", (None, "a")), (r"l/(\d+)/mid", ("a", "b")), (r"l/(\d+)/bias", ("b",)), (r"l/(\d+)/mid2", ("b", "c")),
                      (r"l/(\d+)/out", ("c", None)))),
                {"l": {0: {"up": jnp.ones((3, 6)), "mid": jnp.ones((6, 5)), "bias": jnp.ones(5), "mid2": jnp.ones((5, 4)), "out": jnp.ones((4, 3))}}})
