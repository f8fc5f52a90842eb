"""AFMoE (model type afmoe). The generic contracts run on its rows of family_cases.py; here, what is
particular: which maps of AFMoE's weights keep transformers' outputs, applied to its own state dict
(independently of our engine): the attention's (its output gated per entry), the mixture's (the
router's rows and expert bias with their expert) and the stream's (four norms a layer); what breaks
(V/O rotations, a rotation of the stream, a rotation of a rotary pair under the QK-norm's gain);
every group our record holds proven by `verify_groups`; experts stored stacked."""

import dataclasses

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import AFMOE
from parity_utils import save_reference, token_batch
from safetensors.numpy import save_file

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.pytree import flatten
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")
torch = pytest.importorskip("torch")

H, G, DH, D, E, F = 4, 2, 8, 32, 4, 16
R = H // G


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(folder, model, batch, state): a causal LM with biases, muP's embedding scale, a window, a full
    layer without RoPE; its expert biases far from zero, so they decide picks."""
    folder = tmp_path_factory.mktemp("afmoe") / "lm"
    model = save_reference(tf.AfmoeForCausalLM, tf.AfmoeConfig(**AFMOE, attention_bias=True, mup_enabled=True, route_scale=1.5), folder)
    with torch.no_grad():
        for layer in model.model.layers[AFMOE["num_dense_layers"]:]:
            layer.mlp.expert_bias.copy_(torch.as_tensor(np.random.default_rng(0).normal(0, 0.5, E)))
    model.save_pretrained(folder)
    ids, mask = token_batch(AFMOE["vocab_size"], pad_id=0)
    return folder, model, (ids, mask), _state(model)  # (the tests load other states into `model`: its own is kept here)


def _logits(model, state, batch):
    model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    ids, mask = batch
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    return np.where(mask[..., None].astype(bool), out, 0.0)


def _layers(state):
    return sorted({int(k.split(".")[2]) for k in state if k.startswith("model.layers.")})


def _rows(x, index):
    """x (H*dh, ...) or (G*dh, ...) reordered or mapped by rows: `index` a function of the (heads, dh, ...) view."""
    return index(x.reshape(-1, DH, *x.shape[1:])).reshape(x.shape)


def _attention(state, q=None, k=None, v=None, o=None, gate=None):
    """Each layer's attention mapped: q, k, v (rows of weight and bias) and gate (rows), o (the
    weight's columns) by functions of their (heads, dh, ...) views."""
    out = dict(state)
    for i in _layers(state):
        a = f"model.layers.{i}.self_attn."
        for f, names in ((q, ("q_proj.weight", "q_proj.bias")), (k, ("k_proj.weight", "k_proj.bias")), (v, ("v_proj.weight", "v_proj.bias")),
                         (gate, ("gate_proj.weight",))):
            for name in names if f is not None else ():
                out[a + name] = _rows(state[a + name], f)
        if o is not None:
            out[a + "o_proj.weight"] = _rows(state[a + "o_proj.weight"].T, o).T
    return out


def _per_group(maps):
    """The query heads' view (H, dh, ...) mapped by their kv group's map: maps[g](x (dh, ...))."""
    return lambda x: np.stack([maps[h // R](x[h]) for h in range(x.shape[0])])


def _kv(maps):
    return lambda x: np.stack([maps[g](x[g]) for g in range(x.shape[0])])


def _rotate(matrices):
    """maps x (dh, ...) -> M^T x per group: the rows of V (x -> x M on outputs) or, on O's columns, O M."""
    return [lambda x, m=m: np.tensordot(m.T, x, axes=1) for m in matrices]


def _stream(state, m, gains):
    """The stream x -> x m (m orthogonal, d x d): the embeddings and writers' rows, the readers'
    columns; `gains(w)`: a norm's new gain."""
    out = {}
    readers = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight", "router.gate.weight", "lm_head.weight")
    for key, x in state.items():
        if key.endswith(("embed_tokens.weight", "o_proj.bias") + readers):
            out[key] = x @ m  # (rows, d)
        elif key.endswith("experts.gate_up_proj"):
            out[key] = np.einsum("eod,dn->eon", x, m)  # (E, 2f, d)
        elif key.endswith(("o_proj.weight", "down_proj.weight")):
            out[key] = m.T @ x  # (d, in)
        elif key.endswith("experts.down_proj"):
            out[key] = np.einsum("dn,edf->enf", m, x)  # (E, d, f)
        elif key.endswith("layernorm.weight") or key == "model.norm.weight":
            out[key] = gains(x)
        else:
            out[key] = x
    return out


def _state(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _signed_permutation(rng, n):
    return np.eye(n)[rng.permutation(n)] * rng.choice([-1.0, 1.0], n)


def _kept(reference):
    """{element: B's state} for every map that should keep the function."""
    _, model, _, state = reference
    rng = np.random.default_rng(1)
    group_perm, head_perm = rng.permutation(G), np.stack([rng.permutation(R) for _ in range(G)])
    query = lambda x: x[[group_perm[h // R] * R + head_perm[h // R][h % R] for h in range(H)]]  # noqa: E731
    pairs = [np.tile(rng.choice([-1.0, 1.0], DH // 2), 2) for _ in range(G)]
    flips = [lambda x, s=s: x * s.reshape(-1, *(1,) * (x.ndim - 1)) for s in pairs]
    scales = [rng.choice([-1.0, 1.0], DH) * np.exp(rng.uniform(-0.7, 0.7, DH)) for _ in range(G)]
    dims = [rng.permutation(DH) for _ in range(G)]
    m = _signed_permutation(rng, D)
    expert, units, unit_scale = rng.permutation(E), rng.permutation(F), np.exp(rng.uniform(-0.7, 0.7, F))
    return {
        "head permutations (gate rows with them)": _attention(state, q=query, k=lambda x: x[group_perm], v=lambda x: x[group_perm], o=query,
                                                              gate=query),
        "QK sign flips of rotary pairs": _attention(state, q=_per_group(flips), k=_kv(flips)),
        "V/O sign flips and scales per entry": _attention(state, v=_kv([lambda x, c=c: x * c.reshape(-1, *(1,) * (x.ndim - 1)) for c in scales]),
                                                          o=_per_group([lambda x, c=c: x / c[:, None] for c in scales])),
        "V/O permutations of a head's entries (gate rows with them)": _attention(state, v=_kv([lambda x, p=p: x[p] for p in dims]),
                                                                                 o=_per_group([lambda x, p=p: x[p] for p in dims]),
                                                                                 gate=_per_group([lambda x, p=p: x[p] for p in dims])),
        "experts (router rows, expert bias)": _experts(state, expert),
        "units of every MLP and expert, with scales": _units(state, units, unit_scale),
        "stream: signed permutation, gains permuted": _stream(state, m, lambda g: g @ np.abs(m)),
    }


def _experts(state, perm):
    out = dict(state)
    for key, x in state.items():
        if key.endswith(("router.gate.weight", "expert_bias", "experts.gate_up_proj", "experts.down_proj")):
            out[key] = x[perm]
    return out


def _units(state, perm, scale):
    """Each MLP's (dense, shared, every expert) units permuted, up scaled by `scale`, down by its inverse."""
    out = dict(state)
    for key, x in state.items():
        if key.endswith(("mlp.gate_proj.weight", "shared_experts.gate_proj.weight")):
            out[key] = x[_wide(perm, x.shape[0])]
        elif key.endswith(("mlp.up_proj.weight", "shared_experts.up_proj.weight")):
            p = _wide(perm, x.shape[0])
            out[key] = x[p] * _wide(scale, x.shape[0])[:, None]
        elif key.endswith(("mlp.down_proj.weight", "shared_experts.down_proj.weight")):
            out[key] = x[:, _wide(perm, x.shape[1])] / _wide(scale, x.shape[1])[None]
        elif key.endswith("experts.gate_up_proj"):
            gate, up = np.split(x, 2, axis=1)
            out[key] = np.concatenate([gate[:, perm], up[:, perm] * scale[None, :, None]], axis=1)
        elif key.endswith("experts.down_proj"):
            out[key] = x[:, :, perm] / scale
    return out


def _wide(x, n):
    """A permutation (or scales) of F units extended blockwise to n = k F units (the dense MLP's 48 = 3 x 16)."""
    if n % F:
        return np.arange(n) if x.dtype.kind == "i" else np.ones(n)
    blocks = n // F
    return np.concatenate([x + F * b for b in range(blocks)]) if x.dtype.kind == "i" else np.tile(x, blocks)


def _relative(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_the_maps_that_keep_transformers_outputs(reference):
    """Head permutations move the gate's rows with the query heads; a head's V/O entries may be
    flipped, scaled and permuted one by one (the gate's rows permuted likewise), since the gate
    multiplies entry by entry; Q/K's rotary pairs flip together; experts move with their router rows
    and biases; the stream permutes with its sign flips, every gain permuted."""
    _, model, batch, state = reference
    want = _logits(model, state, batch)
    for element, moved in _kept(reference).items():
        assert any(not np.array_equal(moved[k], state[k]) for k in state), f"{element}: nothing moved"
        assert _relative(_logits(model, moved, batch), want) <= 1e-4, element


def test_the_maps_that_break_it(reference):
    """A V/O rotation (the gate sees V's entries one by one), a rotation of a rotary pair of Q/K (the
    QK-norm's gains differ between its two entries), and a rotation of the stream with the
    pre-norms' gains folded (the output norms' gains cannot fold): each changes the logits. The
    last holds once the output norms' gains are equal: they alone break it."""
    _, model, batch, state = reference
    rng = np.random.default_rng(2)
    want = _logits(model, state, batch)
    rotations = [np.linalg.qr(rng.normal(size=(DH, DH)))[0] for _ in range(G)]
    vo = _attention(state, v=_kv(_rotate(rotations)), o=_per_group(_rotate(rotations)))
    angle = [np.eye(DH) for _ in range(G)]
    for r in angle:  # pair (0, dh/2) turned by 0.5 rad: commutes with RoPE, not with the QK-norm's gains
        r[[0, 0, DH // 2, DH // 2], [0, DH // 2, 0, DH // 2]] = np.cos(0.5), np.sin(0.5), -np.sin(0.5), np.cos(0.5)
    qk = _attention(state, q=_per_group(_rotate(angle)), k=_kv(_rotate(angle)))
    rotation = np.linalg.qr(rng.normal(size=(D, D)))[0]
    folded, equal = _folded(state), _folded(state, equal_output_gains=True)
    assert _relative(_logits(model, folded, batch), want) <= 1e-4  # the folds are exact
    for element, changed in (("V/O rotations", vo), ("a rotary pair's rotation under the QK-norm", qk),
                             ("a rotation of the stream", _stream(folded, rotation, lambda g: g))):
        assert _relative(_logits(model, changed, batch), want) > 1e-2, element
    equal_logits = _logits(model, equal, batch)
    assert _relative(_logits(model, _stream(equal, rotation, lambda g: g), batch), equal_logits) <= 1e-4


def _folded(state, equal_output_gains=False):
    """The pre-norms' and the final norm's gains folded into their readers (gains 1), exactly; with
    `equal_output_gains`, the output norms' gains set to their mean (another model)."""
    out = dict(state)
    readers = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.gate_proj"),
               "pre_mlp_layernorm": ("mlp.gate_proj", "mlp.up_proj", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                                     "mlp.router.gate", "mlp.experts.gate_up_proj")}
    for i in _layers(state):
        for norm, names in readers.items():
            g = state[f"model.layers.{i}.{norm}.weight"]
            out[f"model.layers.{i}.{norm}.weight"] = np.ones_like(g)
            for name in names:
                key = f"model.layers.{i}.{name}" + ("" if name.endswith("gate_up_proj") else ".weight")
                if key in state:
                    out[key] = state[key] * g
        for norm in ("post_attention_layernorm", "post_mlp_layernorm"):
            key = f"model.layers.{i}.{norm}.weight"
            out[key] = np.full_like(state[key], state[key].mean()) if equal_output_gains else state[key]
    out["lm_head.weight"], out["model.norm.weight"] = state["lm_head.weight"] * state["model.norm.weight"], np.ones(D, np.float32)
    return out


def test_every_group_of_the_record_holds_in_transformers(reference):
    """verify_groups proves the record's groups in transformers: head permutations with the gate's
    rows, Q/K's and V/O's sign flips, V/O's scales, the experts and units, the dense MLPs' unit scales, the stream's signed
    permutations; it names what the record leaves out and why."""
    checks = {c.element: c for c in verify_groups(reference[0])}
    proven = {e for e, c in checks.items() if c.ok and c.difference is not None}
    assert all(c.ok for c in checks.values()) and proven == {"head permutations", "QK rotations", "VO rotations", "VO scales",
                                                             "FFN unit permutations", "FFN unit scales", "residual permutation",
                                                             "residual signed permutation"}, checks
    assert "gated" in checks["VO invertible maps"].note and "sign flips of each entry" in checks["VO rotations"].group


def test_a_vo_rotation_is_refused_as_no_element_of_the_gated_group(reference):
    """The element's check: under the gate V/O's maps must be sign flips of each entry."""
    ck = rj.load_hf(reference[0])
    spec = rj.spec_for(ck)
    t = rj.identity_transform(rj.bind(spec, ck.params))
    rotation = np.linalg.qr(np.random.default_rng(3).normal(size=(DH, DH)))[0].astype(np.float32)
    t["attn"] = t["attn"].replace(vo=np.broadcast_to(rotation, t["attn"].vo.shape))
    with pytest.raises(ValueError, match=r"\['attn'\]\.vo.*gated entry by entry"):
        rj.apply_transform(spec, ck.params, t)


def test_a_gate_without_gated_heads_is_refused_when_bound(reference):
    """The gate's rows (tag attn.g) belong to a block whose geometry says its outputs are gated."""
    ck = rj.load_hf(reference[0])
    spec = rj.spec_for(ck)
    ungated = dataclasses.replace(spec, heads={"attn": dataclasses.replace(spec.heads["attn"], gated_output=False)})
    with pytest.raises(ValueError, match=r"attn\.g.*gated_output=True"):
        rj.bind(ungated, ck.params)


def test_experts_stored_stacked_read_as_the_ones_stored_apart(reference, tmp_path):
    """transformers 5's state dict holds the experts stacked (`mlp.experts.gate_up_proj`): read into the
    same leaves, and written back stacked."""
    folder, _, _, state = reference
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((folder / "config.json").read_text())
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, stacked / "model.safetensors")
    a, b = rj.load_hf(folder), rj.load_hf(stacked)
    assert b.layout.stacked_experts and not a.layout.stacked_experts
    flat_a, flat_b = flatten(a.params), flatten(b.params)
    assert flat_a.keys() == flat_b.keys() and all(np.array_equal(flat_a[k], flat_b[k]) for k in flat_a)
    saved = rj.save_hf(b, b.params, tmp_path / "out")
    files = hf.TensorFiles(saved)
    try:
        np.testing.assert_array_equal(files.read("model.layers.1.mlp.experts.gate_up_proj"), state["model.layers.1.mlp.experts.gate_up_proj"])
    finally:
        files.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["activations", "learned"])
def test_a_dense_afmoe_is_aligned_from_data(method, tmp_path):
    """Without experts (which the data methods refuse) the gated attention aligns from data too: a
    planted element of every group (V/O's sign flips among them) undone, and what learned alignment
    returns a group element (the check when B is moved again refuses a V/O rotation)."""
    save_reference(tf.AfmoeForCausalLM, tf.AfmoeConfig(**{**AFMOE, "num_dense_layers": AFMOE["num_hidden_layers"]}), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    b = rj.apply_transform(spec, ck.params, rj.random_transform(spec, ck.params, jax.random.key(1)))
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(3, 60, size=(6, 10)), "attention_mask": np.ones((6, 10), int), "labels": rng.integers(3, 60, size=(6, 10))}
            for _ in range(2)]
    result = rj.align(ck.params, b, spec, method=method, data=data, checkpoint=ck, heads="permute", **({"steps": 5} if method == "learned" else {}))
    assert result.report["after"]["total"] <= 1e-6 * result.report["before"]["total"], result.report
    rj.apply_transform(spec, b, result.transforms)  # every element checked
