"""DeBERTa v1 (`deberta`): DeBERTa-v2's encoder (post-LN, disentangled attention; `families/deberta.py`)
with v1's attention tensors: a fused `in_proj` without bias whose rows are [H, (q, k, v), dh], the
queries' and values' biases apart (`q_bias`, `v_bias`; the keys have none), the relative positions'
own key projection `pos_proj` (c2p, no bias) and query projection `pos_q_proj` (p2c, with a bias).
No position buckets, no norm of the relative embeddings, no shared attention key. `talking_head`
(a mix of the heads' scores and of their probabilities, which fixes no head but mixes them all) is
refused by name.

Leaves: DeBERTa-v2's (layers/{i}/attention/{query,key,value}/kernel split from in_proj, query/bias
and value/bias from q_bias and v_bias, pos_key/kernel from pos_proj, pos_query/{kernel,bias} from
pos_q_proj); its groups, heads and refusals are v2's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .config import ConfigSchema
from .deberta import DEBERTA_V2
from .deberta import SCHEMA as V2_SCHEMA
from .family import Convert, Tensor, linear, norm, weight


def _heads(config) -> tuple[int, int]:
    h = config.num_attention_heads
    return h, config.hidden_size // h


def _split_in_proj(a: np.ndarray, config) -> tuple[np.ndarray, ...]:
    """in_proj.weight (3 d, d), rows [H, (q, k, v), dh] -> q, k, v kernels (d, d)."""
    h, dh = _heads(config)
    grouped = a.reshape(h, 3, dh, a.shape[-1])
    return tuple(grouped[:, j].reshape(h * dh, -1).T for j in range(3))


def _fuse_in_proj(parts, config) -> np.ndarray:
    h, dh = _heads(config)
    return np.stack([x.T.reshape(h, dh, -1) for x in parts], axis=1).reshape(3 * h * dh, -1)


def _own_position_projection(kind: str):
    return lambda config: bool(config.relative_attention) and kind in list(config.pos_att_type or [])


def _when(tensors: tuple, predicate) -> tuple:
    return tuple(dataclasses.replace(t, when=predicate) for t in tensors)


IN_PROJ = Convert("deberta_in_proj", _split_in_proj, _fuse_in_proj)
_SELF = "encoder.layer.{i}.attention.self"
_D = "hidden_size"
_LAYER = (
    Tensor(f"{_SELF}.in_proj.weight", tuple(f"layers/{{i}}/attention/{p}/kernel" for p in ("query", "key", "value")), ((_D, _D),) * 3,
           (0, 0, 0), IN_PROJ),
    *weight(f"{_SELF}.q_bias", "layers/{i}/attention/query/bias", (_D,)),
    *weight(f"{_SELF}.v_bias", "layers/{i}/attention/value/bias", (_D,)),
    *_when(linear(f"{_SELF}.pos_proj", "layers/{i}/attention/pos_key", _D, _D, bias=False, reads=True), _own_position_projection("c2p")),
    *_when(linear(f"{_SELF}.pos_q_proj", "layers/{i}/attention/pos_query", _D, _D, reads=True), _own_position_projection("p2c")),
    *linear("encoder.layer.{i}.attention.output.dense", "layers/{i}/attention/out", _D, _D, writes=True),
    *norm("encoder.layer.{i}.attention.output.LayerNorm", "layers/{i}/attention_norm"),
    *linear("encoder.layer.{i}.intermediate.dense", "layers/{i}/mlp/up", _D, "intermediate_size", reads=True),
    *linear("encoder.layer.{i}.output.dense", "layers/{i}/mlp/down", "intermediate_size", _D, writes=True),
    *norm("encoder.layer.{i}.output.LayerNorm", "layers/{i}/mlp_norm"),
)

SCHEMA = dataclasses.replace(V2_SCHEMA, model_type="deberta", class_name="DebertaConfig",
                             fields={**V2_SCHEMA.fields, "vocab_size": (V2_SCHEMA.fields["vocab_size"][0], 50265),
                                     "hidden_size": (V2_SCHEMA.fields["hidden_size"][0], 768),
                                     "num_hidden_layers": (V2_SCHEMA.fields["num_hidden_layers"][0], 12),
                                     "num_attention_heads": (V2_SCHEMA.fields["num_attention_heads"][0], 12),
                                     "intermediate_size": (V2_SCHEMA.fields["intermediate_size"][0], 3072)})
assert isinstance(SCHEMA, ConfigSchema)

DEBERTA = dataclasses.replace(
    DEBERTA_V2,
    name="deberta_v1",
    configs=(SCHEMA,),
    stems={"deberta": "Deberta"},
    embeddings=tuple(t for t in DEBERTA_V2.embeddings if "relative_norm" not in t.ours[0]),
    layer=_LAYER,
    unsupported=(("talking_head", "head_logits_proj and head_weights_proj mix the heads' scores and probabilities"),),
)
