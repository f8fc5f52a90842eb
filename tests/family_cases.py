"""Every supported family and task head as data: a transformers class, a config and what loading it
must find. tests/test_conformance.py runs every contract over this table; the family files test
what is particular to one family (fused projections, positions, refusals) on its rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import transformers as tf
from parity_utils import reference_outputs, reference_with_base, token_batch

# One set of shapes for every text model, so that the programs they compile are shared between
# families and heads wherever their groups are alike.
TEXT = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=20)
GPT2 = dict(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=20, pad_token_id=0)
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
GRAY = dict(image_size=8, patch_size=2, num_channels=1)
RGB = dict(image_size=16, patch_size=4, num_channels=3)
# GPT-NeoX at head dim 16, so that a quarter of a head is two rotary pairs.
NEOX = dict(TEXT, hidden_size=64, intermediate_size=96, max_position_embeddings=32)
# ModernBERT: 3 layers, global every 2nd (layers 0 and 2), a band of 2 tokens in layer 1.
MODERNBERT = dict(vocab_size=60, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=32,
                  global_attn_every_n_layers=2, local_attention=4, global_rope_theta=1000.0, local_rope_theta=50.0, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
BIASES = dict(norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True)
DISTILBERT = dict(vocab_size=60, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=20)
# Small enough that the test positions meet all three llama3 frequency bands.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
# At transformers' initializer_range (0.02) exact and tanh GELU or attention scales agree within
# tolerance; larger weights tell them apart.
WIDE = dict(initializer_range=0.2)
# Granite's four scalars, none 1 (a multiplier read in the wrong place shows)
GRANITE = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)

# Phi-3.5-MoE past its LM's default case: its variant's parity, its other classes (the LM's case holds every group)
PHIMOE_SLOW = ("PhimoeModel", "PhimoeForSequenceClassification", "PhimoeForCausalLM[tied-window-default-rope]")
# GPT-OSS past its LM's default case: its variant's parity, its other classes (the LM's case holds every group)
GPT_OSS_SLOW = ("GptOssModel", "GptOssForSequenceClassification", "GptOssForTokenClassification", "GptOssForCausalLM[tied-mha-default-rope-top-1]")
# Qwen2-MoE's heads past its LM: the LM's case runs every contract by default, these (its variant's
# parity too) in the slow run (the heads' code is Llama's; the LM's case holds every group)
QWEN2_MOE_SLOW = ("Qwen2MoeModel", "Qwen2MoeForSequenceClassification", "Qwen2MoeForTokenClassification", "Qwen2MoeForQuestionAnswering")
# The default run's time budget: families whose groups the older ones exercise already stream and
# merge in the slow run; encoder heads past the masked LM and the sequence classifier likewise.
# EXAONE MoE past its LM's default case (that case holds every group)
EXAONE_MOE_SLOW = ("ExaoneMoeModel", "ExaoneMoeForCausalLM[all-full-ungrouped-tied]")
# dots.llm1 past its LM's default case (that case holds every group)
DOTS1_SLOW = ("Dots1Model", "Dots1ForCausalLM[full-ungrouped-tied-head-dim]")
# HunYuan MoE past its LM's default case (that case holds every group)
HUNYUAN_MOE_SLOW = ("HunYuanMoEV1ForSequenceClassification", "HunYuanMoEV1Model", "HunYuanMoEV1ForCausalLM[tied-mha-top-1]")
# FlexOlmo past its LM's default case (that case holds every group)
FLEX_OLMO_SLOW = ("FlexOlmoModel", "FlexOlmoForCausalLM[tied-normalized-top-1]")
# GLM-4.7-Flash past its LM's default case (its streaming and merges run in the slow suite, as GLM-4-MoE's: "Glm4Moe" below)
GLM4_MOE_LITE_SLOW = ("Glm4MoeLiteModel", "Glm4MoeLiteForCausalLM[tied-plain-queries-rotate-half]")
# MiniCPM3 past its LM's default case (that case holds every group)
MINICPM3_SLOW = ("MiniCPM3Model", "MiniCPM3ForSequenceClassification", "MiniCPM3ForCausalLM[short-rope-plain-queries-untied-unscaled]")
# Qwen3.5 / Qwen3.5-MoE / Qwen3-Next past each model type's LM (whose case holds every group): the base models, the variants
QWEN3_NEXT_SLOW = ("Qwen3_5TextModel", "Qwen3_5ForCausalLM[tied-interval-half-rotary]", "Qwen3_5MoeTextModel", "Qwen3NextModel",
                   "Qwen3NextForCausalLM[step-2-unnormalized-tied]")
# MiniMax past its LM's default case (that case holds every group)
MINIMAX_SLOW = ("MiniMaxModel", "MiniMaxForCausalLM[tied-lightning-only]")
# ELECTRA past its discriminator's and generator's default cases (the discriminator's holds every group)
ELECTRA_SLOW = ("ElectraModel", "ElectraForSequenceClassification", "ElectraForTokenClassification", "ElectraForQuestionAnswering",
                "ElectraForPreTraining[unprojected-relu]", "ElectraForMaskedLM[unprojected-untied]", "ElectraForMaskedLM[projected-untied]",
                "ElectraForMaskedLM[projected]")
# mT5 and umT5 past each LM's default case (that case holds every group)
T5_KIN_SLOW = tuple(f"{t}{c}" for t in ("MT5", "UMT5") for c in ("Model", "ForSequenceClassification", "ForQuestionAnswering",
                                                                  "ForConditionalGeneration[tied-relu]"))
# YaRN as OLMo 3's releases set it on their full layers (the legacy rope_scaling), scaled down: the test positions meet its ramp
OLMO3_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, attention_factor=1.2, beta_fast=8.0, beta_slow=1.0)
# OLMo 3, SmolLM3, Ministral and Seed-OSS (the Llama package's records) past each LM's default case (that case holds every group)
LLAMA_KIN_SLOW = ("LlamaForCausalLM[yarn]", "Olmo3Model", "Olmo3ForCausalLM[tied-mqa]", "Olmo3ForSequenceClassification",
                  "SmolLM3Model", "SmolLM3ForCausalLM[tied-linear-rope-mlp-bias]", "SmolLM3ForSequenceClassification", "SmolLM3ForQuestionAnswering",
                  "MinistralModel", "MinistralForTokenClassification", "MinistralForQuestionAnswering", "SeedOssModel",
                  "SeedOssForSequenceClassification")
# OPT past its LM's and its post-norm projected base model's default cases (those two hold every group kind)
OPT_SLOW = ("OPTForSequenceClassification", "OPTForQuestionAnswering", "OPTForCausalLM[untied-no-bias-plain-norms]")
# GPT-Neo past its LM's default case (that case holds every group)
GPT_NEO_SLOW = ("GPTNeoModel", "GPTNeoForSequenceClassification", "GPTNeoForTokenClassification", "GPTNeoForQuestionAnswering",
                "GPTNeoForCausalLM[local-global-untied-relu]")
# DeBERTa v1 past its sequence classifier's default case (that case holds every group)
DEBERTA_V1_SLOW = ("DebertaModel", "DebertaForMaskedLM", "DebertaForTokenClassification", "DebertaForQuestionAnswering")
# DINOv2 past each model type's classifier (that case holds every group)
DINOV2_SLOW = ("Dinov2Model", "Dinov2ForImageClassification[swiglu-no-qkv-bias]", "Dinov2WithRegistersModel")
# BLOOM past its LM's default case (that case holds every group)
BLOOM_SLOW = ("BloomModel", "BloomForSequenceClassification", "BloomForTokenClassification", "BloomForQuestionAnswering",
              "BloomForCausalLM[untied-8-heads]")
# Marian, Pegasus, M2M100, PLBART and Blenderbot past each LM's default case (that case holds every group): the base models, the variants
MARIAN_SLOW = ("MarianModel", "MarianMTModel[separate-vocabularies-unscaled]", "PegasusModel",
               "PegasusForConditionalGeneration[unscaled-relu]", "M2M100Model", "M2M100ForConditionalGeneration[unscaled-gelu-head-dim-9]",
               "PLBartModel", "PLBartForSequenceClassification", "BlenderbotModel")
SLOW_FAMILIES = ("GPTBigCode", "GPTNeoX", "GPTJ", "Bart", "MBart", "T5", "Whisper", "Phi", "StableLm", "Starcoder2", "Cohere", "Falcon", "Phi3", "Qwen3", "Mixtral", "Gemma",
                 "Olmo", "Granite", "DistilBert", "ModernBert", "DebertaV2", "DeepseekV2", "DeepseekV3", "Glm4Moe", "Mamba", "Mamba2", "GraniteMoeHybrid",
                 "Arcee", "Glm", "Exaone4", "Apertus", "Lfm2", "Afmoe", "Llama4", "Nemotron", *QWEN2_MOE_SLOW,
                 "HeliumForSequenceClassification", "HeliumForTokenClassification", "Ernie4_5Model", "Ernie4_5_MoeModel", *PHIMOE_SLOW,
                 "HunYuanDenseV1ForSequenceClassification", "HunYuanDenseV1Model", "Jais2Model", *EXAONE_MOE_SLOW, *GPT_OSS_SLOW,
                 *DOTS1_SLOW, *HUNYUAN_MOE_SLOW, *FLEX_OLMO_SLOW, *MINICPM3_SLOW, *QWEN3_NEXT_SLOW,
                 *MINIMAX_SLOW, *LLAMA_KIN_SLOW, *T5_KIN_SLOW, *ELECTRA_SLOW,
                 *OPT_SLOW, *GPT_NEO_SLOW, *BLOOM_SLOW, *DINOV2_SLOW, *DEBERTA_V1_SLOW, *MARIAN_SLOW)
# Cases whose parity contract, and classes whose planted contract, run in the slow suite only (the
# default run's budget): by default Mamba-2's LM is planted and aligned (the mixers' heads and channels,
# the state, the stream), every case round-trips, and tests/test_mamba2_symmetries.py runs.
SLOW_PARITY = ("Mamba2Model", "Mamba2ForCausalLM", "GraniteMoeHybridModel", "GraniteMoeHybridForCausalLM",
               "GraniteMoeHybridForCausalLM[dense-groups-tied]", "Qwen2MoeForCausalLM[normalized-tied-step]", *QWEN2_MOE_SLOW,
               "GraniteMoeModel", "GraniteMoeSharedForCausalLM[no-shared-top-1-tied]", *PHIMOE_SLOW,
               "HunYuanDenseV1ForCausalLM[tied-mha-linear-rope]", "HunYuanDenseV1ForSequenceClassification", "HunYuanDenseV1Model",
               "HunYuanDenseV1ForCausalLM[use-qk-norm-false]",
               "Jais2ForCausalLM[tied-mqa-head-dim-linear-rope]", "Jais2Model", *EXAONE_MOE_SLOW, *GPT_OSS_SLOW,
                 *DOTS1_SLOW, *HUNYUAN_MOE_SLOW, *FLEX_OLMO_SLOW, *GLM4_MOE_LITE_SLOW,
                 *MINICPM3_SLOW, *QWEN3_NEXT_SLOW,
                 *MINIMAX_SLOW, *LLAMA_KIN_SLOW, *T5_KIN_SLOW, *ELECTRA_SLOW,
                 *OPT_SLOW, *GPT_NEO_SLOW, *BLOOM_SLOW, *DINOV2_SLOW, *DEBERTA_V1_SLOW, *MARIAN_SLOW)
# Llama 4 whole: its tower's, adapter's and projector's four groups beside the MoE text model's (22 s of one worker; its text
# model's groups are planted by default on llama4_text's rows, the same group kinds of the towers on Mistral 3's and Qwen's)
SLOW_PLANTED = ("Mamba2Model", "GraniteMoeHybridModel", "GraniteMoeHybridForCausalLM", "Llama4ForConditionalGeneration")
DEFAULT_ENCODER_HEADS = ("DistilBertForMaskedLM", "DistilBertForSequenceClassification", "ModernBertForMaskedLM",
                         "ModernBertForSequenceClassification", "DebertaV2ForSequenceClassification")


@dataclasses.dataclass(frozen=True)
class Case:
    """`cls`: a transformers class name; `config`: makes its config; `head`: what load_hf must
    find (None: a bare model); `runs`: our forward pass runs the head; `variant`: a config that
    tests the forward pass and the round trip, not a new head (the group contracts run once per
    class); `kwargs`: the model class's own arguments."""

    cls: str
    config: Callable
    head: str | None
    family: str
    runs: bool = True
    variant: str = ""
    kwargs: tuple = ()

    @property
    def id(self) -> str:
        return f"{self.cls}[{self.variant}]" if self.variant else self.cls

    @property
    def model_class(self):
        return getattr(tf, self.cls)

    @property
    def slow_to_stream(self) -> bool:
        """Streaming and merging this head run in the slow suite (SLOW_FAMILIES says why)."""
        return self.cls.startswith(SLOW_FAMILIES) and self.cls not in DEFAULT_ENCODER_HEADS


def _bert(cls, head, runs=True, variant="", kwargs=(), **config):
    return Case(cls, lambda: tf.BertConfig(**TEXT, **config), head, "bert", runs, variant, kwargs)


def _roberta(cls, head, runs=True, variant="", kwargs=(), **config):
    return Case(cls, lambda: tf.RobertaConfig(**TEXT, **config), head, "roberta", runs, variant, kwargs)


def _alias(cls, config_cls, head, variant="", kwargs=(), **config):
    """RoBERTa's architecture under another model_type (XLM-RoBERTa, CamemBERT): read as roberta."""
    return Case(cls, lambda: getattr(tf, config_cls)(**TEXT, **config), head, "roberta", True, variant, kwargs)


def _electra(cls, head, variant="", **config):
    return Case(cls, lambda: tf.ElectraConfig(**{**TEXT, "embedding_size": 24, **config}), head, "electra", True, variant)


def _gpt2(cls, head, runs=True, variant="", **config):
    return Case(cls, lambda: tf.GPT2Config(**{**GPT2, **config}), head, "gpt2", runs, variant)


def _vit(cls, head, runs=True, variant="", kwargs=(), **config):
    return Case(cls, lambda: tf.ViTConfig(**VIT, **{**GRAY, **config}), head, "vit", runs, variant, kwargs)


def _decoder(cls, config_cls, head, family="llama", variant="", base=TEXT, **config):
    return Case(cls, lambda: getattr(tf, config_cls)(**{**base, **config}), head, family, True, variant)


# GPT-J at head dim 16 with rotary_dim 8: four interleaved pairs, and entries past them; wide
# weights, so that a pair read in the wrong order shows.
GPTJ = dict(vocab_size=60, n_embd=64, n_layer=2, n_head=4, n_positions=32, n_inner=96, rotary_dim=8, **WIDE)


def _gptj(cls, head, variant="", **config):
    return Case(cls, lambda: tf.GPTJConfig(**{**GPTJ, **config}), head, "gptj", True, variant)


# BART: stacks of unequal depth and heads, FFNs of unequal width, so that no group of one stack can
# pass for the other's; eos ends every example (its classifier reads the last one).
BART = dict(vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=2,
            encoder_ffn_dim=48, decoder_ffn_dim=40, max_position_embeddings=20)


def _bart(cls, head, variant="", **config):
    return Case(cls, lambda: tf.BartConfig(**{**BART, **config}), head, "bart", True, variant)


# T5 at few buckets and a short max distance, so that 9 tokens meet the logarithmic buckets; a head
# width (d_kv) apart from d_model / heads, as T5 allows.
T5 = dict(vocab_size=60, d_model=32, d_kv=6, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4, decoder_start_token_id=0,
          relative_attention_num_buckets=8, relative_attention_max_distance=6)


def _t5(cls, head, variant="", family="t5", **config):
    return Case(cls, lambda: getattr(tf, f"{cls[:cls.index('T5') + 2]}Config")(**{**T5, **config}), head, family, True, variant)


# Whisper: 8 mel bins over 20 frames (2 max_source_positions), BART's unequal stacks
WHISPER = dict(vocab_size=60, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=2,
               encoder_ffn_dim=48, decoder_ffn_dim=40, max_source_positions=10, max_target_positions=20, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, decoder_start_token_id=1)


def _whisper(cls, head, variant="", **config):
    return Case(cls, lambda: tf.WhisperConfig(**{**WHISPER, **config}), head, "whisper", True, variant)


def _mbart(cls, head, variant="", **config):
    return Case(cls, lambda: tf.MBartConfig(**{**BART, **config}), head, "mbart", True, variant)


# Marian: BART's stacks, fixed sinusoids, the model's small vocabulary's own ids (its defaults' are 58100)
MARIAN = dict(BART, pad_token_id=1, eos_token_id=2, decoder_start_token_id=1, scale_embedding=True)


def _marian(cls, head, variant="", **config):
    return Case(cls, lambda: tf.MarianConfig(**{**MARIAN, **config}), head, "marian", True, variant)


def _pegasus(cls, head, variant="", **config):
    return Case(cls, lambda: tf.PegasusConfig(**{**MARIAN, **config}), head, "pegasus", True, variant)


def _blenderbot(cls, head, variant="", **config):
    return Case(cls, lambda: tf.BlenderbotConfig(**{**MARIAN, **config}), head, "blenderbot", True, variant)


def _plbart(cls, head, variant="", **config):
    return Case(cls, lambda: tf.PLBartConfig(**{**BART, **config}), head, "plbart", True, variant)


def _m2m_100(cls, head, variant="", **config):
    return Case(cls, lambda: tf.M2M100Config(**{**MARIAN, **config}), head, "m2m_100", True, variant)


# StarCoder2 at head dim 16 with two kv groups; wide weights, so that a wrong scale or GELU shows.
STARCODER2 = dict(NEOX, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, **WIDE)


def _starcoder2(cls, head, variant="", **config):
    return Case(cls, lambda: tf.Starcoder2Config(**{**STARCODER2, **config}), head, "starcoder2", True, variant)


# Cohere at head dim 16: eight interleaved pairs a head, GQA; wide weights, so that a pair read in
# the wrong order shows.
COHERE = dict(NEOX, num_key_value_heads=2, eos_token_id=2, **WIDE)


def _cohere(cls, head, variant="", **config):
    return Case(cls, lambda: tf.CohereConfig(**{**COHERE, **config}), head, "cohere", True, variant)


# Helium and ERNIE 4.5: Llama's layers with interleaved RoPE pairs (reordered by the loader) at head dim 16 (ERNIE's
# also 8, its heads narrower than the stream); wide weights, so that a pair read in the wrong order shows
HELIUM = dict(NEOX, num_key_value_heads=2, head_dim=16, **WIDE)
ERNIE4_5 = dict(NEOX, num_key_value_heads=2, head_dim=8, **WIDE)


def _helium(cls, head, variant="", **config):
    return Case(cls, lambda: tf.HeliumConfig(**{**HELIUM, **config}), head, "helium", True, variant)


# Phi-3.5-MoE: 4 experts (sparsemixer's top 2), q/k/v/o and LM head biases, Phi-3.5-MoE's longrope (short factors, the
# long mscale past 6 positions: the test's 9 tokens meet it); wide weights, so that the router's
# masked softmaxes keep more than one expert and the experts' weights differ
PHIMOE = dict(TEXT, num_key_value_heads=2, num_local_experts=4, attention_bias=True, lm_head_bias=True, **WIDE)
PHIMOE_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.5, 2.0, 3.0], long_factor=[2.0, 3.0, 4.0, 5.0],
                       short_mscale=1.2, long_mscale=1.5, original_max_position_embeddings=6)


def _phimoe(cls, head, variant="", **config):
    return Case(cls, lambda: tf.PhimoeConfig(**{**PHIMOE, **config}), head, "phimoe", True, variant)


def _ernie4_5(cls, head, variant="", **config):
    return Case(cls, lambda: tf.Ernie4_5Config(**{**ERNIE4_5, **config}), head, "ernie4_5", True, variant)


# ERNIE 4.5 MoE: a dense layer, then mixtures of 4 experts (top 2) on every 2nd layer to the 4th, a shared expert; wide
# weights, so that the router's probabilities differ (tests/test_helium.py sets its correction bias, which save_reference leaves 0)
ERNIE4_5_MOE = dict(NEOX, num_hidden_layers=5, num_key_value_heads=2, moe_intermediate_size=16, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                    moe_layer_start_index=1, moe_layer_end_index=3, moe_layer_interval=2, **WIDE)


# HunYuan dense: Llama's layers with a per-head QK-norm after RoPE, at head dim 16 with GQA; wide weights (and perturbed
# norm gains, unequal within a rotary pair), so that the norm taken before RoPE, as Qwen3's, shows; the checkpoints'
# "dynamic" RoPE with a fixed alpha (a static base), so that a base read without it shows
HUNYUAN = dict(NEOX, num_key_value_heads=2, head_dim=16, **WIDE)
HUNYUAN_ALPHA = dict(rope_type="dynamic", rope_theta=10000.0, factor=1.0, alpha=1000.0)


def _hunyuan(cls, head, variant="", **config):
    return Case(cls, lambda: tf.HunYuanDenseV1Config(**{**HUNYUAN, **config}), head, "hunyuan_v1_dense", True, variant)


# HunYuan MoE: the dense record's attention, and on every layer 4 experts (top 2 in layer 0, top 1 in layer 1) and a shared MLP
HUNYUAN_MOE = dict(HUNYUAN, intermediate_size=24, num_experts=4, moe_topk=[2, 1])


def _hunyuan_moe(cls, head, variant="", **config):
    return Case(cls, lambda: tf.HunYuanMoEV1Config(**{**HUNYUAN_MOE, **config}), head, "hunyuan_v1_moe", True, variant)


def _ernie4_5_moe(cls, head, variant="", **config):
    return Case(cls, lambda: tf.Ernie4_5_MoeConfig(**{**ERNIE4_5_MOE, **config}), head, "ernie4_5_moe", True, variant)


# Cohere 2: four layers, sliding (window 3, with RoPE) and full (without) alternating
COHERE2 = {**{k: v for k, v in COHERE.items() if k != "initializer_range"}, "num_hidden_layers": 4, "sliding_window": 3,
           "layer_types": ["sliding_attention", "full_attention"] * 2}


def _cohere2(cls, head, variant="", **config):
    return Case(cls, lambda: tf.Cohere2Config(**{**COHERE2, **config}), head, "cohere2", True, variant)


# DeepSeek-V3: MLA (latent queries, or none; no-RoPE parts of 8 and RoPE parts of 4 per head), one dense layer then
# mixtures of 4 experts in 2 routing groups (a token reaches 1 group), a shared expert; wide weights, so the router's
# sigmoid scores differ
DEEPSEEK = dict(TEXT, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=12, q_lora_rank=10, qk_rope_head_dim=4, qk_nope_head_dim=8,
                v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
                first_k_dense_replace=1, n_shared_experts=1, pad_token_id=0, **WIDE)


def _deepseek(cls, head, variant="", **config):
    return Case(cls, lambda: tf.DeepseekV3Config(**{**DEEPSEEK, **config}), head, "deepseek_v3", True, variant)


DEEPSEEK_V2 = {**{k: v for k, v in DEEPSEEK.items() if k not in ("n_group", "topk_group")}, "topk_method": "greedy"}


def _deepseek_v2(cls, head, variant="", **config):
    return Case(cls, lambda: tf.DeepseekV2Config(**{**DEEPSEEK_V2, **config}), head, "deepseek_v2", True, variant)


# GLM-4.7-Flash: DeepSeek-V3's shapes, its layers placed by mlp_layer_types (sparse, dense, sparse), and value heads wider than
# the keys' no-RoPE part (12 and 8), as its checkpoint's are (256 and 192): V/O maps 12 wide beside Q/K's 8 (HeadGeometry.value_dim)
GLM4_MOE_LITE = {**{k: v for k, v in DEEPSEEK.items() if k != "first_k_dense_replace"}, "v_head_dim": 12,
                 "mlp_layer_types": ["sparse", "dense", "sparse"]}


def _glm4_moe_lite(cls, head, variant="", **config):
    return Case(cls, lambda: tf.Glm4MoeLiteConfig(**{**GLM4_MOE_LITE, **config}), head, "glm4_moe_lite", True, variant)


# MiniCPM3: DeepSeek-V3's MLA shapes (rotate_half RoPE), a dense MLP in every layer, its three scalars none of them 1 (the LM's
# input divided by 32 / 8 = 4); LongRoPE as MiniCPM3-4B's, its original context 6 tokens, so that the 9-token batch takes the
# long factors (and the attention factor of 20 / 6); wide weights, so that a pair read in the wrong order shows
MINICPM3_ROPE = dict(rope_type="longrope", rope_theta=100.0, short_factor=[1.0, 1.5], long_factor=[2.0, 3.0], original_max_position_embeddings=6)
MINICPM3 = dict(TEXT, num_key_value_heads=4, kv_lora_rank=12, q_lora_rank=10, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                scale_emb=2.5, scale_depth=1.4, dim_model_base=8, rope_parameters=MINICPM3_ROPE, pad_token_id=0, **WIDE)


def _minicpm3(cls, head, variant="", **config):
    return Case(cls, lambda: tf.MiniCPM3Config(**{**MINICPM3, **config}), head, "minicpm3", True, variant)


# GLM-4-MoE: Llama's attention (head dim 16, RoPE on half of it, 2 kv groups), DeepSeek-V3's mixture
GLM4_MOE = dict(TEXT, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, moe_intermediate_size=16, n_routed_experts=4, n_group=2,
                topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, pad_token_id=0, **WIDE)


def _glm4_moe(cls, head, variant="", **config):
    return Case(cls, lambda: tf.Glm4MoeConfig(**{**GLM4_MOE, **config}), head, "glm4_moe", True, variant)


# AFMoE: 2 kv groups of heads 8 wide, a dense layer then 2 mixtures of 4 experts (2 picked) with a shared expert;
# layers sliding (RoPE, a window of 3), full (no RoPE), sliding; wide weights, so the router's sigmoid scores differ
AFMOE = dict(TEXT, num_hidden_layers=3, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
             num_shared_experts=1, num_dense_layers=1, global_attn_every_n_layers=2, sliding_window=3, pad_token_id=0, **WIDE)


# EXAONE MoE: sliding layers 0 and 2 (window 3, RoPE), full layers 1 and 3 (no RoPE); a dense first layer, then
# DeepSeek-V3's mixture over 2 groups of 2 experts
EXAONE_MOE = dict(TEXT, num_hidden_layers=4, num_key_value_heads=2, sliding_window=3, sliding_window_pattern=2, moe_intermediate_size=16,
                  num_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, num_shared_experts=1, **WIDE)


def _exaone_moe(cls, head, variant="", **config):
    return Case(cls, lambda: tf.ExaoneMoeConfig(**{**EXAONE_MOE, **config}), head, "exaone_moe", True, variant)


# GPT-OSS: 2 kv groups of heads 8 wide with sinks, a sliding layer (window 3) then a full one, 4 experts (2 a token); YaRN
# over a short original context (16 positions, theta 100), so that its ramp and factor show on 9 tokens; wide weights
GPT_OSS_YARN = dict(rope_type="yarn", factor=4.0, beta_fast=8.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=16, rope_theta=100.0)
GPT_OSS = dict(TEXT, num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
               rope_parameters=GPT_OSS_YARN, **WIDE)


def _gpt_oss(cls, head, variant="", **config):
    return Case(cls, lambda: tf.GptOssConfig(**{**GPT_OSS, **config}), head, "gpt_oss", True, variant)


# dots.llm1: Qwen3's attention (QK-norm, q/k/v/o biases) with layer 2 sliding (window 3, from max_window_layers), a dense
# first layer, then DeepSeek-V3's mixture over 2 groups of 2 experts and a shared expert
DOTS1 = dict(TEXT, num_hidden_layers=3, num_key_value_heads=2, sliding_window=3, max_window_layers=2, moe_intermediate_size=16, n_routed_experts=4,
             n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, pad_token_id=0, **WIDE)


def _dots1(cls, head, variant="", **config):
    return Case(cls, lambda: tf.Dots1Config(**{**DOTS1, **config}), head, "dots1", True, variant)


def _afmoe(cls, head, variant="", **config):
    return Case(cls, lambda: tf.AfmoeConfig(**{**AFMOE, **config}), head, "afmoe", True, variant)


# Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: a Gated DeltaNet layer (2 key heads of 8, each serving 2 value heads of 8; 3 taps) then
# gated attention (2 kv groups of 16-wide heads, RoPE on a quarter of each: 2 pairs, a zero-centred QK-norm); wide weights
QWEN3_NEXT = dict(TEXT, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_key_head_dim=8, linear_num_value_heads=4,
                  linear_value_head_dim=8, linear_conv_kernel_dim=3, layer_types=["linear_attention", "full_attention"], pad_token_id=0, **WIDE)
# the mixtures: 4 experts (2 a token) 16 wide beside a shared expert 24 wide
QWEN3_NEXT_MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2)


def _qwen3_next(cls, config_cls, head, variant="", **config):
    moe = QWEN3_NEXT_MOE if config_cls != "Qwen3_5TextConfig" else {}
    return Case(cls, lambda: getattr(tf, config_cls)(**{**QWEN3_NEXT, **moe, **config}), head, "qwen3_next", True, variant)


# MiniMax: layers of softmax attention (0, 2) and lightning attention (1; blocks of 4 tokens, so that a batch crosses blocks),
# a mixture of 4 experts (2 a token) in each; the residual scalars none of them 1 where a misplaced one would show
MINIMAX = dict(TEXT, num_hidden_layers=3, num_key_value_heads=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
               block_size=4, full_attn_alpha_factor=1.5, linear_attn_beta_factor=0.7, mlp_alpha_factor=0.9, mlp_beta_factor=1.3, **WIDE)


def _minimax(cls, head, variant="", **config):
    return Case(cls, lambda: tf.MiniMaxConfig(**{**MINIMAX, **config}), head, "minimax", True, variant)


# Llama 4's text model: layer 0 RoPE (interleaved pairs, chunks of 4 tokens, the L2 QK-norm) with a dense MLP, layer 1
# NoPE (temperature tuned from position 1 on) with 4 experts (2 a token) and a shared expert; wide weights, so that a
# pair read in the wrong order shows
LLAMA4 = dict(TEXT, num_key_value_heads=2, head_dim=8, intermediate_size=16, intermediate_size_mlp=48, num_local_experts=4,
              num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=2,
              attn_scale=0.5, pad_token_id=0, **WIDE)


def _llama4(cls, head, variant="", **config):
    return Case(cls, lambda: tf.Llama4TextConfig(**{**LLAMA4, **config}), head, "llama4_text", True, variant)


# CLIP's image tower: 16 x 16 RGB images of 4 x 4 patches (17 positions), the projection narrower than the model
CLIP_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4, num_channels=3,
                   projection_dim=24)


CLIP_TEXT = dict(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=20,
                 projection_dim=24, pad_token_id=0, bos_token_id=1)

# Vision-language models: a tiny vision tower (8x8 images, 2x2 patches) feeding 4 image tokens (id 5) of the text model.
IMAGE_TOKEN = 5
SIGLIP = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=2, num_channels=3)
PIXTRAL = dict(SIGLIP, model_type="pixtral", head_dim=8)


def _gemma3_vlm(variant="", vision=(), **text):
    config = lambda: tf.Gemma3Config(  # noqa: E731
        text_config=dict(TEXT, num_key_value_heads=2, head_dim=16, sliding_window=3, sliding_window_pattern=2, **text),
        vision_config=dict(SIGLIP, **dict(vision)), mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=3, eoi_token_index=4)
    return Case("Gemma3ForConditionalGeneration", config, "lm", "gemma3_vlm", False, variant)


def _mistral3(variant="", tie=False, bias=False, **text):
    config = lambda: tf.Mistral3Config(  # noqa: E731
        text_config=dict(TEXT, model_type="mistral", num_key_value_heads=2, head_dim=8, sliding_window=None, **text), vision_config=dict(PIXTRAL),
        image_token_index=IMAGE_TOKEN, spatial_merge_size=2, tie_word_embeddings=tie, multimodal_projector_bias=bias)
    return Case("Mistral3ForConditionalGeneration", config, "lm", "mistral3", False, variant)


# Llama 4: its vision model at 8x8 images of 2x2 patches, pixel-shuffled to 4 tokens an image, before Llama 4's text model
LLAMA4_VISION = dict(hidden_size=16, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=2, num_channels=3,
                     vision_output_dim=20, projector_input_dim=20, projector_output_dim=20, pixel_shuffle_ratio=0.5)


def _llama4_vlm(variant="", tie=False, **text):
    config = lambda: tf.Llama4Config(  # noqa: E731
        text_config=dict(LLAMA4, **text), vision_config=dict(LLAMA4_VISION), image_token_index=IMAGE_TOKEN, boi_token_index=3, eoi_token_index=4,
        tie_word_embeddings=tie)
    return Case("Llama4ForConditionalGeneration", config, "lm", "llama4", False, variant)


# Qwen2-VL and 2.5-VL: multimodal RoPE over head_dim 8 (sections: 2 pairs by time, 1 by height, 1 by width)
MROPE = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}
QWEN_VISION = dict(depth=2, num_heads=2, patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)


# Qwen3-VL: interleaved multimodal RoPE over head_dim 16 (8 pairs: 4 by time, 2 by height, 2 by width, interleaved), a vision
# transformer with learned positions (a 4 x 4 grid resampled) and DeepStack mergers after its blocks 0 and 1
MROPE_INTERLEAVED = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True, "rope_theta": 10000.0}
QWEN3_VISION = dict(QWEN_VISION, hidden_size=16, intermediate_size=24, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])


def _qwen_vl(cls, config_cls, family, vision, variant="", tie=False, rope=MROPE, **text):
    config = lambda: getattr(tf, config_cls)(  # noqa: E731
        text_config=dict(TEXT, num_key_value_heads=2, rope_parameters=dict(rope), bos_token_id=1, eos_token_id=2, **text),
        vision_config=dict(QWEN_VISION, **vision), image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 1, vision_start_token_id=IMAGE_TOKEN + 2,
        vision_end_token_id=IMAGE_TOKEN + 3, tie_word_embeddings=tie)
    return Case(cls, config, "lm", family, False, variant)



# SigLIP's image tower: 16 x 16 RGB images of 4 x 4 patches (16 positions, no class token), wide weights so that the pooling
# head's attention is not near uniform; its text tower at CLIP's text shapes, its head narrower than the model
SIGLIP_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4, num_channels=3)
SIGLIP_TEXT = dict(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=20,
                   pad_token_id=0)


# Mamba: 64 channels of 4 states, a rank-2 time step, 3 taps; wide weights, so that every channel's scan shows
MAMBA = dict(vocab_size=60, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=3, pad_token_id=0, initializer_range=0.2)


def _mamba(cls, head, variant="", **config):
    return Case(cls, lambda: tf.MambaConfig(**{**MAMBA, **config}), head, "mamba", True, variant)


# Mamba-2: 4 heads of 16 channels (64 = 2 x 32) in 2 groups of B/C with 4 state entries, 3 taps; wide
# weights. Granite-4's hybrid: a mixer (8 heads of 8, one group: the state group too) then attention,
# each with a shared MLP beside 4 experts, Granite's four multipliers.
MAMBA2 = dict(vocab_size=60, hidden_size=32, num_heads=4, head_dim=16, n_groups=2, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=3,
              chunk_size=4, pad_token_id=0, initializer_range=0.2)
GRANITE_HYBRID = dict(TEXT, num_key_value_heads=2, intermediate_size=16, shared_intermediate_size=24, num_local_experts=4,
                      num_experts_per_tok=2, layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_state=4, mamba_n_groups=1,
                      mamba_d_conv=3, mamba_chunk_size=4, pad_token_id=0, **GRANITE)


def _mamba2(cls, head, variant="", **config):
    return Case(cls, lambda: tf.Mamba2Config(**{**MAMBA2, **config}), head, "mamba2", True, variant)


def _granite_hybrid(cls, head, variant="", **config):
    return Case(cls, lambda: tf.GraniteMoeHybridConfig(**{**GRANITE_HYBRID, **config}), head, "granitemoehybrid", True, variant)


# Granite 3's mixtures: attention (2 kv heads of 4) then 4 experts, top 2, Granite's four multipliers;
# GraniteMoeShared's shared MLP at another width than the experts'.
GRANITE_MOE = dict(TEXT, num_key_value_heads=2, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, **GRANITE)


def _granite_moe(cls, head, variant="", config_cls="GraniteMoeConfig", **config):
    return Case(cls, lambda: getattr(tf, config_cls)(**{**GRANITE_MOE, **config}), head, "granitemoe", True, variant)


# Falcon at head dim 16, the new architecture's grouped kv heads by default (2 groups of 2 queries:
# a fused row read in the wrong group or slot shows); wide weights, exact GELU.
FALCON = dict(vocab_size=60, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=96, max_position_embeddings=32,
              new_decoder_architecture=True, num_kv_heads=2, bos_token_id=1, eos_token_id=2, **WIDE)


def _falcon(cls, head, variant="", **config):
    return Case(cls, lambda: tf.FalconConfig(**{**FALCON, **config}), head, "falcon", True, variant)


# GPTBigCode at head dim 16, multi-query by default; wide weights, so that a fused c_attn row read
# as the wrong head's or slot's shows.
GPT_BIGCODE = dict(vocab_size=60, n_embd=64, n_layer=2, n_head=4, n_positions=20, bos_token_id=1, eos_token_id=2, **WIDE)


def _gpt_bigcode(cls, head, variant="", **config):
    return Case(cls, lambda: tf.GPTBigCodeConfig(**{**GPT_BIGCODE, **config}), head, "gpt_bigcode", True, variant)


def _distilbert(cls, head, **config):
    return Case(cls, lambda: tf.DistilBertConfig(**DISTILBERT, **config), head, "distilbert", head != "multiple_choice")


# DeBERTa-v3's attention (relative positions in buckets, projected by the tokens' own key and query
# projections, normed) and DeBERTa-v2's (its own pos_key_proj and pos_query_proj, absolute positions
# and token types too); wide weights, so that a position term that did not move with its head shows.
DEBERTA_V3 = dict(relative_attention=True, share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False, position_buckets=8,
                  norm_rel_ebd="layer_norm", max_relative_positions=16, **WIDE)
DEBERTA_V2 = dict(relative_attention=True, share_att_key=False, pos_att_type="c2p|p2c", type_vocab_size=2, max_relative_positions=8, **WIDE)


def _deberta(cls, head, variant="", v2=False, **config):
    return Case(cls, lambda: tf.DebertaV2Config(**TEXT, **{**(DEBERTA_V2 if v2 else DEBERTA_V3), **config}), head, "deberta",
                head != "multiple_choice", variant)


def _modernbert(cls, head, **config):
    return Case(cls, lambda: tf.ModernBertConfig(**MODERNBERT, **config), head, "modernbert", head != "multiple_choice")


# OPT at head dim 16: pre-norm (the LM), OPT-350m's post-norm with the word-embedding projections
# (the base model); wide weights, so that a norm in the wrong place or a position off by its offset shows
OPT = dict(vocab_size=60, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96, max_position_embeddings=20, pad_token_id=1,
           bos_token_id=2, eos_token_id=2, init_std=0.2)


def _opt(cls, head, variant="", **config):
    return Case(cls, lambda: tf.OPTConfig(**{**OPT, **config}), head, "opt", True, variant)


# GPT-Neo: global and local layers (a window of 3 tokens, shorter than the batch's 9), wide weights (its scores are not scaled)
GPT_NEO = dict(vocab_size=60, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96, max_position_embeddings=20,
               attention_types=[[["global", "local"], 1]], window_size=3, pad_token_id=0, bos_token_id=1, eos_token_id=2, **WIDE)


def _gpt_neo(cls, head, variant="", **config):
    return Case(cls, lambda: tf.GPTNeoConfig(**{**GPT_NEO, **config}), head, "gpt_neo", True, variant)


# BLOOM: 6 heads (ALiBi's slopes past the largest power of two), head dim 16, wide weights
BLOOM = dict(vocab_size=60, hidden_size=96, n_layer=2, n_head=6, pad_token_id=0, bos_token_id=1, eos_token_id=2, **WIDE)


def _bloom(cls, head, variant="", **config):
    return Case(cls, lambda: tf.BloomConfig(**{**BLOOM, **config}), head, "bloom", True, variant)


# DINOv2: layer scales away from 1 (a scale read on the wrong channel or sublayer shows), an 8x8 grid of 2x2 patches
DINOV2 = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=2, num_channels=3, mlp_ratio=2, layerscale_value=0.5, **WIDE)


def _dinov2(cls, head, variant="", **config):
    return Case(cls, lambda: tf.Dinov2Config(**{**DINOV2, **config}), head, "dinov2", True, variant)



def _dinov2_registers(cls, head, variant="", **config):
    base = {k: v for k, v in DINOV2.items() if k != "use_mask_token"}
    return Case(cls, lambda: tf.Dinov2WithRegistersConfig(**{**base, "num_register_tokens": 3, **config}), head, "dinov2_with_registers", True, variant)



# DeBERTa v1: relative attention with its own c2p and p2c projections (the checkpoints' setting), wide weights
DEBERTA_V1 = dict(relative_attention=True, pos_att_type="c2p|p2c", max_relative_positions=8, **WIDE)


def _deberta_v1(cls, head, variant="", **config):
    return Case(cls, lambda: tf.DebertaConfig(**TEXT, **{**DEBERTA_V1, **config}), head, "deberta_v1", True, variant)


CASES = [
    # BERT and RoBERTa: every head, bare models with and without a pooler
    _bert("BertModel", None),
    _bert("BertForMaskedLM", "masked_lm"),
    _bert("BertForPreTraining", "pretraining", runs=False),
    _bert("BertForNextSentencePrediction", "next_sentence"),
    _bert("BertForSequenceClassification", "sequence_classification", num_labels=3),
    _bert("BertForMultipleChoice", "multiple_choice", runs=False),
    _bert("BertForTokenClassification", "token_classification", num_labels=5),
    _bert("BertForQuestionAnswering", "question_answering"),
    _bert("BertLMHeadModel", "lm", runs=False, is_decoder=True),
    _roberta("RobertaModel", None, variant="no-pooler", kwargs=(("add_pooling_layer", False),)),
    _roberta("RobertaForMaskedLM", "masked_lm", tie_word_embeddings=False),  # an untied decoder
    _roberta("RobertaForCausalLM", "lm", runs=False, is_decoder=True),
    _roberta("RobertaForSequenceClassification", "sequence_classification", num_labels=3),
    _roberta("RobertaForMultipleChoice", "multiple_choice", runs=False),
    _roberta("RobertaForTokenClassification", "token_classification", num_labels=5),
    _roberta("RobertaForQuestionAnswering", "question_answering"),
    _alias("XLMRobertaModel", "XLMRobertaConfig", None),
    _alias("XLMRobertaModel", "XLMRobertaConfig", None, variant="no-pooler", kwargs=(("add_pooling_layer", False),)),
    _alias("XLMRobertaForSequenceClassification", "XLMRobertaConfig", "sequence_classification", num_labels=3),
    _alias("CamembertModel", "CamembertConfig", None),
    _alias("CamembertModel", "CamembertConfig", None, variant="no-pooler", kwargs=(("add_pooling_layer", False),)),
    _alias("CamembertForSequenceClassification", "CamembertConfig", "sequence_classification", num_labels=3),
    # GPT-2: the fused c_attn, a tied LM head; GELU variants and attention scales at larger weights
    _gpt2("GPT2Model", None),
    _gpt2("GPT2LMHeadModel", "lm"),
    _gpt2("GPT2LMHeadModel", "lm", variant="inverse-layer-scale-gelu", **WIDE, scale_attn_by_inverse_layer_idx=True,
          activation_function="gelu", n_inner=40),
    _gpt2("GPT2Model", None, variant="unscaled-relu", **WIDE, scale_attn_weights=False, activation_function="relu", layer_norm_epsilon=1e-3),
    _gpt2("GPT2DoubleHeadsModel", "double_heads", runs=False),
    _gpt2("GPT2ForSequenceClassification", "sequence_classification", num_labels=3),
    _gpt2("GPT2ForTokenClassification", "token_classification", num_labels=5),
    _gpt2("GPT2ForQuestionAnswering", "question_answering"),
    # GPTBigCode (StarCoder 1, SantaCoder): GPT-2's layer, nn.Linear projections, c_attn fused per kv head (multi-query or multi-head)
    _gpt_bigcode("GPTBigCodeModel", None),
    _gpt_bigcode("GPTBigCodeForCausalLM", "lm", multi_query=False, tie_word_embeddings=False),
    _gpt_bigcode("GPTBigCodeForCausalLM", "lm", variant="tied-mqa-unscaled", scale_attn_weights=False, initializer_range=0.05),
    _gpt_bigcode("GPTBigCodeForSequenceClassification", "sequence_classification", num_labels=3, pad_token_id=0),
    _gpt_bigcode("GPTBigCodeForTokenClassification", "token_classification", num_labels=5, multi_query=False, n_inner=96),
    # GPT-NeoX (Pythia): parallel and sequential residual, partial and full rotary, tied and untied
    _decoder("GPTNeoXModel", "GPTNeoXConfig", None, "gpt_neox", base=NEOX, rotary_pct=0.25, rope_parameters={"rope_theta": 500.0}),
    _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", "lm", "gpt_neox", base=NEOX, rotary_pct=0.25, pad_token_id=0),
    _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", "lm", "gpt_neox", "sequential-full-rotary", base=NEOX, rotary_pct=1.0,
             use_parallel_residual=False),
    _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", "lm", "gpt_neox", "tied-no-bias", base=NEOX, rotary_pct=0.5, tie_word_embeddings=True,
             attention_bias=False),
    _decoder("GPTNeoXForSequenceClassification", "GPTNeoXConfig", "sequence_classification", "gpt_neox", num_labels=3, pad_token_id=0,
             use_parallel_residual=False),
    _decoder("GPTNeoXForTokenClassification", "GPTNeoXConfig", "token_classification", "gpt_neox", num_labels=5),
    _decoder("GPTNeoXForQuestionAnswering", "GPTNeoXConfig", "question_answering", "gpt_neox"),
    # Phi (Phi-2): one LayerNorm read by a parallel attention and MLP, partial rotary, biases, an LM head with a bias
    _decoder("PhiModel", "PhiConfig", None, "phi", base=NEOX, num_key_value_heads=2),
    _decoder("PhiForCausalLM", "PhiConfig", "lm", "phi", base=NEOX, partial_rotary_factor=0.25, pad_token_id=0),
    _decoder("PhiForCausalLM", "PhiConfig", "lm", "phi", "gqa-linear-rope", base=NEOX, num_key_value_heads=2,
             rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=2.0, partial_rotary_factor=0.5), hidden_act="gelu"),
    _decoder("PhiForCausalLM", "PhiConfig", "lm", "phi", "tied", base=NEOX, tie_word_embeddings=True),
    _decoder("PhiForSequenceClassification", "PhiConfig", "sequence_classification", "phi", base=NEOX, num_labels=3, pad_token_id=0),
    _decoder("PhiForTokenClassification", "PhiConfig", "token_classification", "phi", base=NEOX, num_labels=5),
    # StableLM: LayerNorms, partial rotary, SwiGLU; sequential (two norms) or parallel (one), q/k/v biases optional
    _decoder("StableLmModel", "StableLmConfig", None, "stablelm", base=NEOX, num_key_value_heads=2, use_qkv_bias=True),
    _decoder("StableLmForCausalLM", "StableLmConfig", "lm", "stablelm", base=NEOX, num_key_value_heads=4, pad_token_id=0),
    _decoder("StableLmForCausalLM", "StableLmConfig", "lm", "stablelm", "parallel-tied", base=NEOX, num_key_value_heads=2, use_qkv_bias=True,
             use_parallel_residual=True, tie_word_embeddings=True, partial_rotary_factor=0.5),
    _decoder("StableLmForSequenceClassification", "StableLmConfig", "sequence_classification", "stablelm", base=NEOX, num_key_value_heads=2,
             use_parallel_residual=True, num_labels=3, pad_token_id=0),
    _decoder("StableLmForTokenClassification", "StableLmConfig", "token_classification", "stablelm", base=NEOX, num_key_value_heads=2, num_labels=5),
    # Nemotron: LayerNorms with a bias and gains 1 + w, partial rotary (half a head by default), an MLP without a gate (relu2),
    # biases on q/k/v/o with attention_bias and on up/down with mlp_bias, head_dim apart from d / H
    _decoder("NemotronForCausalLM", "NemotronConfig", "lm", "nemotron", base=NEOX, num_key_value_heads=2, pad_token_id=0, **WIDE),
    _decoder("NemotronModel", "NemotronConfig", None, "nemotron", base=NEOX, num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    _decoder("NemotronForCausalLM", "NemotronConfig", "lm", "nemotron", "tied-biases-quarter-rotary-head-dim", base=NEOX, num_key_value_heads=1,
             head_dim=8, tie_word_embeddings=True, attention_bias=True, mlp_bias=True, partial_rotary_factor=0.25, hidden_act="gelu", **WIDE),
    _decoder("NemotronForSequenceClassification", "NemotronConfig", "sequence_classification", "nemotron", base=NEOX, num_key_value_heads=2,
             num_labels=3, pad_token_id=0),
    _decoder("NemotronForTokenClassification", "NemotronConfig", "token_classification", "nemotron", base=NEOX, num_key_value_heads=2, num_labels=5),
    _decoder("NemotronForQuestionAnswering", "NemotronConfig", "question_answering", "nemotron", base=NEOX, num_key_value_heads=2, mlp_bias=True),
    # Jais 2: Llama's attention and whole-head RoPE (biases on q/k/v/o by default), LayerNorms with biases, Nemotron's ungated relu2 MLP
    # with biases by default; its one head the LM
    _decoder("Jais2ForCausalLM", "Jais2Config", "lm", "jais2", base=NEOX, num_key_value_heads=2, pad_token_id=0, **WIDE),
    _decoder("Jais2Model", "Jais2Config", None, "jais2", base=NEOX, attention_bias=False, mlp_bias=False),
    _decoder("Jais2ForCausalLM", "Jais2Config", "lm", "jais2", "tied-mqa-head-dim-linear-rope", base=NEOX, num_key_value_heads=1, head_dim=8,
             tie_word_embeddings=True, hidden_act="gelu", rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=2.0), **WIDE),
    # StarCoder2: LayerNorms, GQA, whole-head RoPE, a GELU MLP, biases with use_bias, a window over every layer, tied by default
    _starcoder2("Starcoder2Model", None, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    _starcoder2("Starcoder2ForCausalLM", "lm", tie_word_embeddings=False, sliding_window=3, pad_token_id=0),
    _starcoder2("Starcoder2ForCausalLM", "lm", variant="tied-no-bias-mqa", use_bias=False, num_key_value_heads=1, hidden_act="gelu"),
    _starcoder2("Starcoder2ForCausalLM", "lm", variant="linear-rope-mha", num_key_value_heads=4,
                rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=2.0)),
    _starcoder2("Starcoder2ForSequenceClassification", "sequence_classification", num_labels=3, pad_token_id=0, sliding_window=4),
    _starcoder2("Starcoder2ForTokenClassification", "token_classification", num_labels=5, use_bias=False),
    # Cohere: one LayerNorm without bias read by a parallel attention and SwiGLU MLP, interleaved RoPE, logits scaled, tied by default
    _cohere("CohereModel", None, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    _cohere("CohereForCausalLM", "lm", tie_word_embeddings=False, attention_bias=True, logit_scale=0.5),
    # Cohere 2: Cohere's layers, sliding ones with RoPE and full ones without
    _cohere2("Cohere2Model", None, attention_bias=True),
    _cohere2("Cohere2ForCausalLM", "lm", tie_word_embeddings=False, logit_scale=0.5),
    _cohere2("Cohere2ForCausalLM", "lm", variant="tied-pattern", layer_types=None, sliding_window_pattern=3, attention_bias=True),
    _cohere("CohereForCausalLM", "lm", variant="tied-mqa", num_key_value_heads=1, rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
    # Helium: interleaved RoPE, q/k/v biases (none on o_proj) and MLP biases, untied by default; ERNIE 4.5: interleaved RoPE,
    # a bias on every projection with use_bias, tied by default, head_dim apart from hidden_size / heads or null
    _helium("HeliumForCausalLM", "lm", attention_bias=True, mlp_bias=True),
    _helium("HeliumForCausalLM", "lm", variant="tied-mqa-linear-rope", tie_word_embeddings=True, num_key_value_heads=1,
            rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
    _helium("HeliumForSequenceClassification", "sequence_classification", num_labels=3, pad_token_id=0),
    _helium("HeliumForTokenClassification", "token_classification", num_labels=5, attention_bias=True),
    _ernie4_5("Ernie4_5ForCausalLM", "lm", use_bias=True),
    _ernie4_5("Ernie4_5ForCausalLM", "lm", variant="untied-mha-head-dim-null", tie_word_embeddings=False, num_key_value_heads=None, head_dim=None,
              rope_parameters=dict(rope_type="default", rope_theta=500.0)),
    _ernie4_5("Ernie4_5Model", None, use_bias=True, num_key_value_heads=1),
    # ERNIE 4.5 MoE: ERNIE 4.5's attention, dense MLPs and mixtures (softmax router with a correction bias, shared experts), an LM head
    # with a bias under use_bias (tied: the embedding's kernel and its own bias)
    _ernie4_5_moe("Ernie4_5_MoeForCausalLM", "lm", use_bias=True, head_dim=8),
    _ernie4_5_moe("Ernie4_5_MoeForCausalLM", "lm", variant="untied-no-shared-every-layer", tie_word_embeddings=False, use_bias=True,
                  moe_num_shared_experts=0, moe_layer_start_index=0, moe_layer_end_index=-1, moe_layer_interval=1, moe_k=1),
    _ernie4_5_moe("Ernie4_5_MoeModel", None, num_key_value_heads=1),
    # HunYuan dense: the per-head QK-norm after RoPE, q/k/v/o biases with attention_bias, untied by default, NTK-alpha RoPE
    _hunyuan("HunYuanDenseV1ForCausalLM", "lm", attention_bias=True, rope_parameters=HUNYUAN_ALPHA),
    _hunyuan("HunYuanDenseV1ForCausalLM", "lm", variant="tied-mha-linear-rope", tie_word_embeddings=True, num_key_value_heads=4,
             rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
    _hunyuan("HunYuanDenseV1ForSequenceClassification", "sequence_classification", num_labels=3, pad_token_id=0, rope_parameters=HUNYUAN_ALPHA),
    # Tencent's `use_qk_norm: false`, a key transformers 5 does not read: the head norm runs all the same (tests/test_hunyuan.py)
    _hunyuan("HunYuanDenseV1ForCausalLM", "lm", variant="use-qk-norm-false", use_qk_norm=False),
    _hunyuan("HunYuanDenseV1Model", None, attention_bias=True, num_key_value_heads=1),
    # HunYuan MoE: HunYuan dense's attention, a softmax-routed mixture (top k per layer) and a shared MLP on every layer
    _hunyuan_moe("HunYuanMoEV1ForCausalLM", "lm", attention_bias=True, rope_parameters=HUNYUAN_ALPHA),
    _hunyuan_moe("HunYuanMoEV1ForSequenceClassification", "sequence_classification", num_labels=3, pad_token_id=0, moe_topk=2),
    _hunyuan_moe("HunYuanMoEV1Model", None, num_key_value_heads=1),
    _hunyuan_moe("HunYuanMoEV1ForCausalLM", "lm", variant="tied-mha-top-1", tie_word_embeddings=True, num_key_value_heads=4, moe_topk=1),
    # Falcon: fused query_key_value grouped by kv head (new architecture: ln_attn and ln_mlp, or one norm), Falcon-7B's
    # multi-query parallel layer, a sequential multi-head one; biases with `bias`, LM head tied by default
    # GLM-4-MoE: grouped-query attention with partial RoPE and q/k/v biases, DeepSeek-V3's group-limited mixture
    _glm4_moe("Glm4MoeModel", None, attention_bias=True),
    _glm4_moe("Glm4MoeForCausalLM", "lm", use_qk_norm=True),
    _glm4_moe("Glm4MoeForCausalLM", "lm", variant="ungrouped-full-rotary", n_group=1, topk_group=1, partial_rotary_factor=1.0,
              norm_topk_prob=False, routed_scaling_factor=2.5),
    # EXAONE MoE: EXAONE 4's attention (QK-norm, RoPE on the sliding layers alone) in pre-norm layers, DeepSeek-V3's mixture
    _exaone_moe("ExaoneMoeForCausalLM", "lm"),
    _exaone_moe("ExaoneMoeModel", None, mlp_layer_types=["dense", "sparse", "dense", "sparse"]),
    # every layer full (sliding_window_pattern 1): no RoPE in any, as transformers reads a set sliding_window
    _exaone_moe("ExaoneMoeForCausalLM", "lm", variant="all-full-ungrouped-tied", sliding_window_pattern=1, n_group=1, tie_word_embeddings=True,
                norm_topk_prob=False, num_shared_experts=2, routed_scaling_factor=1.5),
    # dots.llm1: Qwen3's attention (a sliding layer) in pre-norm layers, DeepSeek-V3's mixture
    _dots1("Dots1ForCausalLM", "lm", attention_bias=True),
    _dots1("Dots1Model", None),
    _dots1("Dots1ForCausalLM", "lm", variant="full-ungrouped-tied-head-dim", sliding_window=None, n_group=1, tie_word_embeddings=True,
           norm_topk_prob=True, n_shared_experts=2, routed_scaling_factor=1.5, num_key_value_heads=4, head_dim=16),
    # AFMoE: gated GQA with a per-head QK-norm, RoPE on the sliding layers alone, four norms a layer, a sigmoid-routed mixture
    _afmoe("AfmoeModel", None, attention_bias=True),
    _afmoe("AfmoeForCausalLM", "lm", mup_enabled=True, route_scale=2.0),
    _afmoe("AfmoeForCausalLM", "lm", variant="tied-all-full-two-shared", tie_word_embeddings=True, global_attn_every_n_layers=1, num_shared_experts=2,
           num_dense_layers=0),
    # Qwen3.5 (dense), Qwen3.5-MoE, Qwen3-Next (its layer 0 dense by mlp_only_layers, the layers past it mixtures)
    _qwen3_next("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", "lm"),
    _qwen3_next("Qwen3_5TextModel", "Qwen3_5TextConfig", None),
    _qwen3_next("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", "lm", variant="tied-interval-half-rotary", tie_word_embeddings=True, layer_types=None,
                num_hidden_layers=4, full_attention_interval=2, partial_rotary_factor=0.5, linear_num_value_heads=2),
    _qwen3_next("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", "lm"),
    _qwen3_next("Qwen3_5MoeTextModel", "Qwen3_5MoeTextConfig", None),
    _qwen3_next("Qwen3NextForCausalLM", "Qwen3NextConfig", "lm", num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                "linear_attention"], mlp_only_layers=[0]),
    _qwen3_next("Qwen3NextModel", "Qwen3NextConfig", None),
    # MiniMax: softmax and lightning attention layers, a Mixtral mixture in each, the stream itself normed
    _minimax("MiniMaxForCausalLM", "lm"),
    _minimax("MiniMaxModel", None),
    _minimax("MiniMaxForCausalLM", "lm", variant="tied-lightning-only", tie_word_embeddings=True, num_hidden_layers=2,
             layer_types=["linear_attention", "linear_attention"]),
    _qwen3_next("Qwen3NextForCausalLM", "Qwen3NextConfig", "lm", variant="step-2-unnormalized-tied", num_hidden_layers=4, layer_types=None,
                full_attention_interval=2, decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True),
    # Llama 4 (text); without the QK-norm (Maverick's) and tied, parity and a round trip
    _llama4("Llama4TextModel", None, attention_bias=True),
    _llama4("Llama4ForCausalLM", "lm"),
    _llama4("Llama4ForCausalLM", "lm", variant="no-qk-norm-tied", use_qk_norm=False, tie_word_embeddings=True),
    # Mamba: selective state-space mixers, no attention; the LM head tied by default
    _mamba("MambaModel", None, use_bias=True),
    _mamba("MambaForCausalLM", "lm"),
    _mamba("MambaForCausalLM", "lm", variant="untied-no-conv-bias-rank-3", tie_word_embeddings=False, use_conv_bias=False, time_step_rank=3),
    _mamba2("Mamba2Model", None, use_bias=True),
    _mamba2("Mamba2ForCausalLM", "lm", n_groups=1),  # one group of B/C: the state group too
    _granite_hybrid("GraniteMoeHybridModel", None, position_embedding_type="rope", attention_bias=True, mamba_proj_bias=True),
    _granite_hybrid("GraniteMoeHybridForCausalLM", "lm"),
    _granite_hybrid("GraniteMoeHybridForCausalLM", "lm", variant="dense-groups-tied", num_local_experts=0, mamba_n_groups=2,
                    tie_word_embeddings=True, layer_types=["attention", "mamba"]),
    # Granite 3.0/3.1 MoE, and the same with a shared MLP beside the experts (none where its width is 0)
    _granite_moe("GraniteMoeSharedForCausalLM", "lm", config_cls="GraniteMoeSharedConfig", shared_intermediate_size=24),  # planted: every group
    _granite_moe("GraniteMoeForCausalLM", "lm"),
    _granite_moe("GraniteMoeModel", None, attention_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0}),
    _granite_moe("GraniteMoeSharedForCausalLM", "lm", variant="no-shared-top-1-tied", config_cls="GraniteMoeSharedConfig",
                 num_experts_per_tok=1, tie_word_embeddings=True),
    # DeepSeek-V3: multi-head latent attention, group-limited routing with a correction bias, shared experts
    _deepseek("DeepseekV3Model", None),
    _deepseek("DeepseekV3ForCausalLM", "lm", q_lora_rank=None, attention_bias=True),
    _deepseek("DeepseekV3ForCausalLM", "lm", variant="ungrouped-rotate-half-unnormalised", rope_interleave=False, n_group=1, topk_group=1,
              norm_topk_prob=False, n_shared_experts=2, routed_scaling_factor=1.0, rope_parameters={"rope_type": "linear", "rope_theta": 100.0,
                                                                                                    "factor": 2.0}),
    _deepseek("DeepseekV3ForCausalLM", "lm", variant="yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "mscale": 0.707,
                                                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 6}),
    _deepseek("DeepseekV3ForSequenceClassification", "sequence_classification", num_labels=3),
    # DeepSeek-V2: V3's attention, a softmax router (greedy, or limited to the groups holding the best experts), MLP biases
    _deepseek_v2("DeepseekV2Model", None, mlp_bias=True),
    _deepseek_v2("DeepseekV2ForCausalLM", "lm", topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=1.5),
    _deepseek_v2("DeepseekV2ForCausalLM", "lm", variant="greedy-plain-queries", q_lora_rank=None, attention_bias=True),
    _deepseek_v2("DeepseekV2ForSequenceClassification", "sequence_classification", num_labels=3, mlp_bias=True),
    _deepseek("DeepseekV3ForTokenClassification", "token_classification", num_labels=5),
    # GLM-4.7-Flash: DeepSeek-V3's MLA and mixture placed by mlp_layer_types; its bare model with one head width, the LM as its
    # checkpoint (values wider than the keys' no-RoPE part: V/O maps of their own width), tied with plain queries and rotate_half RoPE
    _glm4_moe_lite("Glm4MoeLiteForCausalLM", "lm"),
    _glm4_moe_lite("Glm4MoeLiteModel", None, v_head_dim=8, mlp_layer_types=["dense", "sparse", "sparse"]),
    _glm4_moe_lite("Glm4MoeLiteForCausalLM", "lm", variant="tied-plain-queries-rotate-half", tie_word_embeddings=True, q_lora_rank=None,
                   rope_interleave=False, n_group=1, topk_group=1, attention_bias=True, norm_topk_prob=False),
    # MiniCPM3: MLA with a dense MLP and MiniCPM's scalars, its LM tied by default; biases; a short context (LongRoPE's short
    # factors), plain queries, untied, the scalars at their no-op fallbacks (None)
    _minicpm3("MiniCPM3ForCausalLM", "lm"),
    _minicpm3("MiniCPM3Model", None, attention_bias=True, mlp_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
    _minicpm3("MiniCPM3ForSequenceClassification", "sequence_classification", num_labels=3),
    _minicpm3("MiniCPM3ForCausalLM", "lm", variant="short-rope-plain-queries-untied-unscaled", q_lora_rank=None, tie_word_embeddings=False,
              scale_depth=None, dim_model_base=None, rope_parameters={**MINICPM3_ROPE, "original_max_position_embeddings": 16}),
    _falcon("FalconModel", None, bias=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    _falcon("FalconForCausalLM", "lm", tie_word_embeddings=False, bias=True),
    _falcon("FalconForCausalLM", "lm", variant="7b-mqa-parallel-tied", new_decoder_architecture=False, multi_query=True, num_kv_heads=None),
    _falcon("FalconForCausalLM", "lm", variant="sequential-mha", new_decoder_architecture=False, multi_query=False, parallel_attn=False,
            num_kv_heads=None, bias=True, tie_word_embeddings=False),
    _falcon("FalconForCausalLM", "lm", variant="one-norm-linear-rope", num_ln_in_parallel_attn=1, num_kv_heads=1,
            rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
    _falcon("FalconForSequenceClassification", "sequence_classification", num_labels=3, pad_token_id=0, new_decoder_architecture=False,
            multi_query=False, parallel_attn=False, num_kv_heads=None),
    _falcon("FalconForTokenClassification", "token_classification", num_labels=5, new_decoder_architecture=False, num_kv_heads=None),
    _falcon("FalconForQuestionAnswering", "question_answering", bias=True),
    # Llama and its kin: GQA, MQA, head_dim != d / H, RoPE scalings, biases, windows, tied heads
    # GLM and GLM-4: interleaved RoPE on half of each head, q/k/v biases, a fused gate_up_proj; GLM-4's sublayer outputs normed
    _decoder("GlmModel", "GlmConfig", None, "glm", num_key_value_heads=2, head_dim=16, pad_token_id=0),
    _decoder("GlmForCausalLM", "GlmConfig", "lm", "glm", num_key_value_heads=2, head_dim=16, pad_token_id=0, **WIDE),
    _decoder("GlmForSequenceClassification", "GlmConfig", "sequence_classification", "glm", head_dim=8, num_labels=3, pad_token_id=0,
             attention_bias=False, partial_rotary_factor=1.0),
    _decoder("Glm4Model", "Glm4Config", None, "glm4", num_key_value_heads=2, head_dim=16, pad_token_id=0),
    _decoder("Glm4ForCausalLM", "Glm4Config", "lm", "glm4", num_key_value_heads=2, head_dim=16, pad_token_id=0, **WIDE),
    _decoder("Glm4ForTokenClassification", "Glm4Config", "token_classification", "glm4", head_dim=8, num_labels=5, pad_token_id=0),
    # EXAONE 4: OLMo-2's post-norms with a per-head QK-norm; sliding layers with RoPE, every 2nd layer full attention without
    _decoder("Exaone4Model", "Exaone4Config", None, "exaone4", num_hidden_layers=4, num_key_value_heads=2, sliding_window=3, sliding_window_pattern=2),
    _decoder("Exaone4ForCausalLM", "Exaone4Config", "lm", "exaone4", num_hidden_layers=4, num_key_value_heads=2, sliding_window=3,
             sliding_window_pattern=2, pad_token_id=0, **WIDE),
    _decoder("Exaone4ForCausalLM", "Exaone4Config", "lm", "exaone4", variant="no-window-tied", num_key_value_heads=2, sliding_window=None, tie_word_embeddings=True,
             layer_types=["full_attention"] * 2),  # (without layer_types, Exaone4Config divides by the pattern, 0 without a window)
    _decoder("Exaone4ForSequenceClassification", "Exaone4Config", "sequence_classification", "exaone4", num_labels=3, pad_token_id=0,
             num_key_value_heads=4, sliding_window=3, sliding_window_pattern=2),
    _decoder("Exaone4ForQuestionAnswering", "Exaone4Config", "question_answering", "exaone4", num_key_value_heads=1, sliding_window=3,
             sliding_window_pattern=2),
    # Arcee: Llama's layers, an MLP without a gate (down(relu2(up(x)))), biases with attention_bias and mlp_bias
    _decoder("ArceeModel", "ArceeConfig", None, num_key_value_heads=2, mlp_bias=True),
    _decoder("ArceeForCausalLM", "ArceeConfig", "lm", num_key_value_heads=2, attention_bias=True, pad_token_id=0),
    _decoder("ArceeForSequenceClassification", "ArceeConfig", "sequence_classification", num_labels=3, pad_token_id=0),
    _decoder("ArceeForTokenClassification", "ArceeConfig", "token_classification", num_labels=5),
    _decoder("ArceeForQuestionAnswering", "ArceeConfig", "question_answering", num_key_value_heads=2),
    # EXAONE 3.0/3.5: Llama's classes (transformers runs it as LlamaForCausalLM) over LG's tensor names (a bare
    # LlamaModel of its config is saved under a mix of both, which no EXAONE checkpoint has: not read)
    _decoder("LlamaForCausalLM", "ExaoneConfig", "lm", "exaone", variant="exaone", num_key_value_heads=2, attention_bias=True, mlp_bias=True,
             eos_token_id=2),
    # LFM2: gated short convolutions (layers 0, 2) and attention with a per-head QK-norm (1, 3), an MLP width adjusted
    _decoder("Lfm2Model", "Lfm2Config", None, "lfm2", num_hidden_layers=4, num_key_value_heads=2, full_attn_idxs=[1, 3], conv_bias=True),
    _decoder("Lfm2ForCausalLM", "Lfm2Config", "lm", "lfm2", num_hidden_layers=4, num_key_value_heads=2, full_attn_idxs=[1, 3],
             tie_word_embeddings=False, block_multiple_of=8, block_ffn_dim_multiplier=1.5),
    # Apertus: its own norm names, a per-head QK-norm, an MLP without a gate and xIELU (two trained scalars a layer)
    _decoder("ApertusModel", "ApertusConfig", None, "apertus", num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
    _decoder("ApertusForCausalLM", "ApertusConfig", "lm", "apertus", num_key_value_heads=2, attention_bias=True, pad_token_id=0,
             rope_parameters=LLAMA3_ROPE),
    _decoder("ApertusForTokenClassification", "ApertusConfig", "token_classification", "apertus", num_labels=5, pad_token_id=0),
    _decoder("LlamaModel", "LlamaConfig", None, num_key_value_heads=2),
    _decoder("LlamaForCausalLM", "LlamaConfig", "lm", num_key_value_heads=2, pad_token_id=0),
    _decoder("LlamaForCausalLM", "LlamaConfig", "lm", variant="mha-untied"),
    _decoder("LlamaForCausalLM", "LlamaConfig", "lm", variant="gqa-tied", num_key_value_heads=2, tie_word_embeddings=True),
    _decoder("LlamaForCausalLM", "LlamaConfig", "lm", variant="mqa", num_key_value_heads=1),
    _decoder("LlamaForCausalLM", "LlamaConfig", "lm", variant="head-dim", num_key_value_heads=2, head_dim=16),  # q (32, 64), o (64, 32)
    _decoder("LlamaForCausalLM", "LlamaConfig", "lm", variant="llama3-rope", rope_parameters=dict(LLAMA3_ROPE)),
    _decoder("LlamaForCausalLM", "LlamaConfig", "lm", variant="linear-rope", rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=2.0)),
    _decoder("LlamaForCausalLM", "LlamaConfig", "lm", variant="biases", attention_bias=True, mlp_bias=True),
    _decoder("LlamaForSequenceClassification", "LlamaConfig", "sequence_classification", num_key_value_heads=2, num_labels=3, pad_token_id=0),
    _decoder("LlamaForTokenClassification", "LlamaConfig", "token_classification", num_key_value_heads=2, num_labels=5),
    _decoder("MistralForCausalLM", "MistralConfig", "lm", variant="window", num_key_value_heads=2, sliding_window=3),  # window 3 < 9 tokens
    _decoder("MistralForQuestionAnswering", "MistralConfig", "question_answering", num_key_value_heads=2),
    # layer 0 full attention, layer 1 windowed (layer_types from use_sliding_window / max_window_layers)
    _decoder("Qwen2ForCausalLM", "Qwen2Config", "lm", variant="window", num_key_value_heads=2, use_sliding_window=True, sliding_window=3,
             max_window_layers=1),
    _decoder("Qwen2ForCausalLM", "Qwen2Config", "lm", variant="tied", num_key_value_heads=2, tie_word_embeddings=True),
    _decoder("Qwen2ForQuestionAnswering", "Qwen2Config", "question_answering", num_key_value_heads=2),
    # Phi-3: fused qkv_proj and gate_up_proj, half of each head rotary, windows
    _decoder("Phi3ForCausalLM", "Phi3Config", "lm", num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1,
             eos_token_id=2),
    _decoder("Phi3ForCausalLM", "Phi3Config", "lm", variant="partial-window", num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=3,
             pad_token_id=0, bos_token_id=1, eos_token_id=2),
    _decoder("Phi3ForCausalLM", "Phi3Config", "lm", variant="tied", tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    _decoder("Phi3ForSequenceClassification", "Phi3Config", "sequence_classification", num_labels=3, pad_token_id=0, bos_token_id=1,
             eos_token_id=2),
    # QK-norm: the planted QK element is sign flips of rotary pairs (MATH §1); biases, windows
    _decoder("Qwen3Model", "Qwen3Config", None, num_key_value_heads=2),
    _decoder("Qwen3ForCausalLM", "Qwen3Config", "lm", num_key_value_heads=2, head_dim=16, attention_bias=True),
    _decoder("Qwen3ForCausalLM", "Qwen3Config", "lm", variant="qknorm-window", num_key_value_heads=2, head_dim=16, attention_bias=True,
             use_sliding_window=True, sliding_window=3, max_window_layers=1),
    _decoder("Qwen3ForSequenceClassification", "Qwen3Config", "sequence_classification", num_key_value_heads=2, num_labels=3, pad_token_id=0),
    _decoder("Qwen3ForQuestionAnswering", "Qwen3Config", "question_answering", num_key_value_heads=2),
    # Gemma: 1 + w gains, sqrt(d) embedding scale, GeGLU (tanh), a tied LM head, head_dim != d / H
    _decoder("GemmaModel", "GemmaConfig", None, "gemma", num_key_value_heads=1, head_dim=8, attention_bias=True, pad_token_id=0),
    _decoder("GemmaForCausalLM", "GemmaConfig", "lm", "gemma", num_key_value_heads=2, head_dim=16),
    _decoder("GemmaForSequenceClassification", "GemmaConfig", "sequence_classification", "gemma", num_key_value_heads=1, head_dim=8, num_labels=3),
    _decoder("GemmaForTokenClassification", "GemmaConfig", "token_classification", "gemma", num_key_value_heads=4, head_dim=8, num_labels=5),
    # Gemma 2: sandwich norms (the stream takes signed permutations, not rotations), soft-capped attention and logits (caps small
    # enough to bend), query_pre_attn_scalar, sliding and full layers alternating
    _decoder("Gemma2Model", "Gemma2Config", None, "gemma2", num_key_value_heads=4, head_dim=8, attn_logit_softcapping=None),
    _decoder("Gemma2ForCausalLM", "Gemma2Config", "lm", "gemma2", num_key_value_heads=2, head_dim=16, sliding_window=3, attn_logit_softcapping=2.0,
             final_logit_softcapping=3.0),
    _decoder("Gemma2ForCausalLM", "Gemma2Config", "lm", "gemma2", "softcap-window-bias", num_key_value_heads=2, head_dim=16,
             query_pre_attn_scalar=12, sliding_window=3, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, attention_bias=True),
    _decoder("Gemma2ForSequenceClassification", "Gemma2Config", "sequence_classification", "gemma2", num_key_value_heads=1, head_dim=8, num_labels=3),
    _decoder("Gemma2ForTokenClassification", "Gemma2Config", "token_classification", "gemma2", num_key_value_heads=4, head_dim=8, num_labels=5),
    # Gemma 3 (text): QK-norm (1 + w gains), sandwich norms, a RoPE base per layer type (the full layers' scaled linearly), 2 sliding
    # layers then 1 full; attn_logit_softcapping is in its config but transformers does not apply it
    _decoder("Gemma3TextModel", "Gemma3TextConfig", None, "gemma3", num_key_value_heads=1, head_dim=8, attention_bias=True),
    _decoder("Gemma3ForCausalLM", "Gemma3TextConfig", "lm", "gemma3", num_key_value_heads=2, head_dim=16, sliding_window=3, sliding_window_pattern=2),
    _decoder("Gemma3ForCausalLM", "Gemma3TextConfig", "lm", "gemma3", "qknorm-local-rope", num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
             query_pre_attn_scalar=12, sliding_window=3, sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=100.0,
             rope_scaling={"rope_type": "linear", "factor": 4.0}, attn_logit_softcapping=2.0),
    _decoder("Gemma3TextForSequenceClassification", "Gemma3TextConfig", "sequence_classification", "gemma3", num_key_value_heads=1, head_dim=8,
             num_labels=3),
    # OLMo 1: Llama's layers with LayerNorms without any parameter (nothing to fold; the stream rotates fixing the ones vector)
    _decoder("OlmoForCausalLM", "OlmoConfig", "lm", "olmo", num_key_value_heads=2, attention_bias=True, pad_token_id=0, eos_token_id=1),
    _decoder("OlmoModel", "OlmoConfig", None, "olmo", rope_parameters=dict(LLAMA3_ROPE), pad_token_id=0, eos_token_id=1),
    _decoder("OlmoForCausalLM", "OlmoConfig", "lm", "olmo", "tied-mha", tie_word_embeddings=True, pad_token_id=0, eos_token_id=1),
    _decoder("OlmoForSequenceClassification", "OlmoConfig", "sequence_classification", "olmo", num_labels=3, pad_token_id=0, eos_token_id=1),
    # OLMo-2: norms on the sublayers' outputs only (signed permutations of the stream), QK-norm over all heads at once, biases
    _decoder("Olmo2Model", "Olmo2Config", None, "olmo2", rope_parameters=dict(LLAMA3_ROPE), pad_token_id=0, eos_token_id=1),
    _decoder("Olmo2ForCausalLM", "Olmo2Config", "lm", "olmo2", num_key_value_heads=2, attention_bias=True, pad_token_id=0, eos_token_id=1),
    _decoder("Olmo2ForSequenceClassification", "Olmo2Config", "sequence_classification", "olmo2", num_labels=3, pad_token_id=0, eos_token_id=1),
    # OLMo 3: OLMo-2's layers, a window on the layers layer_types marks (3 of 4 by default), RoPE parameters per layer type
    _decoder("Olmo3ForCausalLM", "Olmo3Config", "lm", "olmo3", num_hidden_layers=4, num_key_value_heads=2, sliding_window=3, attention_bias=True,
             rope_theta=1000.0, rope_scaling=dict(OLMO3_YARN), pad_token_id=0, eos_token_id=1, **WIDE),
    _decoder("Olmo3Model", "Olmo3Config", None, "olmo3", sliding_window=3, rope_parameters=dict(full_attention=dict(LLAMA3_ROPE)),
             pad_token_id=0, eos_token_id=1),
    _decoder("Olmo3ForCausalLM", "Olmo3Config", "lm", "olmo3", "tied-mqa", num_hidden_layers=3, num_key_value_heads=1, sliding_window=2,
             layer_types=["full_attention", "sliding_attention", "full_attention"], tie_word_embeddings=True, pad_token_id=0, eos_token_id=1),
    _decoder("Olmo3ForSequenceClassification", "Olmo3Config", "sequence_classification", "olmo3", num_labels=3, sliding_window=3,
             pad_token_id=0, eos_token_id=1),
    # Granite: Llama's layers with scalar multipliers (embedding, residual, attention score, logits)
    _decoder("GraniteModel", "GraniteConfig", None, "granite", num_key_value_heads=2, **GRANITE),
    _decoder("GraniteForCausalLM", "GraniteConfig", "lm", "granite", num_key_value_heads=2, pad_token_id=0, **GRANITE),
    _decoder("GraniteForCausalLM", "GraniteConfig", "lm", "granite", "tied-biases-int-multipliers", tie_word_embeddings=True, attention_bias=True,
             mlp_bias=True, embedding_multiplier=12, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8),
    # Mixtures of experts: the experts (and the router's outputs) permuted, each expert's units too
    _decoder("OlmoeForCausalLM", "OlmoeConfig", "lm", "olmoe", num_key_value_heads=2, num_experts=3, num_experts_per_tok=2, attention_bias=True,
             pad_token_id=0, eos_token_id=1),
    # FlexOlmo: OLMo-2's layers (output norms, the full-width QK-norm) with OLMoE's mixture
    _decoder("FlexOlmoForCausalLM", "FlexOlmoConfig", "lm", "flex_olmo", num_key_value_heads=2, num_experts=3, num_experts_per_tok=2,
             attention_bias=True, pad_token_id=0, eos_token_id=1),
    _decoder("FlexOlmoModel", "FlexOlmoConfig", None, "flex_olmo", num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1),
    _decoder("FlexOlmoForCausalLM", "FlexOlmoConfig", "lm", "flex_olmo", "tied-normalized-top-1", num_key_value_heads=1, num_experts=3,
             num_experts_per_tok=1, norm_topk_prob=True, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1),
    # Llama with YaRN (its attention factor from the scale, unrounded correction range: truncate false)
    _decoder("LlamaForCausalLM", "LlamaConfig", "lm", variant="yarn", num_key_value_heads=2, rope_parameters=dict(GPT_OSS_YARN)),
    # SmolLM3: Llama's layers with NoPE layers (no_rope_layers: every 2nd here), windows on the NoPE layers (use_sliding_window)
    _decoder("SmolLM3ForCausalLM", "SmolLM3Config", "lm", num_hidden_layers=4, num_key_value_heads=2, no_rope_layer_interval=2,
             use_sliding_window=True, sliding_window=3, tie_word_embeddings=False, attention_bias=True, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, **WIDE),
    _decoder("SmolLM3Model", "SmolLM3Config", None, num_hidden_layers=3, no_rope_layers=[0, 1, 1], pad_token_id=0, bos_token_id=1, eos_token_id=2),
    _decoder("SmolLM3ForCausalLM", "SmolLM3Config", "lm", variant="tied-linear-rope-mlp-bias", num_key_value_heads=1, mlp_bias=True,
             rope_scaling={"rope_type": "linear", "factor": 4.0}, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    _decoder("SmolLM3ForSequenceClassification", "SmolLM3Config", "sequence_classification", num_labels=3, pad_token_id=0, bos_token_id=1,
             eos_token_id=2),
    _decoder("SmolLM3ForQuestionAnswering", "SmolLM3Config", "question_answering", num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
             eos_token_id=2),
    # Ministral: Mistral's layers, a window on the layers layer_types marks
    _decoder("MinistralForCausalLM", "MinistralConfig", "lm", num_hidden_layers=3, num_key_value_heads=2, head_dim=8, sliding_window=3,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"], **WIDE),
    _decoder("MinistralModel", "MinistralConfig", None, num_key_value_heads=2, head_dim=16, sliding_window=5, layer_types=["full_attention"] * 2),
    _decoder("MinistralForTokenClassification", "MinistralConfig", "token_classification", num_labels=5, num_key_value_heads=4, head_dim=8, sliding_window=3),
    _decoder("MinistralForQuestionAnswering", "MinistralConfig", "question_answering", num_key_value_heads=1, head_dim=8, sliding_window=3),
    # Seed-OSS: Llama's layers, biases on q/k/v (attention_bias), o (attention_out_bias) and the MLP (mlp_bias) apart
    _decoder("SeedOssForCausalLM", "SeedOssConfig", "lm", num_key_value_heads=2, head_dim=16, attention_out_bias=True, mlp_bias=True,
             pad_token_id=0, **WIDE),
    _decoder("SeedOssModel", "SeedOssConfig", None, num_key_value_heads=4, head_dim=None, attention_bias=False, pad_token_id=0),
    _decoder("SeedOssForSequenceClassification", "SeedOssConfig", "sequence_classification", num_key_value_heads=2, head_dim=8, num_labels=3,
             pad_token_id=0),
    _decoder("MixtralModel", "MixtralConfig", None, num_key_value_heads=4, num_local_experts=3, num_experts_per_tok=1),
    _decoder("MixtralForCausalLM", "MixtralConfig", "lm", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=3),
    _decoder("MixtralForSequenceClassification", "MixtralConfig", "sequence_classification", num_key_value_heads=2, num_local_experts=3,
             num_labels=3, pad_token_id=0),
    _decoder("MixtralForTokenClassification", "MixtralConfig", "token_classification", num_key_value_heads=2, num_labels=5),
    _decoder("MixtralForQuestionAnswering", "MixtralConfig", "question_answering", num_key_value_heads=2),
    # Qwen3-MoE: moe_intermediate_size != intermediate_size, top 3 unnormalised or top 2 normalised, windows
    _decoder("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "lm", num_key_value_heads=2, head_dim=16, num_experts=5, num_experts_per_tok=3,
             moe_intermediate_size=24, attention_bias=True, use_sliding_window=True, sliding_window=3),
    _decoder("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "lm", variant="normalized", num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=True),
    _decoder("Qwen3MoeForSequenceClassification", "Qwen3MoeConfig", "sequence_classification", num_key_value_heads=2, num_experts=3,
             num_experts_per_tok=2, num_labels=3, pad_token_id=0),
    _decoder("Qwen3MoeForTokenClassification", "Qwen3MoeConfig", "token_classification", num_key_value_heads=2, num_experts=3,
             num_experts_per_tok=1, norm_topk_prob=True, num_labels=5),
    _decoder("Qwen3MoeForQuestionAnswering", "Qwen3MoeConfig", "question_answering", num_key_value_heads=2, num_experts=3, num_experts_per_tok=2),
    # Qwen2-MoE: Qwen3-MoE's mixture (layer 1 dense by mlp_only_layers) beside a shared expert gated by a sigmoid; q/k/v biases,
    # layer 0 windowed; variants: renormalised top k, tied, dense every other layer by decoder_sparse_step, no biases, no windows
    _decoder("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "lm", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=24, shared_expert_intermediate_size=40, mlp_only_layers=[1], use_sliding_window=True, sliding_window=3,
             **WIDE),
    _decoder("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "lm", variant="normalized-tied-step", num_hidden_layers=3, num_key_value_heads=4,
             num_experts=3, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2, qkv_bias=False, tie_word_embeddings=True,
             moe_intermediate_size=16, shared_expert_intermediate_size=24),
    _decoder("Qwen2MoeModel", "Qwen2MoeConfig", None, num_key_value_heads=2, num_experts=3, num_experts_per_tok=1,
             moe_intermediate_size=24, shared_expert_intermediate_size=40),
    _decoder("Qwen2MoeForSequenceClassification", "Qwen2MoeConfig", "sequence_classification", num_key_value_heads=2, num_experts=3,
             num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_labels=3, pad_token_id=0),
    _decoder("Qwen2MoeForTokenClassification", "Qwen2MoeConfig", "token_classification", num_key_value_heads=2, num_experts=3,
             num_experts_per_tok=1, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_labels=5),
    _decoder("Qwen2MoeForQuestionAnswering", "Qwen2MoeConfig", "question_answering", num_key_value_heads=2, num_experts=3,
             num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40),
    # Phi-3.5-MoE: Mixtral's layout with LayerNorms (biases), q/k/v/o and LM head biases, sparsemixer routing, longrope
    _phimoe("PhimoeForCausalLM", "lm", rope_parameters=dict(PHIMOE_LONGROPE)),
    _phimoe("PhimoeForCausalLM", "lm", variant="tied-window-default-rope", tie_word_embeddings=True, sliding_window=3, num_local_experts=3,
            router_jitter_noise=0.3),
    _phimoe("PhimoeModel", None, attention_bias=False, lm_head_bias=False),
    _phimoe("PhimoeForSequenceClassification", "sequence_classification", num_labels=3, pad_token_id=0),
    # GPT-OSS: GQA with q/k/v/o biases and a sink per head, sliding and full layers, YaRN, a mixture whose router has a bias and
    # whose experts (biases, gate and up interleaved) run the clamped SwiGLU
    _gpt_oss("GptOssForCausalLM", "lm"),
    _gpt_oss("GptOssForCausalLM", "lm", variant="tied-mha-default-rope-top-1", tie_word_embeddings=True, num_key_value_heads=4,
             num_experts_per_tok=1, attention_bias=False, rope_parameters=dict(rope_type="default", rope_theta=1e4),
             layer_types=["full_attention", "sliding_attention"]),
    _gpt_oss("GptOssModel", None, num_key_value_heads=1),
    _gpt_oss("GptOssForSequenceClassification", "sequence_classification", num_labels=3, pad_token_id=0),
    _gpt_oss("GptOssForTokenClassification", "token_classification", num_labels=5),
    # Vision-language models: the text tower aligned as its family, the projector's output moving with the stream, the vision tower as is
    _gemma3_vlm(),
    _gemma3_vlm("no-vision-head-bias", vision=(("vision_use_head", False),), attention_bias=True),
    _llama4_vlm(attention_bias=True),
    _llama4_vlm("tied-no-qk-norm", tie_word_embeddings=True, use_qk_norm=False),  # tied by its text_config, the top level untied
    _mistral3(),
    _mistral3("tied-bias", tie=True, bias=True),
    _qwen_vl("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", "qwen2_vl", dict(embed_dim=16, hidden_size=32, mlp_ratio=2)),
    _qwen_vl("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", "qwen2_5_vl", dict(hidden_size=16, out_hidden_size=32, intermediate_size=24,
                                                                                         fullatt_block_indexes=[1], window_size=8), tie=True),
    # Qwen3-VL (Qwen3's text model, tied as the 2B and 4B are) and Qwen3-VL-MoE (Qwen3-MoE's, its experts stacked, untied as the 30B is)
    _qwen_vl("Qwen3VLForConditionalGeneration", "Qwen3VLConfig", "qwen3_vl", QWEN3_VISION, tie=True, rope=MROPE_INTERLEAVED, head_dim=16,
             attention_bias=True),
    _qwen_vl("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig", "qwen3_vl_moe", QWEN3_VISION, rope=MROPE_INTERLEAVED, head_dim=16,
             attention_bias=True, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=24),
    # CLIP's image tower: the patch convolution without a bias, pre_layrnorm, the pooled class token through post_layernorm, the projection
    Case("CLIPVisionModel", lambda: tf.CLIPVisionConfig(**CLIP_VISION), None, "clip_vision"),
    Case("CLIPVisionModelWithProjection", lambda: tf.CLIPVisionConfig(**CLIP_VISION, hidden_act="gelu"), "image_embeds", "clip_vision"),
    # CLIP's text tower: causal attention, the first eos token's pooled state (the largest id's under the legacy eos_token_id 2)
    Case("CLIPTextModel", lambda: tf.CLIPTextConfig(**CLIP_TEXT, eos_token_id=2), None, "clip_text"),
    Case("CLIPTextModelWithProjection", lambda: tf.CLIPTextConfig(**CLIP_TEXT, eos_token_id=7, hidden_act="gelu"), "text_embeds", "clip_text"),
    # SigLIP's image tower: a patch bias, no class token, post_layernorm over every token, the attention-pooling head (or none)
    Case("SiglipVisionModel", lambda: tf.SiglipVisionConfig(**SIGLIP_VISION), None, "siglip_vision"),
    Case("SiglipVisionModel", lambda: tf.SiglipVisionConfig(**SIGLIP_VISION, vision_use_head=False, hidden_act="gelu"), None, "siglip_vision",
         variant="no-pooling-head"),
    # SigLIP's text tower: no causal mask, the last token's state through its head
    Case("SiglipTextModel", lambda: tf.SiglipTextConfig(**SIGLIP_TEXT, projection_size=24), None, "siglip_text"),
    # ViT: gray and RGB images, a pooler narrower than d with its own activation, non-square images and patches, no qkv bias
    _vit("ViTModel", None, variant="no-pooler", kwargs=(("add_pooling_layer", False),)),
    _vit("ViTModel", None, variant="rgb", **RGB),
    _vit("ViTModel", None, variant="odd-pooler", image_size=(8, 12), patch_size=(2, 3), num_channels=2, pooler_output_size=24, pooler_act="relu",
         hidden_act="gelu_new"),
    _vit("ViTForImageClassification", "image_classification", num_labels=3),
    _vit("ViTForImageClassification", "image_classification", variant="rgb-no-qkv-bias", **RGB, num_labels=5, qkv_bias=False),
    _vit("ViTForMaskedImageModeling", "masked_image_modeling", runs=False, encoder_stride=2),
    # DistilBERT: sinusoidal positions, ReLU
    _distilbert("DistilBertModel", None),
    _distilbert("DistilBertForMaskedLM", "masked_lm"),
    _distilbert("DistilBertForSequenceClassification", "sequence_classification", num_labels=3),
    _distilbert("DistilBertForTokenClassification", "token_classification", num_labels=5, activation="relu"),
    _distilbert("DistilBertForQuestionAnswering", "question_answering", sinusoidal_pos_embds=True),
    _distilbert("DistilBertForMultipleChoice", "multiple_choice"),
    # ModernBERT: local and global layers with their RoPE bases, biases optional, mean pooling, SiLU classifier
    _modernbert("ModernBertModel", None, **BIASES),
    _modernbert("ModernBertForMaskedLM", "masked_lm"),
    _modernbert("ModernBertForSequenceClassification", "sequence_classification", num_labels=3, classifier_pooling="mean", **BIASES),
    _modernbert("ModernBertForTokenClassification", "token_classification", num_labels=5, classifier_activation="silu"),
    _modernbert("ModernBertForQuestionAnswering", "question_answering", **BIASES),
    _modernbert("ModernBertForMultipleChoice", "multiple_choice"),
    # BART: an encoder-decoder; self-attention in both stacks, cross-attention, one shared embedding
    _bart("BartModel", None),
    _bart("BartForConditionalGeneration", "lm"),
    _bart("BartForConditionalGeneration", "lm", variant="scaled-embedding", scale_embedding=True),
    _bart("BartForSequenceClassification", "sequence_classification", num_labels=3),
    _bart("BartForQuestionAnswering", "question_answering"),
    # ELECTRA: BERT's layers behind embeddings of their own width (projected to the stream) or of the stream's
    _electra("ElectraForPreTraining", "pretraining", **WIDE),
    _electra("ElectraForPreTraining", "pretraining", variant="unprojected-relu", embedding_size=32, hidden_act="relu", **WIDE),
    _electra("ElectraModel", None),
    _electra("ElectraForSequenceClassification", "sequence_classification", num_labels=3),
    # (the generator's first case at embedding_size = hidden_size: its groups then move the tied word embeddings and the transform)
    _electra("ElectraForMaskedLM", "masked_lm", embedding_size=32),
    _electra("ElectraForMaskedLM", "masked_lm", variant="projected"),
    _electra("ElectraForMaskedLM", "masked_lm", variant="unprojected-untied", embedding_size=32, tie_word_embeddings=False),
    _electra("ElectraForMaskedLM", "masked_lm", variant="projected-untied", tie_word_embeddings=False),
    _electra("ElectraForTokenClassification", "token_classification", num_labels=5),
    _electra("ElectraForQuestionAnswering", "question_answering"),
    # T5: v1.0 (ReLU, the LM's input scaled) and v1.1 (gated GELU, unscaled); the self-attention's heads keep their order
    _t5("T5Model", None),
    _t5("T5ForConditionalGeneration", "lm"),
    _t5("T5ForConditionalGeneration", "lm", variant="v1.1", feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    _t5("T5ForSequenceClassification", "sequence_classification", num_labels=3, feed_forward_proj="gated-gelu"),
    _t5("T5ForQuestionAnswering", "question_answering"),
    # mT5: T5 v1.1 (gated GELU by default), its LM head never scaled; umT5: a position bias in every self-attention layer
    _t5("MT5ForConditionalGeneration", "lm", family="mt5", tie_word_embeddings=False),
    _t5("MT5ForConditionalGeneration", "lm", variant="tied-relu", family="mt5", feed_forward_proj="relu"),
    _t5("MT5Model", None, family="mt5"),
    _t5("MT5ForSequenceClassification", "sequence_classification", family="mt5", num_labels=3),
    _t5("MT5ForQuestionAnswering", "question_answering", family="mt5"),
    _t5("UMT5ForConditionalGeneration", "lm", family="umt5", tie_word_embeddings=False),
    _t5("UMT5ForConditionalGeneration", "lm", variant="tied-relu", family="umt5", feed_forward_proj="relu"),
    _t5("UMT5Model", None, family="umt5"),
    _t5("UMT5ForSequenceClassification", "sequence_classification", family="umt5", num_labels=3),
    _t5("UMT5ForQuestionAnswering", "question_answering", family="umt5"),
    # Whisper: mBART's layers behind two convolutions over log-mel frames, the decoder's embedding tied to proj_out
    _whisper("WhisperModel", None),
    _whisper("WhisperForConditionalGeneration", "lm"),
    _whisper("WhisperForConditionalGeneration", "lm", variant="scaled-gelu-new", scale_embedding=True, activation_function="gelu_new"),
    # mBART: BART's tensors, pre-LN layers and a final norm per stack, the decoder started from the language id
    _mbart("MBartModel", None),
    _mbart("MBartForConditionalGeneration", "lm", scale_embedding=True),
    _mbart("MBartForSequenceClassification", "sequence_classification", num_labels=3),
    _mbart("MBartForQuestionAnswering", "question_answering"),
    # Marian: BART's post-LN stacks, fixed sinusoids (the stream unmoved), one vocabulary or one per stack
    _marian("MarianMTModel", "lm"),
    _marian("MarianMTModel", "lm", variant="separate-vocabularies-unscaled", share_encoder_decoder_embeddings=False, vocab_size=50, decoder_vocab_size=60,
            scale_embedding=False),
    _marian("MarianModel", None),
    # Pegasus: mBART's pre-LN stacks and final norms, saved sinusoids (on the stream, moved with it)
    _pegasus("PegasusForConditionalGeneration", "lm"),
    _pegasus("PegasusForConditionalGeneration", "lm", variant="unscaled-relu", scale_embedding=False, activation_function="relu"),
    _pegasus("PegasusModel", None),
    # M2M100: mBART's pre-LN stacks, fairseq's sinusoids over the tokens that are not padding (the stream unmoved), ReLU
    _m2m_100("M2M100ForConditionalGeneration", "lm", activation_function="relu"),
    _m2m_100("M2M100ForConditionalGeneration", "lm", variant="unscaled-gelu-head-dim-9", scale_embedding=False, activation_function="gelu", d_model=36,
             encoder_attention_heads=4, decoder_attention_heads=3),
    _m2m_100("M2M100Model", None),
    # Blenderbot: Pegasus's tensors and layers, learned positions
    _blenderbot("BlenderbotForConditionalGeneration", "lm"),
    _blenderbot("BlenderbotModel", None),
    # PLBART: BART's tensors and layers, the decoder started from the language id
    _plbart("PLBartForConditionalGeneration", "lm"),
    _plbart("PLBartModel", None),
    _plbart("PLBartForSequenceClassification", "sequence_classification", num_labels=3),
    # GPT-J: Phi's parallel layer without attention biases, interleaved partial RoPE
    _gptj("GPTJModel", None),
    _gptj("GPTJForCausalLM", "lm", pad_token_id=0),
    _gptj("GPTJForCausalLM", "lm", variant="tied-whole-head-rope", tie_word_embeddings=True, rotary_dim=16),
    _gptj("GPTJForSequenceClassification", "sequence_classification", num_labels=3, pad_token_id=0),
    _gptj("GPTJForQuestionAnswering", "question_answering"),
    # DeBERTa-v3 (relative positions in buckets, the tokens' own projections) and v2 (pos_key_proj, pos_query_proj)
    _deberta("DebertaV2Model", None),
    _deberta("DebertaV2ForSequenceClassification", "sequence_classification", v2=True, num_labels=3),
    _deberta("DebertaV2ForMaskedLM", "masked_lm"),
    _deberta("DebertaV2ForMaskedLM", "masked_lm", variant="own-positions-untied", v2=True, tie_word_embeddings=False),
    _deberta("DebertaV2ForMaskedLM", "masked_lm", variant="new-head", legacy=False),
    _deberta("DebertaV2ForTokenClassification", "token_classification", num_labels=5),
    _deberta("DebertaV2ForQuestionAnswering", "question_answering"),
    _deberta("DebertaV2ForMultipleChoice", "multiple_choice"),
    # OPT (round 3): pre-norm; post-norm with projections in and out (OPT-350m); no biases or affine norms; the heads
    _opt("OPTForCausalLM", "lm"),
    _opt("OPTForCausalLM", "lm", variant="350m-post-norm-projected", do_layer_norm_before=False, word_embed_proj_dim=32),
    _opt("OPTModel", None, do_layer_norm_before=False, word_embed_proj_dim=32),  # its groups: post-norm, projected
    _opt("OPTForCausalLM", "lm", variant="untied-no-bias-plain-norms", tie_word_embeddings=False, enable_bias=False,
         layer_norm_elementwise_affine=False),
    _opt("OPTModel", None, variant="pre-norm-projected", word_embed_proj_dim=48),
    _opt("OPTForSequenceClassification", "sequence_classification", num_labels=3),
    _opt("OPTForQuestionAnswering", "question_answering"),
    # GPT-Neo (round 3): global and local layers, unscaled scores; local first and untied; the heads
    _gpt_neo("GPTNeoForCausalLM", "lm"),
    _gpt_neo("GPTNeoForCausalLM", "lm", variant="local-global-untied-relu", attention_types=[[["local", "global"], 1]],
             tie_word_embeddings=False, activation_function="relu"),
    _gpt_neo("GPTNeoModel", None),
    _gpt_neo("GPTNeoForSequenceClassification", "sequence_classification", num_labels=3),
    _gpt_neo("GPTNeoForTokenClassification", "token_classification", num_labels=5),
    _gpt_neo("GPTNeoForQuestionAnswering", "question_answering"),
    # BLOOM (round 3): ALiBi (the heads' order fixed), the fused query_key_value per head, the embedding norm; the heads
    _bloom("BloomForCausalLM", "lm"),
    _bloom("BloomForCausalLM", "lm", variant="untied-8-heads", tie_word_embeddings=False, hidden_size=64, n_head=8),
    _bloom("BloomModel", None),
    _bloom("BloomForSequenceClassification", "sequence_classification", num_labels=3),
    _bloom("BloomForTokenClassification", "token_classification", num_labels=5),
    _bloom("BloomForQuestionAnswering", "question_answering"),
    # DINOv2 (round 3): layer scales (the stream permuted only), the mask token, the classifier over [CLS; patch mean]; SwiGLU
    _dinov2("Dinov2Model", None),
    _dinov2("Dinov2ForImageClassification", "image_classification", num_labels=3),
    _dinov2("Dinov2ForImageClassification", "image_classification", variant="swiglu-no-qkv-bias", num_labels=5, use_swiglu_ffn=True,
            qkv_bias=False, use_mask_token=False),
    # DeBERTa v1 (round 3): the fused in_proj per head, q_bias/v_bias, pos_proj/pos_q_proj; token types and c2p alone; the heads
    _deberta_v1("DebertaModel", None),
    _deberta_v1("DebertaForSequenceClassification", "sequence_classification", num_labels=3),
    _deberta_v1("DebertaModel", None, variant="c2p-token-types-no-positions", pos_att_type="c2p", type_vocab_size=2, position_biased_input=False),
    _deberta_v1("DebertaForMaskedLM", "masked_lm"),
    _deberta_v1("DebertaForTokenClassification", "token_classification", num_labels=5),
    _deberta_v1("DebertaForQuestionAnswering", "question_answering"),
    # DINOv2 with registers: 3 register tokens after the CLS token (outside the classifier's patch mean)
    _dinov2_registers("Dinov2WithRegistersModel", None),
    _dinov2_registers("Dinov2WithRegistersForImageClassification", "image_classification", num_labels=3),
]
BY_ID = {case.id: case for case in CASES}
assert len(BY_ID) == len(CASES), "two cases with one id"


def model_inputs(case: Case, config) -> dict:
    """A batch of 3 with a padded row (9 tokens, past every window) or 3 images."""
    if case.family in ("vit", "clip_vision", "siglip_vision", "dinov2", "dinov2_with_registers"):
        h, w = (config.image_size,) * 2 if isinstance(config.image_size, int) else config.image_size
        return {"pixel_values": np.random.default_rng(0).normal(size=(3, config.num_channels, h, w)).astype(np.float32)}
    if case.family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):  # the record's own batch: one image a row after its vision_start token
        from rotsym_jax import hf

        inputs = hf.family_for(case.family).example_inputs(hf.as_model_config(config), np.random.default_rng(0), batch=3)
        inputs["attention_mask"][-1, -2:] = 0
        return inputs
    if case.family in ("gemma3_vlm", "mistral3", "llama4"):  # one image a row, its 4 tokens after the first (no other token is the image's)
        ids, mask = token_batch(config.text_config.vocab_size, pad_id=0)
        ids[ids == IMAGE_TOKEN] = IMAGE_TOKEN + 1
        ids[:, 1:5] = IMAGE_TOKEN
        v = config.vision_config
        pixels = np.random.default_rng(1).normal(size=(3, v.num_channels, v.image_size, v.image_size)).astype(np.float32)
        inputs = {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}
        if case.family == "mistral3":
            inputs["image_sizes"] = np.full((3, 2), v.image_size, np.int64)
        return inputs
    if case.family == "whisper":  # log-mel frames, and the decoder's tokens
        rng = np.random.default_rng(0)
        return {"input_features": rng.normal(size=(3, config.num_mel_bins, 2 * config.max_source_positions)).astype(np.float32),
                "decoder_input_ids": token_batch(config.vocab_size, pad_id=config.pad_token_id)[0]}
    ids, mask = token_batch(config.vocab_size, pad_id=config.pad_token_id or 0)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if case.family in ("bart", "mbart", "t5", "mt5", "umt5", "marian", "pegasus", "m2m_100", "plbart", "blenderbot"):  # each example ends with eos, before its padding
        ids[np.arange(len(ids)), mask.sum(1) - 1] = config.eos_token_id
    if case.family in ("t5", "mt5", "umt5", "marian", "pegasus", "m2m_100", "blenderbot"):  # T5Model (MarianModel) has no default decoder inputs: the ids shifted right
        return {**inputs, "decoder_input_ids": np.concatenate([np.full((len(ids), 1), config.decoder_start_token_id), ids[:, :-1]], axis=1)}
    if case.family in ("bert", "roberta", "deberta", "deberta_v1") and config.type_vocab_size > 1:
        inputs["token_type_ids"] = np.zeros_like(ids)
        inputs["token_type_ids"][:, 4:] = 1
    if case.head == "multiple_choice":  # (batch, choices, tokens)
        inputs = {k: np.stack([x, x[::-1]], axis=1) for k, x in inputs.items()}
    return inputs


def reference(model, inputs) -> dict:
    """Every float output of transformers' model, its base model's hidden state and pooler output
    too, padding positions zeroed (what a model computes there is not specified)."""
    # a multiple-choice model's base sees the choices flattened: its own outputs only
    choices = "input_ids" in inputs and inputs["input_ids"].ndim == 3
    out = reference_outputs(model, **inputs) if choices else reference_with_base(model, **inputs)
    mask = inputs.get("attention_mask")
    if mask is not None:
        for key, x in out.items():
            if x.shape[: mask.ndim] == mask.shape:
                out[key] = np.where(mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)).astype(bool), x, 0.0)
    return out
