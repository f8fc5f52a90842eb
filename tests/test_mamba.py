"""Mamba (model type mamba: selective state-space mixers, no attention). The generic contracts run on
its rows of family_cases.py; here, what is particular: every element kind proven in transformers
(the channels' permutation, the stream's, its rotation with the tied head written untied), and the
symmetries of docs/MATH.md §17 on the leaves the channels share (the state's permutation, which
the group "state" moves, and its scales, which no group does; the time step's invertible maps, of
which "time_step" moves the permutations), each proven in transformers in full, and what inspect
says the groups leave out."""

import dataclasses

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import MAMBA
from parity_utils import save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.engine.report import moved_lines
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")
torch = pytest.importorskip("torch")


def test_every_group_holds_in_transformers(tmp_path, capsys):
    save_reference(tf.MambaForCausalLM, tf.MambaConfig(**MAMBA, use_bias=True), tmp_path / "lm")
    checks = {c.element: c for c in verify_groups(tmp_path / "lm")}
    proven = {e for e, c in checks.items() if c.ok and c.difference is not None}
    assert proven == {"channel, state entry and time-step entry permutations", "residual permutation", "residual signed permutation", "residual rotation"}, checks
    assert all(c.note == ("no gated FFN (the scales solved are a gated FFN's units')" if e == "FFN unit scales" else "no attention block")
               for e, c in checks.items() if e not in proven)
    bound = rj.bind(rj.spec_for(rj.load_hf(tmp_path / "lm")), rj.load_hf(tmp_path / "lm").params)
    # the state and the time step on leaves of the channels too (time_step_rank ceil(32 / 16)), each solved after them
    assert [(g.name, g.size, g.after) for g in bound.perms] == [("channels", 64, ()), ("state", 4, ("channels",)),
                                                                ("time_step", 2, ("channels",))] and not bound.attention
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "lm")]) == 0
    said = capsys.readouterr().out  # what the groups leave out, named with its size
    assert "the state's 4 entries are permuted, not scaled" in said and "the time step's 2 entries are permuted, not mapped" in said, said
    # each group's units named as the spec names them (`Spec.unit_names`), a count in its own number
    assert "permutation 'state': 2 layers, 4 state entries (3 leaf kinds), solved after 'channels'" in said, said
    assert "permutation 'channels': 2 layers, 64 channels (" in said and "permutation 'time_step': 2 layers, 2 time-step entries (" in said, said
    one = dataclasses.replace(bound.perms[2], layers=bound.perms[2].layers[:1], size=1)
    assert one.describe().startswith("permutation 'time_step': 1 layer, 1 time-step entry ("), one.describe()


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()


@pytest.mark.parametrize("element", ["state permutation", "state scale", "time-step map"])
def test_the_state_and_time_step_maps_keep_the_function(tmp_path, element):
    """MATH §17: the state's N entries permute (B's and C's rows of x_proj, A_log's columns, alike)
    and scale (B's rows by s, C's by 1/s: both linear in x, the state linear in B), and the time
    step's r entries take any invertible map M (x_proj's dt rows by M, dt_proj's columns by M^-1):
    transformers' logits stay; a permutation of B's rows alone changes them, and so does B's scale alone."""
    model = save_reference(tf.MambaForCausalLM, tf.MambaConfig(**MAMBA), tmp_path / "a")
    ids, mask = token_batch(MAMBA["vocab_size"], pad_id=0)
    want = _logits(model, ids, mask)
    r, n = model.config.time_step_rank, MAMBA["state_size"]
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for layer in model.backbone.layers:
            mixer = layer.mixer
            w = mixer.x_proj.weight  # (r + 2N, f): dt rows, B rows, C rows
            if element == "state permutation":
                p = torch.as_tensor(rng.permutation(n))
                w[r:r + n] = w[r:r + n][p].clone()
                w[r + n:] = w[r + n:][p].clone()
                mixer.A_log.copy_(mixer.A_log[:, p])
            elif element == "state scale":
                scale = torch.as_tensor(rng.uniform(0.3, 3.0, n)[:, None], dtype=torch.float32)
                w[r:r + n] *= scale
                w[r + n:] /= scale
            else:
                m = torch.as_tensor(rng.normal(size=(r, r)) + 2 * np.eye(r), dtype=torch.float32)
                w[:r] = m @ w[:r]
                mixer.dt_proj.weight.copy_(mixer.dt_proj.weight @ torch.linalg.inv(m))
    np.testing.assert_allclose(_logits(model, ids, mask), want, rtol=0, atol=1e-4 * np.abs(want).max())
    if element != "time-step map":  # B's rows alone: the states no longer pair with their readouts (or keep their scale)
        with torch.no_grad():
            w = model.backbone.layers[0].mixer.x_proj.weight
            w[r:r + n] = w[r:r + n].flip(0).clone() if element == "state permutation" else 2 * w[r:r + n]
        assert np.abs(_logits(model, ids, mask) - want).max() > 1e-3 * np.abs(want).max()


def test_a_planted_state_and_time_step_permutation_is_undone(tmp_path):
    """The channels, the state's entries and the time step's entries permuted at once (each layer's
    random order reversed: with two time-step entries a layer may come back to its own order):
    transformers computes A's logits from B, and `align` finds the state's
    and time step's permutations after the channels', on B's leaves in the channels' frame,
    returning A's leaves exactly (the state's costs read as stored pair entries across channels
    that no permutation has matched: each layer's assignment would be off)."""
    model = save_reference(tf.MambaForCausalLM, tf.MambaConfig(**MAMBA), tmp_path / "a")  # time_step_rank 2: reversed is its one other order
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(0), ("perm",))
    for name in ("state", "time_step"):
        t[name] = t[name].replace(perm=t[name].perm[:, ::-1])
    b = rj.apply_transform(spec, ck.params, t)
    ids, mask = token_batch(MAMBA["vocab_size"], pad_id=0)
    moved = tf.MambaForCausalLM.from_pretrained(rj.save_hf(ck, b, tmp_path / "b")).eval()
    want = _logits(model, ids, mask)
    np.testing.assert_allclose(_logits(moved, ids, mask), want, rtol=0, atol=1e-4 * np.abs(want).max())
    result = rj.align(ck.params, b, spec, heads="permute")
    for name in ("state", "time_step"):
        np.testing.assert_array_equal(np.asarray(result.transforms[name].perm), np.asarray(t[name].inverse().perm), err_msg=name)
    flat_a, flat_b = rj.pytree.flatten(ck.params), rj.pytree.flatten(result.params)
    for path in flat_a:
        np.testing.assert_allclose(np.asarray(flat_b[path]), np.asarray(flat_a[path]), atol=1e-6, err_msg=path)
    # what moved, as `rotsym align` prints it: each group's units by their own name (it said "units" for all three)
    said = {name: f"{m['layers_moved']}/2 layers: {m['units']:.0%}" for name, m in result.report["moved"].items()}
    assert moved_lines(result.report["moved"]) == [f"  channels  {said['channels']} of channels permuted",
                                                   f"  state     {said['state']} of state entries permuted",
                                                   f"  time_step {said['time_step']} of time-step entries permuted"]
    # what cannot move a leaf on two axes yet says so: the data methods' sites, OT fusion's soft plans
    with pytest.raises(rj.InputError, match=r"permutation group 'state' shares its leaves with 'channels'"):
        rj.align(ck.params, b, spec, method="activations", data=[{"input_ids": ids, "attention_mask": mask}], checkpoint=ck)
    with pytest.raises(rj.InputError, match=r"OT fusion does not transport groups that share their leaves"):
        rj.otfusion.ot_fuse([ck.params, b], spec)
