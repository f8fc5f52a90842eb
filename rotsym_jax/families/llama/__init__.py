"""Llama, Mistral, Qwen2, Qwen3 and Phi-3: pre-RMSNorm causal decoders with RoPE, grouped-query
attention and a SwiGLU MLP, with an optional (tied or untied) language-model head. One model class
serves all five; Qwen3 adds QK-norm (an RMSNorm over each head's q and k, before RoPE); Phi-3 fuses
its projections (qkv_proj = [Q; K; V], gate_up_proj = [gate; up], split into the shared leaves) and
may rotate only part of each head (partial_rotary_factor). Mixtral, Qwen3-MoE and Qwen2-MoE hold
sparse mixtures of experts (Qwen2-MoE: beside each, a shared expert gated by a sigmoid).

Leaves (d = hidden_size, f = intermediate_size, V = vocab_size, H = num_attention_heads,
G = num_key_value_heads, dh = config.head_dim, else d // H):
    embeddings/word/embedding                  (V, d)        HF embed_tokens
    layers/{i}/attention_norm/scale            (d,)          HF input_layernorm (RMSNorm)
    layers/{i}/attention/query/kernel (d, H*dh), .../bias (H*dh,)   Llama attention_bias; Qwen2
    layers/{i}/attention/key/kernel   (d, G*dh), .../bias (G*dh,)   Llama attention_bias; Qwen2
    layers/{i}/attention/value/kernel (d, G*dh), .../bias (G*dh,)   Llama attention_bias; Qwen2
    layers/{i}/attention/out/kernel   (H*dh, d), .../bias (d,)      Llama, Qwen3 attention_bias only
    layers/{i}/attention/{query,key}_norm/scale (dh,)   Qwen3 q_norm, k_norm
    layers/{i}/mlp_norm/scale                  (d,)          HF post_attention_layernorm
    layers/{i}/mlp/{gate,up}/kernel (d, f), layers/{i}/mlp/down/kernel (f, d)
                                               (+ bias (f,) / (d,) with Llama mlp_bias)
    layers/{i}/moe/router/kernel (d, E), moe/{gate,up}/kernel (E, d, f'), moe/down/kernel (E, f', d)
                                               a mixture's layers: Mixtral block_sparse_moe.*, Qwen3-MoE,
                                               Qwen2-MoE, OLMoE, FlexOlmo mlp.gate and mlp.experts.*;
                                               HunYuan MoE mlp.gate.wg (families/hunyuan.py)
    layers/{i}/shared_mlp/{gate,up,down}/kernel, layers/{i}/shared_gate/kernel (d, 1)
                                               Qwen2-MoE mlp.shared_expert.*, mlp.shared_expert_gate;
                                               HunYuan MoE mlp.shared_mlp.* (no gate)
    final_norm/scale                           (d,)          HF model.norm
    task heads (the records at the bottom; all run here):
        lm                       *ForCausalLM: lm_head/kernel (d, V) without tie_word_embeddings;
                                 tied: logits = h @ embeddings/word/embedding^T
        sequence_classification  head/score (d, num_labels), no bias, on the last token that is
                                 not padding
        token_classification     head/token_classifier (d, num_labels) on every token (HF `score`)
        question_answering       head/qa_outputs (d, 2): start and end logits (LlamaFor... and
                                 Qwen2For... name their base model `transformer.`)
MLP: down(silu(gate(x)) * up(x)). RoPE in HF's rotate_half layout (pairs (i, i + dh/2)); rope_type
"default", "linear", "llama3" or "yarn" (its attention factor on cos and sin), over the whole head (partial_rotary_factor 1).
Sliding window (as transformers 5 applies it): Mistral windows every layer when config.sliding_window
is set; Qwen2 and Qwen3 window the layers config.layer_types marks "sliding_attention" (by default those from
max_window_layers on, and only with use_sliding_window); Ministral and SmolLM3 those layer_types marks; Llama never windows.
SmolLM3's NoPE layers (no_rope_layers[i] == 0) take no RoPE; Seed-OSS's o_proj bias is attention_out_bias.
Inputs: input_ids (B, T), attention_mask (B, T) 1 = token 0 = padding, position_ids (default arange).
Outputs: last_hidden_state (after the final norm), logits with head "lm".
"""

from ._config import CONFIGS, layer_rope_parameters, rope_inv_freq
from ._records import APERTUS, EXAONE, EXAONE4, FLEX_OLMO, GEMMA, GEMMA2, GEMMA3, GRANITE, LLAMA, OLMO2, OLMO3, OLMOE

__all__ = ["APERTUS", "CONFIGS", "EXAONE", "EXAONE4", "FLEX_OLMO", "GEMMA", "GEMMA2", "GEMMA3", "GRANITE", "LLAMA", "OLMO2", "OLMO3", "OLMOE",
           "layer_rope_parameters", "rope_inv_freq"]
