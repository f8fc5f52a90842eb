"""Property: whatever is done to a checkpoint folder's safetensors headers and bytes, config values
or shard index, `load_hf` either loads a checkpoint whose outputs match transformers' PyTorch model
on the same folder (or, for a config our forward pass does not run, refuses it with CheckpointError
when it runs), or raises CheckpointError; never another exception, never a hang.

Derandomized (the same examples on every run) and bounded in examples; in `make test-slow`."""

import json
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from parity_utils import reference_outputs, save_reference, token_batch, torch  # noqa: F401 (skips without torch)

import rotsym_jax as rj

tf = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("float32_models")]

SMALL = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, vocab_size=40,
             max_position_embeddings=16, type_vocab_size=2)
FUZZ = settings(
    max_examples=100, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A single-file and a sharded copy of one tiny BERT written by transformers."""
    root = tmp_path_factory.mktemp("fuzz")
    save_reference(tf.BertModel, tf.BertConfig(**SMALL), root / "single")
    ck = rj.load_hf(root / "single")
    rj.save_hf(ck, ck.params, root / "sharded", max_shard_bytes=4_000)
    return root


def _copy(pristine, tmp_path_factory, kind):
    folder = tmp_path_factory.mktemp("case") / kind
    shutil.copytree(pristine / kind, folder)
    return folder


def _loads_as_transformers_does(folder):
    """The property itself."""
    try:
        ck = rj.load_hf(folder)
    except rj.CheckpointError as e:
        event(f"refused: {str(e).split(': ')[1][:40]}")
        return
    try:  # read from the layout alone: a config our forward pass does not run is refused when it runs
        assert ck.graphdef is not None
    except rj.CheckpointError as e:
        assert "the forward pass cannot run this config" in str(e), e
        event("read, not run")
        return
    event("loaded")
    # Loaded: transformers must load the same folder, and the outputs must agree.
    model = tf.AutoModel.from_pretrained(folder, attn_implementation="eager").float().eval()
    ids, mask = token_batch(ck.config.vocab_size, length=6)
    ref = reference_outputs(model, input_ids=ids, attention_mask=mask)
    ours = ck.apply(ck.params, input_ids=ids, attention_mask=mask)
    valid = mask.astype(bool)
    a, b = np.asarray(ours["last_hidden_state"], np.float32)[valid], ref["last_hidden_state"][valid]
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=1e-4)


def _read_header(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write_header(path, header, body):
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "X"]
header_edits = st.one_of(
    st.tuples(st.just("dtype"), st.sampled_from(DTYPES)),
    st.tuples(st.just("shape"), st.lists(st.integers(-2, 40), max_size=3)),
    st.tuples(st.just("offsets"), st.tuples(st.integers(-8, 8), st.integers(-8, 8))),
    st.tuples(st.just("drop"), st.none()),
    st.tuples(st.just("metadata"), st.sampled_from([None, 3, "x", [1], {"format": 1}])),
)


@FUZZ
@given(edit=header_edits, which=st.integers(0, 10_000))
def test_fuzz_safetensors_header(pristine, tmp_path_factory, edit, which):
    folder = _copy(pristine, tmp_path_factory, "single")
    path = folder / "model.safetensors"
    header, body = _read_header(path)
    names = sorted(k for k in header if k != "__metadata__")
    name = names[which % len(names)]
    kind, value = edit
    if kind == "dtype":
        header[name]["dtype"] = value
    elif kind == "shape":
        header[name]["shape"] = value
    elif kind == "offsets":
        start, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [start + value[0], end + value[1]]
    elif kind == "drop":
        del header[name]
    else:
        header["__metadata__"] = value
    _write_header(path, header, body)
    _loads_as_transformers_does(folder)


@FUZZ
@given(kind=st.sampled_from(["single", "sharded"]), cut=st.floats(0, 1), flips=st.lists(st.integers(0, 10**6), max_size=4))
def test_fuzz_bytes(pristine, tmp_path_factory, kind, cut, flips):
    folder = _copy(pristine, tmp_path_factory, kind)
    files = sorted(folder.glob("*.safetensors"))
    path = files[len(flips) % len(files)]
    data = bytearray(path.read_bytes())
    for f in flips:  # flip bits anywhere: header, length field or tensor bytes
        data[f % len(data)] ^= 1 << (f % 8)
    path.write_bytes(bytes(data[: max(0, int(len(data) * cut)) if cut < 0.5 else len(data)]))
    _loads_as_transformers_does(folder)


CONFIG_KEYS = ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
               "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "hidden_act", "model_type",
               "position_embedding_type", "pad_token_id", "num_labels"]
values = st.one_of(
    st.sampled_from([1e-12, 1e-5, 0.5, 0, 1, 2, 4, 8, 16, 24, 40]),  # plausible, often loadable
    st.integers(-3, 64), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.sampled_from(["gelu", "relu", "silu", "tanh", "gelu_new", "nope", "bert", "llama", "absolute", "relative_key", ""]),
    st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.just("a"), st.integers(), max_size=1),
)


@FUZZ
@given(key=st.sampled_from(CONFIG_KEYS), value=values)
def test_fuzz_config_values(pristine, tmp_path_factory, key, value):
    folder = _copy(pristine, tmp_path_factory, "single")
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    _loads_as_transformers_does(folder)


index_edits = st.one_of(
    st.tuples(st.just("drop"), st.integers(0, 1000)),
    st.tuples(st.just("point"), st.tuples(st.integers(0, 1000), st.sampled_from(
        ["../x.safetensors", "/tmp/x.safetensors", "", ".", "nope.safetensors", "config.json", "model-00001-of-00003.safetensors"]))),
    st.tuples(st.just("value"), st.tuples(st.integers(0, 1000), st.sampled_from([None, 1, ["a"], {"a": 1}]))),
    st.tuples(st.just("whole"), st.sampled_from([[], None, "x", {"weight_map": []}, {"weight_map": None}, {}])),
)


@FUZZ
@given(edit=index_edits)
def test_fuzz_shard_index(pristine, tmp_path_factory, edit):
    folder = _copy(pristine, tmp_path_factory, "sharded")
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    names = sorted(index["weight_map"])
    kind, value = edit
    if kind == "drop":
        del index["weight_map"][names[value % len(names)]]
    elif kind in ("point", "value"):
        index["weight_map"][names[value[0] % len(names)]] = value[1]
    else:
        index = value
    path.write_text(json.dumps(index))
    _loads_as_transformers_does(folder)
