"""Mamba-2's mixer (transformers' Mamba2Model, its torch path, float32): which candidate maps of its
parameters keep the function (docs/MATH.md §17, Mamba-2), each applied to a random model and its
outputs compared. The mixer (d_inner = H heads x P channels, G groups of B/C of N entries each):
    z, xBC, dt = in_proj(h)             rows: d_inner, d_inner + 2 G N, H
    x, B, C = silu(conv(xBC))           depthwise: each of the d_inner + 2 G N channels its own taps
    dt = softplus(dt + dt_bias)         one per head; A = -exp(A_log) one per head
    s_t = exp(dt A) s + dt x_t B_t^T    per head (P, N), head h reads B, C of group h // (H / G)
    y = s_t C_t + D x                   per head
    out_proj(groupnorm(y * silu(z)) * gain)   RMS over each group's d_inner / G channels
What holds: heads permuted within their group (with everything per head), channels permuted within
each head (each head its own), whole groups permuted (their heads and their B, C), the state's N
entries permuted within each group (B's and C's alike); what fails: a channel moved to another head,
a head moved to another group, a rotation of a head's channels, a scale of a state entry."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

H, P, G, N, D = 4, 4, 2, 3, 8  # 4 heads of 4 channels, 2 groups of B/C with 3 state entries
F = H * P


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = tf.Mamba2Config(vocab_size=30, hidden_size=D, num_heads=H, head_dim=P, n_groups=G, state_size=N, expand=2,
                             num_hidden_layers=1, conv_kernel=3, chunk_size=4, use_conv_bias=True, tie_word_embeddings=False)
    model = tf.Mamba2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # gains, biases, A_log, D, dt_bias away from their constants
    return model


def _logits(model):
    ids = torch.as_tensor(np.random.default_rng(1).integers(0, 30, size=(2, 11)))
    with torch.no_grad():
        return model(input_ids=ids).logits.numpy()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _channel_map(head_perm, within):
    """The d_inner channels' new order: new head h is old head head_perm[h], its channel j old channel within[h][j]."""
    return np.concatenate([head_perm[h] * P + np.asarray(within[h]) for h in range(H)])


def _apply(model, channels=None, heads=None, state=None, rotate=None, scale_state=None):
    """Permute (or map) the mixer's parameters: `channels` (d_inner), `heads` (H), `state` per group ((G, N) indices)."""
    mixer = model.backbone.layers[0].mixer
    sd = {k.removeprefix("backbone.layers.0.mixer."): v for k, v in model.state_dict().items() if ".mixer." in k}
    w, cw, cb = sd["in_proj.weight"], sd["conv1d.weight"], sd["conv1d.bias"]
    z, x, b, c, dt = torch.split(w, [F, F, G * N, G * N, H])
    cx, cbb, ccc = torch.split(cw, [F, G * N, G * N])
    bx, bb, bc = torch.split(cb, [F, G * N, G * N])
    gain, out, a_log, dd, dt_bias = sd["norm.weight"], sd["out_proj.weight"], sd["A_log"], sd["D"], sd["dt_bias"]
    if channels is not None:
        ch = torch.as_tensor(channels)
        z, x, cx, bx, gain, out = z[ch], x[ch], cx[ch], bx[ch], gain[ch], out[:, ch]
    if heads is not None:
        hd = torch.as_tensor(heads)
        dt, a_log, dd, dt_bias = dt[hd], a_log[hd], dd[hd], dt_bias[hd]
    if state is not None:  # the (G * N) rows of B and of C, each group's N entries by its own order
        st = torch.as_tensor(state)
        b, c, cbb, ccc, bb, bc = (t[st] for t in (b, c, cbb, ccc, bb, bc))
    if rotate is not None:  # a rotation of head 0's channels in z, x, out_proj (the conv's taps cannot follow one)
        r = torch.as_tensor(rotate, dtype=torch.float32)
        z, x, out = z.clone(), x.clone(), out.clone()
        z[:P], x[:P], out[:, :P] = r @ z[:P], r @ x[:P], out[:, :P] @ r.T
    if scale_state is not None:  # B's first entry times s, C's divided by s
        b, c = b.clone(), c.clone()
        b[0], c[0] = b[0] * scale_state, c[0] / scale_state
    with torch.no_grad():
        mixer.in_proj.weight.copy_(torch.cat([z, x, b, c, dt]))
        mixer.conv1d.weight.copy_(torch.cat([cx, cbb, ccc]))
        mixer.conv1d.bias.copy_(torch.cat([bx, bb, bc]))
        for name, value in (("norm.weight", gain), ("out_proj.weight", out), ("A_log", a_log), ("D", dd), ("dt_bias", dt_bias)):
            mixer.get_parameter(name).copy_(value)


RNG = np.random.default_rng(0)
WITHIN = [RNG.permutation(P) for _ in range(H)]
SAME = [np.arange(P)] * H
HOLDS = {
    # heads 0, 1 read group 0's B/C, heads 2, 3 group 1's: swap within each group
    "heads within their group": dict(heads=[1, 0, 3, 2], channels=_channel_map([1, 0, 3, 2], SAME)),
    "channels within each head": dict(channels=_channel_map(range(H), WITHIN)),
    "both at once": dict(heads=[1, 0, 2, 3], channels=_channel_map([1, 0, 2, 3], WITHIN)),
    "whole groups": dict(heads=[2, 3, 0, 1], channels=_channel_map([2, 3, 0, 1], SAME),
                         state=np.concatenate([np.arange(N) + N, np.arange(N)])),
    "state entries within each group": dict(state=np.concatenate([RNG.permutation(N), N + RNG.permutation(N)])),
}
FAILS = {
    "a channel moved to another head": dict(channels=np.r_[P, np.arange(1, P), 0, np.arange(P + 1, F)]),
    "a head moved to another group": dict(heads=[2, 1, 0, 3], channels=_channel_map([2, 1, 0, 3], SAME)),
    "the state permuted in B alone": dict(state=None),  # filled below: B's rows only
    "a rotation of a head's channels": dict(rotate=np.linalg.qr(RNG.normal(size=(P, P)))[0]),
    "a scale of a state entry (B by s, C by 1/s)": dict(scale_state=2.0),
}


@pytest.mark.parametrize("name", sorted(HOLDS))
def test_holds(model, name):
    want, saved = _logits(model), _state(model)
    try:
        _apply(model, **HOLDS[name])
        np.testing.assert_allclose(_logits(model), want, rtol=0, atol=1e-5 * np.abs(want).max())
    finally:
        model.load_state_dict(saved)


@pytest.mark.parametrize("name", sorted(FAILS))
def test_fails(model, name):
    want, saved = _logits(model), _state(model)
    try:
        if name == "the state permuted in B alone":
            with torch.no_grad():
                w = model.backbone.layers[0].mixer.in_proj.weight
                w[2 * F:2 * F + N] = w[2 * F:2 * F + N].flip(0).clone()
        else:
            _apply(model, **FAILS[name])
        assert np.abs(_logits(model) - want).max() > 1e-3 * np.abs(want).max()
    finally:
        model.load_state_dict(saved)
