"""Llama and its kin (Mistral, Qwen2/3, Phi-3, Gemma): what is particular to them (tied heads in the file, windows, positions,
RoPE types, bfloat16, fused projections, Gemma's gains). Parity and the round trip of every case: test_conformance.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from checkpoint_utils import plus_noise
from family_cases import BY_ID
from parity_utils import assert_outputs_match, assert_same_state_dict, reference_outputs, token_batch, torch
from safetensors import safe_open
from safetensors.numpy import save_file

import rotsym_jax as rj
from rotsym_jax.pytree import flatten

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99)


def save_random(cls, config, folder, seed=0, dtype=None):
    """A seeded random transformers model (eager attention) saved with save_pretrained. Norm gains
    and biases are perturbed: transformers initialises them to 1 and 0, which would hide mix-ups."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    return model


def _inputs(config, seed=0):
    ids, mask = token_batch(config.vocab_size, pad_id=0, seed=seed)
    return dict(input_ids=ids, attention_mask=mask)


def _reference(model, **inputs):
    """transformers' outputs; for *ForCausalLM also its base model's last_hidden_state."""
    out = reference_outputs(model, **inputs)
    if "logits" in out:
        out["last_hidden_state"] = reference_outputs(model.model, **inputs)["last_hidden_state"]
    return out


def _keys(ref):
    return [k for k in ("last_hidden_state", "logits") if k in ref]


def _max_diff(a, b, valid):
    return float(np.max(np.abs(np.asarray(a, np.float32)[valid] - np.asarray(b, np.float32)[valid])))


def test_layout_leaves_and_tied_head(tmp_path):
    config = tf.LlamaConfig(**SMALL, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    save_random(tf.LlamaForCausalLM, config, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "numpy") as f:
        assert "lm_head.weight" not in set(f.keys())  # transformers drops the tied copy
    ck = rj.load_hf(tmp_path)
    assert (ck.layout.prefix, ck.layout.head) == ("model.", "lm")
    layer = ck.params["layers"][0]
    assert layer["attention"]["query"]["kernel"].shape == (32, 4 * 16)
    assert layer["attention"]["key"]["kernel"].shape == (32, 2 * 16)
    assert layer["attention"]["value"]["kernel"].shape == (32, 2 * 16)
    assert layer["attention"]["out"]["kernel"].shape == (4 * 16, 32)
    assert set(layer["mlp"]) == {"gate", "up", "down"}
    assert set(layer["attention_norm"]) == {"scale"} and "final_norm" in ck.params
    assert "lm_head" not in ck.params
    rj.save_hf(ck, ck.params, tmp_path / "saved")
    with safe_open(tmp_path / "saved" / "model.safetensors", "numpy") as f:
        assert "lm_head.weight" not in set(f.keys())


def test_tied_lm_head_in_file_is_read_as_transformers_reads_it(tmp_path):
    """A tied checkpoint that still stores lm_head.weight: equal to the embedding, it is the
    embedding; of other values, the untied model's head (transformers keeps it apart and computes
    with it; tests/test_untie.py runs it)."""
    config = tf.LlamaConfig(**SMALL, tie_word_embeddings=True)
    save_random(tf.LlamaForCausalLM, config, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    embedding = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embedding}, tmp_path / "model.safetensors")
    assert rj.load_hf(tmp_path).model_config.tie_word_embeddings
    save_file({**tensors, "lm_head.weight": embedding + 1}, tmp_path / "model.safetensors")
    with pytest.warns(UserWarning, match="read apart"):
        ck = rj.load_hf(tmp_path)
    assert not ck.model_config.tie_word_embeddings
    np.testing.assert_array_equal(np.asarray(ck.params["lm_head"]["kernel"]).T, embedding + 1)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2-window"])
def test_sliding_window_matters(model_type, tmp_path):
    """The window is shorter than the batch's sequences: without it the outputs would differ."""
    case = BY_ID["MistralForCausalLM[window]" if model_type == "mistral" else "Qwen2ForCausalLM[window]"]
    cls, make_config = case.model_class, case.config
    ref_model = save_random(cls, make_config(), tmp_path)
    ck = rj.load_hf(tmp_path)
    inputs = _inputs(ck.config)
    valid = inputs["attention_mask"].astype(bool)
    ours = ck.apply(ck.params, **inputs)["logits"]

    unwindowed = make_config()
    if model_type == "mistral":
        unwindowed.sliding_window = None
    else:
        unwindowed.layer_types = ["full_attention"] * unwindowed.num_hidden_layers
    unwindowed._attn_implementation = "eager"
    full = cls(unwindowed).eval()
    full.load_state_dict(ref_model.state_dict())
    assert _max_diff(ours, reference_outputs(full, **inputs)["logits"], valid) > 1e-3
    assert _max_diff(ours, reference_outputs(ref_model, **inputs)["logits"], valid) <= 1e-4


def test_position_ids(tmp_path):
    case = BY_ID["LlamaForCausalLM[llama3-rope]"]
    cls, make_config = case.model_class, case.config
    ref_model = save_random(cls, make_config(), tmp_path)
    ck = rj.load_hf(tmp_path)
    inputs = _inputs(ck.config)
    inputs["position_ids"] = np.broadcast_to(np.arange(5, 5 + 9), (3, 9)).astype(np.int64)
    valid = inputs["attention_mask"].astype(bool)
    assert_outputs_match(ck.apply(ck.params, **inputs), reference_outputs(ref_model, **inputs), ["logits"], valid=valid)


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4, long_factor=[2.0] * 4, original_max_position_embeddings=64),
    ],
)
def test_unsupported_rope_type_is_read_and_aligned_but_not_run(rope, tmp_path):
    """The RoPE frequencies do not change the symmetry (a rotation per rotary pair): such a
    checkpoint is read, aligned and saved; only running it is refused, naming the rope type."""
    save_random(tf.LlamaForCausalLM, tf.LlamaConfig(**SMALL, rope_parameters=rope), tmp_path / "ref")
    ck = rj.load_hf(tmp_path / "ref")
    rj.save_hf(ck, rj.align(ck.params, ck.params, rj.spec_for(ck)).params, tmp_path / "saved")
    with pytest.raises(rj.CheckpointError, match=rope["rope_type"]):
        ck.apply(ck.params, input_ids=np.array([[1, 2]]))


def test_partial_rotary_factor_is_refused_on_load(tmp_path):
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    save_random(tf.LlamaForCausalLM, tf.LlamaConfig(**SMALL, rope_parameters=rope), tmp_path)
    with pytest.raises(rj.CheckpointError, match="partial_rotary_factor=0.5"):
        rj.load_hf(tmp_path)


def test_partial_rotary_factor_raises():
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    config = tf.LlamaConfig(**SMALL, rope_parameters=rope)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rj.init_checkpoint(config, jax.random.key(0), head="lm")


def test_bfloat16_checkpoint(tmp_path):
    config = tf.LlamaConfig(**SMALL, num_key_value_heads=2)
    ref_model = save_random(tf.LlamaForCausalLM, config, tmp_path / "ref", dtype=torch.bfloat16)
    ck = rj.load_hf(tmp_path / "ref")
    assert ck.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.bfloat16 for leaf in flatten(ck.params).values())

    rj.save_hf(ck, ck.params, tmp_path / "saved")
    with safe_open(tmp_path / "saved" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    reloaded = tf.LlamaForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)
    assert_same_state_dict(reloaded, ref_model)

    # Float32 compute on the bf16 weights, against transformers doing the same.
    ck32 = rj.load_hf(tmp_path / "ref", dtype=jnp.float32)
    inputs = _inputs(ck32.config)
    valid = inputs["attention_mask"].astype(bool)
    ref32 = _reference(ref_model.float(), **inputs)
    assert_outputs_match(ck32.apply(ck32.params, **inputs), ref32, ["last_hidden_state", "logits"], valid=valid)
    # bf16 compute stays close to it (bf16 rounding only).
    ours16 = ck.apply(ck.params, **inputs)
    assert _max_diff(ours16["logits"], ref32["logits"], valid) < 0.05


@pytest.mark.parametrize("head", [None, "lm"])
def test_init_checkpoint_loads_in_transformers(head, tmp_path):
    """A freshly initialised model saves as the right *Model / *ForCausalLM class."""
    config = tf.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=3)
    ck = rj.init_checkpoint(config, jax.random.key(0), head=head)
    assert ck.layout.prefix == ("model." if head else "")
    rj.save_hf(ck, ck.params, tmp_path / "saved")
    cls = tf.MistralForCausalLM if head else tf.MistralModel
    model, info = cls.from_pretrained(tmp_path / "saved", output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    inputs = _inputs(config)
    ref = _reference(model.eval(), **inputs)
    assert_outputs_match(ck.apply(ck.params, **inputs), ref, _keys(ref), valid=inputs["attention_mask"].astype(bool))


def test_phi3_fused_projections_split_into_the_shared_leaves(tmp_path):
    """qkv_proj rows are [Q; K; V] (4 query heads, 2 kv heads of 8), gate_up_proj rows [gate; up]:
    each becomes the leaf every other family has, and saving fuses them back byte for byte."""
    case = BY_ID["Phi3ForCausalLM[partial-window]"]
    cls, make_config = case.model_class, case.config
    model = save_random(cls, make_config(), tmp_path / "ref")
    ck = rj.load_hf(tmp_path / "ref")
    layer, attention = ck.params["layers"][0], model.model.layers[0]
    qkv = attention.self_attn.qkv_proj.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(layer["attention"]["key"]["kernel"]), qkv[32:48].T)
    gate_up = attention.mlp.gate_up_proj.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(layer["mlp"]["up"]["kernel"]), gate_up[48:].T)
    assert rj.bind(rj.spec_for(ck), ck.params).attention[0].geometry.rotary_dim == 4


def test_gemma_gains_fold_as_one_plus_w_and_the_stream_rotates():
    """Gemma stores each RMSNorm gain as w (the norm multiplies by 1 + w): folding moves 1 + w into
    the readers and leaves w = 0, the function unchanged; a rotated stream and every group are then
    recovered. With the tied LM head (Gemma's default) the final norm stays and a rotation is refused."""
    from test_invariance import model_inputs, outputs, planted_pair, random_model

    ck, params = random_model("gemma-untied")
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, params)
    flat = flatten(folded)
    assert all(np.all(np.asarray(flat[p]) == 0) for p in flat if p.endswith("norm/scale"))
    inputs = model_inputs(ck)
    want = outputs(ck, params, inputs)["logits"]
    np.testing.assert_allclose(outputs(ck, folded, inputs)["logits"], want, rtol=0, atol=1e-5 * np.abs(want).max())
    ck, spec, a, b = planted_pair("gemma-untied", "rotation")
    result = rj.align(a, b, spec, heads="permute", residual="rotation")
    assert result.report["after"]["total"] <= 1e-5 * result.report["before"]["total"]
    want = outputs(ck, b, inputs)["logits"]
    np.testing.assert_allclose(outputs(ck, result.params, inputs)["logits"], want, rtol=0, atol=1e-5 * np.abs(want).max())
    tied = rj.init_checkpoint(tf.GemmaConfig(**SMALL, num_key_value_heads=2, head_dim=16), jax.random.key(0), head="lm")
    gains = jax.tree.map(lambda x: plus_noise(x, jax.random.key(1), 0.1) if x.ndim == 1 else x, tied.params)
    with pytest.raises(ValueError, match="tied LM head cannot be folded"):
        rj.align(gains, gains, rj.spec_for(tied), residual="rotation")
