"""Granite-4's hybrid (model type granitemoehybrid) and Mamba-2 (mamba2). The generic contracts run on
their rows of family_cases.py, and tests/test_mamba2_symmetries.py shows in transformers which maps
of a mixer keep the function; here, what is particular: the groups each config gets (the state's
only with one group of B/C, the heads kept in their group), every element kind proven in
transformers, and IBM's own names for the mixture's tensors."""

import json
import shutil

import jax
import numpy as np
import pytest
import transformers as tf
from checkpoint_utils import assert_renamed_reads_alike
from family_cases import GRANITE_HYBRID, MAMBA2
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax import verify as verify_module
from rotsym_jax.errors import InputError
from rotsym_jax.transforms import KINDS, RESIDUAL
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")
torch = pytest.importorskip("torch")


def _bound(folder):
    ck = rj.load_hf(folder)
    return ck, rj.bind(rj.spec_for(ck), ck.params)


@pytest.mark.parametrize("groups", [1, 2])
def test_the_heads_stay_in_their_group_and_the_state_permutes_with_one_group(tmp_path, groups):
    config = tf.GraniteMoeHybridConfig(**{**GRANITE_HYBRID, "mamba_n_groups": groups, "num_local_experts": 0})
    save_reference(tf.GraniteMoeHybridForCausalLM, config, tmp_path / "g")
    ck, bound = _bound(tmp_path / "g")
    (ssm,) = [g for g in bound.experts if g.name == "ssm"]
    assert (ssm.num_experts, ssm.units, ssm.routing_groups, ssm.layers) == (8, 8, groups, (0,))
    assert {m.paths[0] for m in ssm.members} >= {"layers/0/mamba/in_z/kernel", "layers/0/mamba/A_log", "layers/0/mamba/out/kernel"}
    perms = {g.name: g.size for g in bound.perms}
    left_out = hf.family_of(ck.model_config).left_out(ck.model_config)
    if groups == 1:
        assert perms == {"shared_ffn": 24, "state": 4} and not left_out
    else:  # each group's state would need its own permutation: B and C stay, and inspect says why
        assert perms == {"shared_ffn": 24} and "no state group" in left_out[0]


@pytest.mark.slow
def test_the_heads_are_drawn_within_their_group(tmp_path):
    config = tf.GraniteMoeHybridConfig(**{**GRANITE_HYBRID, "mamba_n_groups": 2, "num_local_experts": 0})
    save_reference(tf.GraniteMoeHybridForCausalLM, config, tmp_path / "g")
    ck = rj.load_hf(tmp_path / "g")
    for seed in range(4):
        perm = np.asarray(rj.random_transform(rj.spec_for(ck), ck.params, jax.random.key(seed))["ssm"].perm)[0]
        assert set(perm[:4]) == {0, 1, 2, 3} and set(perm[4:]) == {4, 5, 6, 7}, perm


def test_mamba2_has_no_attention_and_its_groups(tmp_path):
    save_reference(tf.Mamba2ForCausalLM, tf.Mamba2Config(**MAMBA2), tmp_path / "m")
    ck, bound = _bound(tmp_path / "m")
    assert not bound.attention and {g.name: g.size for g in bound.perms} == {}  # two groups of B/C: no state group
    assert [(g.name, g.num_experts, g.units, g.routing_groups) for g in bound.experts] == [("ssm", 4, 16, 2)]


def test_heads_must_fill_whole_groups():
    raw = {"model_type": "granitemoehybrid", "hidden_size": 32, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 3}
    with pytest.raises(InputError, match="mamba_n_heads=4 heads in mamba_n_groups=3 groups"):
        hf.read_config(raw)
    with pytest.raises(InputError, match="mamba_n_heads=4 x mamba_d_head=8 differs"):
        hf.read_config({**raw, "mamba_n_groups": 1, "mamba_d_head": 8})


# save_pretrained writes the mixture's tensors under IBM's names (as its checkpoints hold them), which
# transformers 5 renames on load; its state dict in memory, which other tools save, holds the new ones
_NEWER = {"block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight",
          "block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
          "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj"}


def test_both_names_of_the_mixture_read_alike_and_are_written_back_as_read(tmp_path):
    model = save_reference(tf.GraniteMoeHybridForCausalLM, tf.GraniteMoeHybridConfig(**GRANITE_HYBRID), tmp_path / "ibm")
    assert_renamed_reads_alike(model, tmp_path / "ibm", _NEWER, tmp_path, renamed=6)  # three tensors in each of the two layers


@pytest.mark.slow
@pytest.mark.parametrize("cls", ["GraniteMoeHybridForCausalLM", "Mamba2ForCausalLM"])
def test_every_group_holds_in_transformers(tmp_path, cls):
    """`rotsym inspect --verify`'s check: each element kind drawn at random (the mixers' heads and
    channels, and the state, under one row named for them, which draws every permutation group
    and experts block) and run in transformers."""
    config = tf.GraniteMoeHybridConfig(**GRANITE_HYBRID) if cls.startswith("Granite") else tf.Mamba2Config(**{**MAMBA2, "n_groups": 1})
    save_reference(getattr(tf, cls), config, tmp_path / "lm")
    checks = {c.element: c for c in verify_groups(tmp_path / "lm")}
    assert all(c.ok for c in checks.values()), checks
    proven = {e for e, c in checks.items() if c.difference is not None}
    perms = ("FFN unit, SSM head, channel and state entry permutations" if cls.startswith("Granite")
             else "SSM head, channel and state entry permutations")  # what the model's groups are
    want = {perms, "residual permutation", "residual rotation"}
    assert want | ({"head permutations", "QK rotations", "VO rotations"} if cls.startswith("Granite") else set()) <= proven, checks


def test_verify_names_the_mixers_groups_not_ffn_units(tmp_path):
    """`inspect --verify`'s permutation row on Mamba-2 (new-user trial: "FFN unit permutations" on a
    model without an FFN, its state entries called units) is titled and described as the mixers'
    SSM heads, channels and state entries; Granite-4's FFN units beside them keep their name."""
    save_reference(tf.Mamba2ForCausalLM, tf.Mamba2Config(**{**MAMBA2, "n_groups": 1}), tmp_path / "m")
    ck, bound = _bound(tmp_path / "m")
    assert [g.name for g in bound.perms] == ["state"] and [g.name for g in bound.experts] == ["ssm"]
    assert bound.perms[0].describe().startswith("permutation 'state': 2 layers, 4 state entries ("), bound.perms[0].describe()  # as inspect says it
    title = verify_module._title("FFN unit permutations", bound)
    assert title == "SSM head, channel and state entry permutations", title
    group, note = verify_module._group("FFN unit permutations", None, bound, ck)
    assert group == ("state entry permutations (4 per layer), 4 SSM heads (their dt rows, A_log, dt_bias and D with them) x their "
                     "channels") and not note, group
    assert verify_module._title("QK rotations", bound) == "QK rotations"  # the other rows as they were
    save_reference(tf.GraniteMoeHybridForCausalLM, tf.GraniteMoeHybridConfig(**GRANITE_HYBRID), tmp_path / "g")
    ck, bound = _bound(tmp_path / "g")
    assert verify_module._title("FFN unit permutations", bound) == \
        "FFN unit, SSM head, channel and state entry permutations"


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 2])
def test_activation_matching_undoes_a_plant_in_transformers(tmp_path, groups):
    """The mixers' sites (each head's channels before the convolution and as out_proj reads them,
    each state entry before the convolution) recover a planted element of every group, as do the
    attention's, the shared MLP's and the experts'; transformers runs the result as A."""
    config = tf.GraniteMoeHybridConfig(**{**GRANITE_HYBRID, "mamba_n_groups": groups})
    a_model = save_reference(tf.GraniteMoeHybridForCausalLM, config, tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS)
    t[RESIDUAL] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "b")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 60, size=(16, 12))
    mask = np.ones_like(ids)
    mask[::3, 9:] = 0
    np.savez(tmp_path / "data.npz", input_ids=ids, attention_mask=mask)
    out = tmp_path / "out"
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(out), "--quiet", "--method", "activations", "--data",
                     str(tmp_path / "data.npz"), "--heads", "permute", "--residual", "permutation", "--no-fallback"]) == 0
    report = json.loads((out / "rotsym_report.json").read_text())["result"]
    planted = {"ssm", "moe", "shared_ffn", "qk", "vo"} | ({"state"} if groups == 1 else set())
    assert all(report["before"][k] > 0.1 for k in planted), report["before"]
    assert report["after"]["total"] <= 1e-5 * report["before"]["total"], report["after"]
    moved = tf.GraniteMoeHybridForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        inputs = dict(input_ids=torch.as_tensor(ids[:4]), attention_mask=torch.as_tensor(mask[:4]))
        np.testing.assert_allclose(moved(**inputs).logits.numpy(), a_model(**inputs).logits.numpy(), atol=1e-4)


def test_the_mixers_heads_are_named_as_what_they_are_not_as_experts(tmp_path, capsys):
    """The mixers' heads are solved as an experts block, but inspect, verify and --ffn scaled's note
    say SSM heads, channels and B/C groups (new-user trial: "experts", "router"); Granite's own
    mixture beside them stays experts."""
    save_reference(tf.Mamba2ForCausalLM, tf.Mamba2Config(**MAMBA2), tmp_path / "m")
    save_reference(tf.GraniteMoeHybridForCausalLM, tf.GraniteMoeHybridConfig(**GRANITE_HYBRID), tmp_path / "g")
    assert cli.main(["inspect", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert ("  SSM heads 'ssm' (solved as an experts block): 2 layers, 4 SSM heads of 16 channels: SSM head permutations within each of "
            "2 B/C groups (their dt rows, A_log, dt_bias and D with them), nested with each SSM head's channel permutation\n") in out, out
    assert "router" not in out and "; SSM heads and their channels permuted (--ffn);" in out, out
    assert cli.main(["inspect", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "  experts 'moe': 2 layers, 4 experts of 16 units: expert permutations (the router's outputs with them), nested" in out, out
    assert "  SSM heads 'ssm' (solved as an experts block): 1 layer, 8 SSM heads of 8 channels: SSM head permutations (their" in out, out
    assert "; FFN units, SSM heads and their channels permuted, each gated unit's scale left (--ffn);" in out, out
    assert cli.main(["align", str(tmp_path / "m"), str(tmp_path / "m"), str(tmp_path / "out"), "--ffn", "scaled", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert ("note: --ffn scaled: this mamba2 model has no gated FFN group (the Mamba-2 mixers' SSM heads: their channels are never "
            "scaled), so its SSM heads' channels are permuted only") in err and "expert" not in err, err
    # a mergekit config aligned with --ffn scaled says it as align does (it ran silently)
    shutil.copytree(tmp_path / "m", tmp_path / "m2")
    config = tmp_path / "linear.yml"
    config.write_text("".join(f"  - model: {tmp_path / m}\n    parameters: {{weight: 1}}\n" for m in ("m", "m2")).join(
        ["models:\n", "merge_method: linear\ndtype: float32\n"]))
    assert cli.main(["merge", str(config), str(tmp_path / "mk"), "--align", "anchor", "--ffn", "scaled", "--dry-run"]) == 0
    assert ("note: --ffn scaled: this mamba2 model has no gated FFN group (the Mamba-2 mixers' SSM heads: their channels are never "
            "scaled), so its SSM heads' channels are permuted only") in capsys.readouterr().err
    ck, bound = _bound(tmp_path / "m")
    assert verify_module._group("FFN unit permutations", None, bound, ck) == ("4 SSM heads (their dt rows, A_log, dt_bias and D with them) "
                                                                              "x their channels", "")
    with pytest.raises(InputError, match="experts block 'ssm': SSM heads are matched on the host .* for the Mamba-2 mixers' SSM heads"):
        jax.jit(lambda a, b: rj.align(a, b, bound).params)(ck.params, ck.params)
