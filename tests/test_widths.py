"""Models of different FFN widths (the injective semi-permutations of Theus et al.): the narrower one
embedded in the wider with zero units computes its own function in transformers, aligning puts its
units onto the wider model's (a model cut from another is found in it), and a merge is a checkpoint
of the wider architecture that transformers loads."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import BY_ID, GLM4_MOE_LITE, GPT2, TEXT, model_inputs, reference
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.io.widths import Widths, ffn_width, widen, widen_together, widths_of
from rotsym_jax.pytree import flatten

pytestmark = pytest.mark.usefixtures("float32_models")

LLAMA = dict(TEXT, num_key_value_heads=2)
CASES = {  # (class, config of width 32, the width key)
    "llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**{**LLAMA, "intermediate_size": 32}), "intermediate_size"),
    "gpt2": (tf.GPT2LMHeadModel, lambda: tf.GPT2Config(**GPT2, n_inner=32), "n_inner"),
    "bert": (tf.BertForSequenceClassification, lambda: tf.BertConfig(**{**TEXT, "intermediate_size": 32}, num_labels=3), "intermediate_size"),
}


@pytest.mark.parametrize("name", ["llama", "gpt2", pytest.param("bert", marks=pytest.mark.slow)])
def test_a_widened_model_computes_its_own_function(name, tmp_path):
    cls, config, key = CASES[name]
    model = save_reference(cls, config(), tmp_path / "narrow")
    case = next(c for c in BY_ID.values() if c.cls == cls.__name__)
    inputs = model_inputs(case, model.config)
    want = reference(model, inputs)["logits"]
    ck = rj.load_hf(tmp_path / "narrow")
    assert ffn_width(ck) == 32 and widen(ck, 32) is ck
    wide = widen(ck, 56)
    assert ffn_width(wide) == 56
    out = rj.save_hf(wide, wide.params, tmp_path / "wide")
    assert json.loads((out / "config.json").read_text())[key] == 56
    loaded, info = cls.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    np.testing.assert_allclose(reference(loaded.eval(), inputs)["logits"], want, rtol=0, atol=1e-5 * np.abs(want).max())
    with pytest.raises(rj.InputError, match="narrower than the model's 56"):
        widen(wide, 32)


def _saved_cut(folder, config_changes: dict, cut_layer, out):
    """The Llama at `folder` with `config_changes` and each layer's leaves cut by `cut_layer(layer)` (in place), saved at `out`."""
    ck = rj.load_hf(folder)
    params = jax.tree.map(lambda x: x, ck.params)
    for layer in params["layers"].values():
        cut_layer(layer)
    config = hf.read_config({**ck.model_config.raw, **config_changes})
    return rj.save_hf(rj.Checkpoint(ck.family, config, params, ck.layout, ck.dtype, ck.source, ck.stored_dtypes), params, out)


def _cut(folder, units, out):
    """A Llama of `units` = the hidden units of the one at `folder` picked by `units`, in that order."""
    def cut(layer):
        mlp = layer["mlp"]
        for name in ("gate", "up"):
            mlp[name]["kernel"] = mlp[name]["kernel"][:, units]
        mlp["down"]["kernel"] = mlp["down"]["kernel"][units, :]
    return _saved_cut(folder, {"intermediate_size": len(units)}, cut, out)


def test_a_model_cut_from_a_wider_one_is_found_in_it(tmp_path):
    """B: 32 of A's 48 units in a random order. Merged with A (aligned), its units land on A's:
    those 32 of the average are A's own, the 16 B lacks are A's halved; B aligned into A's width
    computes B's logits in transformers."""
    a_model = save_reference(tf.LlamaForCausalLM, tf.LlamaConfig(**LLAMA), tmp_path / "a")
    units = np.random.default_rng(0).permutation(48)[:32]
    b = _cut(tmp_path / "a", units, tmp_path / "b")
    assert cli.main(["merge", "--method", "average", str(tmp_path / "a"), str(b), str(tmp_path / "merged"), "--quiet"]) == 0
    a, merged = rj.load_hf(tmp_path / "a"), rj.load_hf(tmp_path / "merged")
    assert merged.model_config.intermediate_size == 48
    missing = np.setdiff1d(np.arange(48), units)
    for i, layer in a.params["layers"].items():
        for name, axis in (("gate", 1), ("up", 1), ("down", 0)):
            want, got = np.asarray(layer["mlp"][name]["kernel"]), np.asarray(merged.params["layers"][i]["mlp"][name]["kernel"])
            np.testing.assert_allclose(np.take(got, units, axis), np.take(want, units, axis), rtol=0, atol=1e-6)
            np.testing.assert_allclose(np.take(got, missing, axis), np.take(want, missing, axis) / 2, rtol=0, atol=1e-6)
    report = json.loads((tmp_path / "merged" / "rotsym_report.json").read_text())["result"]
    assert report["widened"]["width"] == 48 and report["widened"]["widened"] == {"1": {"ffn": 32, "kv_heads": 2}}
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "## Widths" in card and "get zero units up to 48 (zero units compute nothing" in card
    loaded, info = tf.LlamaForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info.values()), info

    case = BY_ID["LlamaForCausalLM"]
    inputs = model_inputs(case, a_model.config)
    want = reference(tf.LlamaForCausalLM.from_pretrained(b, attn_implementation="eager").eval(), inputs)["logits"]
    assert cli.main(["align", str(tmp_path / "a"), str(b), str(tmp_path / "aligned"), "--quiet"]) == 0
    aligned = tf.LlamaForCausalLM.from_pretrained(tmp_path / "aligned", attn_implementation="eager").eval()
    assert aligned.config.intermediate_size == 48
    np.testing.assert_allclose(reference(aligned, inputs)["logits"], want, rtol=0, atol=1e-5 * np.abs(want).max())
    moved = rj.load_hf(tmp_path / "aligned").params["layers"][0]["mlp"]["up"]["kernel"]
    np.testing.assert_allclose(np.asarray(moved)[:, units], np.asarray(a.params["layers"][0]["mlp"]["up"]["kernel"])[:, units], atol=1e-6)


STREAMED = {  # (class, A's config, B's: narrower FFN and, for the Llama, fewer kv groups; the align options streamed)
    "llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**{**LLAMA, "head_dim": 8, "num_key_value_heads": 2}),
              lambda: tf.LlamaConfig(**{**LLAMA, "head_dim": 8, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}),
              ["--heads", "permute", "--residual", "rotation"]),
    # Phi-3 stores gate and up in one tensor: the zero units go after each half, not after both
    "phi3": (tf.Phi3ForCausalLM, lambda: tf.Phi3Config(**LLAMA, pad_token_id=0), lambda: tf.Phi3Config(**{**LLAMA, "intermediate_size": 32}, pad_token_id=0),
             []),
}


@pytest.mark.parametrize("name", list(STREAMED))
def test_different_widths_stream_as_they_run_in_memory(name, tmp_path, capsys):
    """The narrower model's tensors are padded as they are read (`stored_config`): a streamed
    merge and a streamed alignment write what the in-memory ones write, and transformers loads them."""
    cls, config_a, config_b, options = STREAMED[name]
    save_reference(cls, config_a(), tmp_path / "a")
    save_reference(cls, config_b(), tmp_path / "b", seed=1)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for command in (["merge", "--method", "average", a, b], ["align", a, b]):
        outs = {}
        for how, extra in (("memory", ["--quiet"]), ("streamed", ["--max-memory", "4G"])):
            out = tmp_path / f"{command[0]}-{how}"
            assert cli.main([*command, str(out), *options, *extra]) == 0
            outs[how] = rj.load_hf(out)
        assert "note: FFN widths differ" in capsys.readouterr().err  # said streamed as in memory
        assert "streaming" in json.loads((tmp_path / f"{command[0]}-streamed" / "rotsym_report.json").read_text())["result"]
        streamed = flatten(outs["streamed"].params)
        for path, want in flatten(outs["memory"].params).items():
            np.testing.assert_allclose(streamed[path], want, rtol=0, atol=1e-5, err_msg=path)
        _, info = cls.from_pretrained(tmp_path / f"{command[0]}-streamed", output_loading_info=True)
        assert not any(info.values()), info
    assert cli.main(["merge", "--method", "average", a, b, str(tmp_path / "dry"), "--max-memory", "4G", "--dry-run"]) == 0
    assert "get zero units up to 48" in capsys.readouterr().out  # a dry run says so


def test_a_mixture_of_experts_is_not_widened(tmp_path):
    mixtral = tf.MixtralConfig(**LLAMA, num_local_experts=4, num_experts_per_tok=2)
    save_reference(tf.MixtralForCausalLM, mixtral, tmp_path / "moe", perturb=False)
    with pytest.raises(rj.InputError, match="cannot be widened"):
        widen(rj.load_hf(tmp_path / "moe", weights=False), 64)


HEADS = {k: v for k, v in TEXT.items() if k != "num_attention_heads"} | {"head_dim": 8, "hidden_size": 48}  # heads of 8: 4 or 6 at width 48


def _drop_group(folder, keep, out):
    """A Llama with the kv groups `keep` (in that order) of the one at `folder`, and their query heads."""
    r, dh = 2, 8  # query heads per kv group, head size
    q_cols = np.concatenate([np.arange(k * r * dh, (k + 1) * r * dh) for k in keep])
    kv_cols = np.concatenate([np.arange(k * dh, (k + 1) * dh) for k in keep])

    def cut(layer):
        attention = layer["attention"]
        attention["query"]["kernel"] = attention["query"]["kernel"][:, q_cols]
        for name in ("key", "value"):
            attention[name]["kernel"] = attention[name]["kernel"][:, kv_cols]
        attention["out"]["kernel"] = attention["out"]["kernel"][q_cols, :]
    return _saved_cut(folder, {"num_attention_heads": len(keep) * r, "num_key_value_heads": len(keep)}, cut, out)


def test_a_model_with_fewer_heads_gets_zero_heads_and_is_found_in_the_wider(tmp_path):
    """B: kv groups 2 and 0 of A's 3 (with their query heads), 4 heads against 6. Widened, B
    computes its logits in transformers; merged with A (heads matched), its heads land on A's."""
    a_model = save_reference(tf.LlamaForCausalLM, tf.LlamaConfig(**HEADS, num_attention_heads=6, num_key_value_heads=3), tmp_path / "a")
    b = _drop_group(tmp_path / "a", [2, 0], tmp_path / "b")
    case = BY_ID["LlamaForCausalLM"]
    inputs = model_inputs(case, a_model.config)
    b_model = tf.LlamaForCausalLM.from_pretrained(b, attn_implementation="eager").eval()
    want = reference(b_model, inputs)["logits"]
    wide = widen(rj.load_hf(b), kv_heads=3)
    loaded = tf.LlamaForCausalLM.from_pretrained(rj.save_hf(wide, wide.params, tmp_path / "b-wide"), attn_implementation="eager").eval()
    assert loaded.config.num_attention_heads == 6 and loaded.config.num_key_value_heads == 3
    np.testing.assert_allclose(reference(loaded, inputs)["logits"], want, rtol=0, atol=1e-5 * np.abs(want).max())

    assert cli.main(["merge", "--method", "average", str(tmp_path / "a"), str(b), str(tmp_path / "merged"), "--heads", "permute", "--quiet"]) == 0
    a, merged = rj.load_hf(tmp_path / "a"), rj.load_hf(tmp_path / "merged")
    kept = np.concatenate([np.arange(k * 16, (k + 1) * 16) for k in (0, 2)])  # query columns of groups 0 and 2: B's, matched back
    for i, layer in a.params["layers"].items():
        want_q, got_q = np.asarray(layer["attention"]["query"]["kernel"]), np.asarray(merged.params["layers"][i]["attention"]["query"]["kernel"])
        np.testing.assert_allclose(got_q[:, kept], want_q[:, kept], rtol=0, atol=1e-5)
        np.testing.assert_allclose(got_q[:, 16:32], want_q[:, 16:32] / 2, rtol=0, atol=1e-5)  # group 1: B has none
    _, info = tf.LlamaForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info.values()), info


def test_heads_of_other_sizes_behind_equal_shapes_are_refused(tmp_path, capsys, no_weight_reads):
    """GPT-2's c_attn holds 4 heads of 12 or 6 heads of 8 alike: the leaves agree, the heads do not.
    Refused by name, in memory and streamed, before any weight is read (merging them would read
    one model's heads with the other's split)."""
    for heads, name in ((4, "a"), (6, "b")):
        save_reference(tf.GPT2LMHeadModel, tf.GPT2Config(**{**GPT2, "n_embd": 48, "n_head": heads}), tmp_path / name, perturb=False)
    for extra in ([], ["--max-memory", "4G"]):
        with pytest.raises(SystemExit):
            cli.main(["merge", "--method", "average", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out"), *extra])
        assert "has 6 heads of 8 in 6 kv groups" in capsys.readouterr().err


def test_a_mergekit_config_that_aligns_merges_other_widths_as_a_merge_method_does(tmp_path, capsys):
    """A mergekit config with a rotsym: block that aligns takes models of two FFN widths as `rotsym
    merge --method` does (the narrower widened with zero units, then aligned): the same tensors;
    without alignment, per-tensor merging of other shapes is refused, as mergekit refuses it."""
    cls, narrow, key = CASES["llama"]
    save_reference(cls, narrow(), tmp_path / "a")
    save_reference(cls, tf.LlamaConfig(**LLAMA), tmp_path / "b", seed=1)
    config = {"models": [{"model": str(tmp_path / m), "parameters": {"weight": 0.5}} for m in "ab"], "merge_method": "linear",
              "dtype": "float32", "rotsym": {"align": "anchor"}}
    (tmp_path / "c.yml").write_text(json.dumps(config))
    assert cli.main(["merge", str(tmp_path / "c.yml"), str(tmp_path / "mk"), "--quiet"]) == 0
    assert cli.main(["merge", "--method", "average", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "avg"), "--quiet"]) == 0
    got, want = rj.load_hf(tmp_path / "mk"), rj.load_hf(tmp_path / "avg")
    assert got.model_config.intermediate_size == 48
    for path, x in flatten(want.params).items():
        np.testing.assert_array_equal(np.asarray(flatten(got.params)[path]), np.asarray(x), err_msg=path)
    (tmp_path / "c.yml").write_text(json.dumps({**config, "rotsym": {"align": "none"}}))
    with pytest.raises(SystemExit):
        cli.main(["merge", str(tmp_path / "c.yml"), str(tmp_path / "none")])
    assert "the models' shapes differ" in capsys.readouterr().err


def test_another_model_width_is_refused_naming_the_widths_and_head_counts(tmp_path, capsys):
    """Width 96 with 6 heads against 64 with 4 (heads of 16 in both): zero heads cannot make them
    one architecture (the model width differs too), so the refusal names the shapes and head
    counts, as `rotsym inspect` does, not a head size neither model has."""
    for name, d, heads in (("a", 96, 6), ("b", 64, 4)):
        save_reference(tf.GPT2LMHeadModel, tf.GPT2Config(**{**GPT2, "n_embd": d, "n_head": heads}), tmp_path / name, perturb=False)
    a, b, out = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out")
    for command in (["align", a, b, out], ["align", a, b, out, "--max-memory", "4G"], ["merge", "--method", "average", a, b, out]):
        with pytest.raises(SystemExit):
            cli.main(command)
        err = capsys.readouterr().err
        assert f"B ({b}) does not have the architecture of A ({a})" in err or f"model 1 ({b}) does not have the architecture of the anchor" in err, err
        assert "final_norm/bias (64,) vs (96,)" in err and "has 4 heads of 16 in 4 kv groups" in err and "6 heads of 16 in 6 kv groups" in err, err
        assert "head_dim" not in err, err


def _glm4_moe_lite(folder, heads, value_dim, seed=0):
    """A GLM-4.7-Flash (MLA) of `heads` heads whose values are `value_dim` wide (the keys' no-RoPE part 8, RoPE 4)."""
    config = tf.Glm4MoeLiteConfig(**{**GLM4_MOE_LITE, "num_attention_heads": heads, "num_key_value_heads": heads, "v_head_dim": value_dim})
    return save_reference(tf.Glm4MoeLiteForCausalLM, config, folder, seed=seed)


def test_heads_whose_values_are_wider_than_their_keys_widen_keeping_the_function(tmp_path):
    """GLM-4.7-Flash's heads: keys 8 wide (plus a RoPE part of 4), values 12; its config maps head_dim onto
    qk_rope_head_dim, so the head width may not be written as head_dim. Widened from 4 heads to 6, the model
    computes its own logits in transformers, every head width as it was."""
    model = _glm4_moe_lite(tmp_path / "narrow", 4, 12)
    case = BY_ID["Glm4MoeLiteForCausalLM"]
    inputs = model_inputs(case, model.config)
    want = reference(model, inputs)["logits"]
    ck = rj.load_hf(tmp_path / "narrow")
    assert widths_of(ck) == Widths(None, 4, 1, 8, 12)
    wide = widen(ck, kv_heads=6)
    assert widths_of(wide) == Widths(None, 6, 1, 8, 12)
    out = rj.save_hf(wide, wide.params, tmp_path / "wide")
    loaded, info = tf.Glm4MoeLiteForCausalLM.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    c = loaded.config
    assert (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (6, 8, 4, 12)
    np.testing.assert_allclose(reference(loaded.eval(), inputs)["logits"], want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_heads_are_widened_together_only_where_their_values_are_as_wide(tmp_path, capsys):
    """6 heads against 4, their keys alike: values as wide (12) give the narrower zero heads; values of
    another width (8) leave both as they are (zero heads cannot make one architecture of them), and the
    merge's refusal names the value widths as the configs give them."""
    for name, heads, value_dim in (("a", 6, 12), ("b", 4, 12), ("c", 4, 8)):
        _glm4_moe_lite(tmp_path / name, heads, value_dim, seed=len(name) + heads)
    a, b, c = (rj.load_hf(tmp_path / name, weights=False) for name in "abc")
    widened, done = widen_together([a, b])
    assert done == {"width": None, "kv_heads": 6, "widened": {1: {"ffn": None, "kv_heads": 4}}}
    assert widths_of(widened[1]) == widths_of(a)
    assert widen_together([a, c]) == ([a, c], None)
    # merged with A, B gets zero heads in memory and streamed alike, and transformers loads the merge
    merged = {}
    for how, extra in (("memory", ["--quiet"]), ("streamed", ["--quiet", "--max-memory", "1G"])):
        out = tmp_path / f"merged-{how}"
        assert cli.main(["merge", "--method", "average", str(tmp_path / "a"), str(tmp_path / "b"), str(out), "--heads", "permute", *extra]) == 0
        merged[how] = flatten(rj.load_hf(out).params)
    for path, want in merged["memory"].items():
        np.testing.assert_allclose(merged["streamed"][path], want, rtol=0, atol=1e-5, err_msg=path)
    _, info = tf.Glm4MoeLiteForCausalLM.from_pretrained(tmp_path / "merged-streamed", output_loading_info=True)
    assert not any(info.values()), info
    with pytest.raises(SystemExit):
        cli.main(["merge", "--method", "average", str(tmp_path / "a"), str(tmp_path / "c"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "4 heads of 8 in 4 kv groups, values as wide as the keys" in err and "v_head_dim: the anchor 12, model 1 8" in err, err


def test_a_null_head_dim_is_kept_as_the_width_over_the_heads_when_heads_are_added(tmp_path):
    """config.json's head_dim: null means hidden_size / heads (8 here): with twice the heads it would be 4, so the
    widened config writes head_dim 8, and the model computes its own logits in transformers."""
    model = save_reference(tf.LlamaForCausalLM, tf.LlamaConfig(**LLAMA), tmp_path / "narrow")
    config = json.loads((tmp_path / "narrow" / "config.json").read_text())
    (tmp_path / "narrow" / "config.json").write_text(json.dumps({**config, "head_dim": None}))
    inputs = model_inputs(BY_ID["LlamaForCausalLM"], model.config)
    want = reference(model, inputs)["logits"]
    wide = widen(rj.load_hf(tmp_path / "narrow"), kv_heads=4)
    out = rj.save_hf(wide, wide.params, tmp_path / "wide")
    loaded = tf.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert (loaded.config.num_attention_heads, loaded.config.num_key_value_heads, loaded.config.head_dim) == (8, 4, 8)
    np.testing.assert_allclose(reference(loaded, inputs)["logits"], want, rtol=0, atol=1e-5 * np.abs(want).max())
