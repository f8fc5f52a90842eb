"""The supported transformer families: one record each (tensors, norms, heads; family.py); their
Flax NNX forward passes are `nets/`, imported on first use."""

from .afmoe import AFMOE
from .bart import BART, MBART
from .bert import BERT, ROBERTA
from .bloom import BLOOM
from .clip import CLIP, CLIP_TEXT, CLIP_VISION
from .cohere import COHERE, COHERE2
from .deberta import DEBERTA_V2
from .deberta_v1 import DEBERTA
from .deepseek import DEEPSEEK_V2, DEEPSEEK_V3, GLM4_MOE_LITE, MINICPM3
from .dinov2 import DINOV2, DINOV2_WITH_REGISTERS
from .distilbert import DISTILBERT
from .dots1 import DOTS1
from .electra import ELECTRA
from .ernie4_5 import ERNIE4_5, ERNIE4_5_MOE
from .exaone_moe import EXAONE_MOE
from .falcon import FALCON
from .glm import GLM, GLM4
from .glm4_moe import GLM4_MOE
from .gpt2 import GPT2
from .gpt_bigcode import GPT_BIGCODE
from .gpt_neo import GPT_NEO
from .gpt_neox import GPT_NEOX
from .gpt_oss import GPT_OSS
from .gptj import GPTJ
from .granitemoe import GRANITE_MOE
from .granitemoehybrid import GRANITE_MOE_HYBRID
from .helium import HELIUM
from .hunyuan import HUNYUAN_V1_DENSE, HUNYUAN_V1_MOE
from .jais2 import JAIS2
from .lfm2 import LFM2
from .llama import APERTUS, EXAONE, EXAONE4, FLEX_OLMO, GEMMA, GEMMA2, GEMMA3, GRANITE, LLAMA, OLMO2, OLMO3, OLMOE
from .llama4 import LLAMA4_TEXT
from .m2m_100 import M2M_100
from .mamba import MAMBA
from .mamba2 import MAMBA2
from .marian import MARIAN
from .minimax import MINIMAX
from .modernbert import MODERNBERT
from .nemotron import NEMOTRON
from .olmo import OLMO
from .opt import OPT
from .pegasus import BLENDERBOT, PEGASUS
from .phi import PHI
from .phimoe import PHIMOE
from .plbart import PLBART
from .qwen3_next import QWEN3_NEXT
from .siglip import SIGLIP, SIGLIP_TEXT, SIGLIP_VISION
from .stablelm import STABLELM
from .starcoder2 import STARCODER2
from .t5 import MT5, T5, UMT5
from .vit import VIT
from .vlm import GEMMA3_VLM, LLAMA4, MISTRAL3, QWEN2_5_VL, QWEN2_VL, QWEN3_VL, QWEN3_VL_MOE
from .whisper import WHISPER

# Each family module defines a `Family`; the loader picks one by config.model_type.
FAMILIES = (BERT, ROBERTA, DEBERTA_V2, BART, MBART, T5, WHISPER, DISTILBERT, MODERNBERT, VIT, GPT2, GPT_BIGCODE, GPT_NEOX, GPTJ, PHI, STABLELM, STARCODER2,
            COHERE, COHERE2, FALCON, LLAMA, GEMMA, GEMMA2, GEMMA3, OLMO2, OLMOE, GRANITE, DEEPSEEK_V2, DEEPSEEK_V3, GLM, GLM4, GLM4_MOE, MAMBA,
            EXAONE4, CLIP_VISION, CLIP_TEXT, CLIP, SIGLIP_VISION, SIGLIP_TEXT, SIGLIP, APERTUS, EXAONE, LFM2, GEMMA3_VLM, MISTRAL3,
            QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, MAMBA2, GRANITE_MOE_HYBRID, AFMOE, LLAMA4_TEXT, LLAMA4,
            NEMOTRON, OLMO, HELIUM, ERNIE4_5, ERNIE4_5_MOE, GRANITE_MOE, PHIMOE, HUNYUAN_V1_DENSE, JAIS2, EXAONE_MOE, GPT_OSS,
            DOTS1, HUNYUAN_V1_MOE, FLEX_OLMO,
            GLM4_MOE_LITE, MINICPM3, QWEN3_NEXT,
            MINIMAX, OLMO3, MT5, UMT5, ELECTRA)
# Round 3 of the types transformers writes (issue 73)
FAMILIES += (OPT, GPT_NEO, BLOOM, DINOV2, DINOV2_WITH_REGISTERS, DEBERTA)
# Round 4: BART's relatives
FAMILIES += (MARIAN, PEGASUS, M2M_100, PLBART, BLENDERBOT)
