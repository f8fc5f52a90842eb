"""Issue 73's independent check: symmetries planted in PyTorch on transformers' own models, undone
by `rotsym align` from the command line.

For each model (tiny seeded float32 configs that transformers builds): A is written with
save_pretrained; B is A with, in every stack and attention site, a random orthogonal map per head on
Q/K (Q's and K's rows by the same R) and on V/O (V's rows by R, O's columns by R) and a random
permutation of every FFN's hidden units (each expert's for MoE), made here from transformers' module
structure, not with rotsym_jax's transforms. Where RoPE applies, the Q/K maps commute with it (GPT-J:
a 2x2 rotation per rotary pair, any rotation on the non-rotary dims; DeepSeek-V3's MLA: the no-RoPE
rows of q_b_proj and kv_b_proj per head, the shared RoPE key untouched). B's outputs are checked equal
to A's in torch (the plant is a symmetry); then `rotsym align A B OUT --heads permute` runs in memory
and streamed (--max-memory), and OUT, loaded by transformers, is compared with A: its outputs (the
function kept) and its planted tensors (the plant undone: their distance to A's, before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers as tf

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from rotsym_experiments.results_io import jax_version, provenance, write_json  # noqa: E402

FUNCTION_TOL_B = 1e-5  # the plant is a symmetry: float32 round-off only
FUNCTION_TOL_OUT = 1e-4
UNDONE_TOL = 1e-4  # relative distance of the planted tensors to A's after alignment

# The configs of tests/family_cases.py (transformers builds them and rotsym reads them), with heads.
TEXT = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=20)
WIDE = dict(initializer_range=0.2)
DEBERTA_V3 = dict(relative_attention=True, share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False, position_buckets=8,
                  norm_rel_ebd="layer_norm", max_relative_positions=16, **WIDE)
DEBERTA_V2 = dict(relative_attention=True, share_att_key=False, pos_att_type="c2p|p2c", type_vocab_size=2, max_relative_positions=8,
                  tie_word_embeddings=False, **WIDE)
T5 = dict(vocab_size=60, d_model=32, d_kv=6, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4, decoder_start_token_id=0,
          relative_attention_num_buckets=8, relative_attention_max_distance=6, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
BART = dict(vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=2,
            encoder_ffn_dim=48, decoder_ffn_dim=40, max_position_embeddings=20)
WHISPER = dict(vocab_size=60, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=2,
               encoder_ffn_dim=48, decoder_ffn_dim=40, max_source_positions=10, max_target_positions=20, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, decoder_start_token_id=1)
GPTJ = dict(vocab_size=60, n_embd=64, n_layer=2, n_head=4, n_positions=32, n_inner=96, rotary_dim=8, **WIDE)
DEEPSEEK = dict(TEXT, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=12, q_lora_rank=10, qk_rope_head_dim=4, qk_nope_head_dim=8,
                v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
                first_k_dense_replace=1, n_shared_experts=1, pad_token_id=0, **WIDE)

MODELS = {
    "deberta-v3 (shared position keys)": ("DebertaV2ForMaskedLM", lambda: tf.DebertaV2Config(**TEXT, **DEBERTA_V3), "deberta"),
    "deberta-v2 (own position keys)": ("DebertaV2ForMaskedLM", lambda: tf.DebertaV2Config(**TEXT, **DEBERTA_V2), "deberta"),
    "t5 v1.1": ("T5ForConditionalGeneration", lambda: tf.T5Config(**T5), "t5"),
    "bart": ("BartForConditionalGeneration", lambda: tf.BartConfig(**BART), "bart"),
    "whisper": ("WhisperForConditionalGeneration", lambda: tf.WhisperConfig(**WHISPER), "whisper"),
    "gpt-j": ("GPTJForCausalLM", lambda: tf.GPTJConfig(**GPTJ), "gptj"),
    "deepseek-v3": ("DeepseekV3ForCausalLM", lambda: tf.DeepseekV3Config(**DEEPSEEK), "deepseek"),
    "deepseek-v3 (+ shared RoPE key)": ("DeepseekV3ForCausalLM", lambda: tf.DeepseekV3Config(**DEEPSEEK), "deepseek-rope"),
}


# ---- A: a seeded model whose norms, biases and heads are not trivially 0/1 ---------------------------

def build(cls_name: str, config, seed: int):
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = getattr(tf, cls_name)(config).eval()
    with torch.no_grad():
        out = model.get_output_embeddings()
        if out is not None:  # logits O(1), not O(0.02)
            out.weight.mul_(1.0 / (out.weight.shape[1] ** 0.5 * out.weight.std()))
        for p in model.parameters():
            if p.ndim == 1:  # transformers starts biases at 0 and gains at 1: a misplaced one would not show
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    return model


# ---- the plant, on the torch modules --------------------------------------------------------------

def orthogonal(n: int, g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:  # a proper rotation (a reflection would do as well; rotations are the harder case for nothing)
        q[:, 0] = -q[:, 0]
    return q.float()


def rope_compatible(head_dim: int, rotary_dim: int, g: torch.Generator) -> torch.Tensor:
    """A map that commutes with GPT-J's interleaved partial RoPE: a 2x2 rotation of each rotary pair
    (2i, 2i+1) by an angle of its own, and any rotation of the dims past rotary_dim."""
    r = torch.zeros(head_dim, head_dim)
    angles = 2 * torch.pi * torch.rand(rotary_dim // 2, generator=g)
    for i, a in enumerate(angles):
        c, s = torch.cos(a), torch.sin(a)
        r[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, -s], [s, c]])
    r[rotary_dim:, rotary_dim:] = orthogonal(head_dim - rotary_dim, g)
    return r


def rotate_rows(linear, heads: int, stride: int, offset: int, maps) -> None:
    """Rows offset..offset+d of each head's block of `stride` rows (and the bias's) <- R_h @ them."""
    with torch.no_grad():
        for h, r in zip(range(heads), maps, strict=True):
            rows = slice(h * stride + offset, h * stride + offset + r.shape[0])
            linear.weight[rows] = r @ linear.weight[rows]
            if getattr(linear, "bias", None) is not None:
                linear.bias[rows] = r @ linear.bias[rows]


def rotate_columns(linear, maps) -> None:
    """O's columns of head h <- them @ R_h^T (v' = R v, so O' v' = O v)."""
    with torch.no_grad():
        d = maps[0].shape[0]
        for h, r in enumerate(maps):
            cols = slice(h * d, (h + 1) * d)
            linear.weight[:, cols] = linear.weight[:, cols] @ r.T


def permute_ffn(ups, down, g: torch.Generator) -> None:
    """Hidden unit j of the FFN moves to perm[j]: rows of each up/gate (and bias), columns of down."""
    width = ups[0].weight.shape[0]
    perm = torch.randperm(width, generator=g)
    with torch.no_grad():
        for up in ups:
            up.weight.copy_(up.weight[perm])
            if getattr(up, "bias", None) is not None:
                up.bias.copy_(up.bias[perm])
        down.weight.copy_(down.weight[:, perm])


class Plant:
    """Counts what is planted and collects the names of the tensors it changed."""

    def __init__(self, model, seed: int):
        self.model, self.g = model, torch.Generator().manual_seed(seed)
        self.counts = {"qk_head_maps": 0, "vo_head_maps": 0, "ffn_permutations": 0, "attention_sites": 0}
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.touched: set[str] = set()

    def _mark(self, *modules):
        for m in modules:
            self.touched.update(self.names[id(p)] for p in m.parameters(recurse=False))

    def attention(self, qs, ks, vs, o, heads: int, head_dim: int, *, qk_maps=None, stride=None, q_stride=None, q_offset=0, v_stride=None,
                  v_offset=0):
        """One attention site: the same R_h on every Q- and K-like projection (rows), S_h on V (rows) and O (columns)."""
        qk = qk_maps or [orthogonal(head_dim, self.g) for _ in range(heads)]
        vo = [orthogonal(head_dim if v_stride is None else o.weight.shape[1] // heads, self.g) for _ in range(heads)]
        for lin in qs:
            rotate_rows(lin, heads, q_stride or stride or head_dim, q_offset, qk)
        for lin in ks:
            rotate_rows(lin, heads, stride or head_dim, 0, qk)
        for lin in vs:
            rotate_rows(lin, heads, v_stride or head_dim, v_offset, vo)
        rotate_columns(o, vo)
        self._mark(*qs, *ks, *vs, o)
        self.counts["qk_head_maps"] += heads
        self.counts["vo_head_maps"] += heads
        self.counts["attention_sites"] += 1

    def ffn(self, ups, down):
        permute_ffn(ups, down, self.g)
        self._mark(*ups, down)
        self.counts["ffn_permutations"] += 1


def plant_deberta(p: Plant, model, config):
    heads, d = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    for layer in model.deberta.encoder.layer:
        s = layer.attention.self
        qs = [s.query_proj] + ([s.pos_query_proj] if hasattr(s, "pos_query_proj") else [])
        ks = [s.key_proj] + ([s.pos_key_proj] if hasattr(s, "pos_key_proj") else [])
        p.attention(qs, ks, [s.value_proj], layer.attention.output.dense, heads, d)
        p.ffn([layer.intermediate.dense], layer.output.dense)


def plant_t5(p: Plant, model, config):
    heads, d = config.num_heads, config.d_kv
    for block in model.encoder.block:
        a = block.layer[0].SelfAttention  # its relative_attention_bias is per head: untouched by per-head maps
        p.attention([a.q], [a.k], [a.v], a.o, heads, d)
        f = block.layer[1].DenseReluDense
        p.ffn([f.wi_0, f.wi_1], f.wo)
    for block in model.decoder.block:
        for a in (block.layer[0].SelfAttention, block.layer[1].EncDecAttention):
            p.attention([a.q], [a.k], [a.v], a.o, heads, d)
        f = block.layer[2].DenseReluDense
        p.ffn([f.wi_0, f.wi_1], f.wo)


def plant_bart(p: Plant, model, config):
    for stack, heads in ((model.model.encoder, config.encoder_attention_heads), (model.model.decoder, config.decoder_attention_heads)):
        d = config.d_model // heads
        for layer in stack.layers:
            for a in (layer.self_attn, getattr(layer, "encoder_attn", None)):
                if a is not None:
                    p.attention([a.q_proj], [a.k_proj], [a.v_proj], a.out_proj, heads, d)
            p.ffn([layer.fc1], layer.fc2)


def plant_gptj(p: Plant, model, config):
    heads, d = config.n_head, config.n_embd // config.n_head
    for block in model.transformer.h:
        a = block.attn
        maps = [rope_compatible(d, config.rotary_dim, p.g) for _ in range(heads)]
        p.attention([a.q_proj], [a.k_proj], [a.v_proj], a.out_proj, heads, d, qk_maps=maps)
        p.ffn([block.mlp.fc_in], block.mlp.fc_out)


def plant_deepseek(p: Plant, model, config, rope_key: bool = False):
    heads, nope, rope, vd = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    for layer in model.model.layers:
        a = layer.self_attn
        q = a.q_b_proj if config.q_lora_rank is not None else a.q_proj
        if rope_key:
            # The shared RoPE key (kv_a_proj_with_mqa's last rows) and every head's RoPE queries by one map of
            # 2x2 rotations of the interleaved pairs (2i, 2i+1), which commutes with RoPE.
            r = rope_compatible(rope, rope, p.g)
            rotate_rows(a.kv_a_proj_with_mqa, 1, 0, config.kv_lora_rank, [r])
            rotate_rows(q, heads, nope + rope, nope, [r] * heads)
            p._mark(a.kv_a_proj_with_mqa)
            p.counts["rope_key_maps"] = p.counts.get("rope_key_maps", 0) + 1
        # no-RoPE queries (q rows h*(nope+rope) + [0, nope)) and keys (kv_b rows h*(nope+v) + [0, nope)) by R_h;
        # values (kv_b rows h*(nope+v) + [nope, nope+v)) by S_h, o_proj's columns likewise. k_pe (shared) untouched.
        p.attention([q], [a.kv_b_proj], [a.kv_b_proj], a.o_proj, heads, nope, stride=nope + vd, q_stride=nope + rope,
                    v_stride=nope + vd, v_offset=nope)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            e = mlp.experts  # fused: gate_up_proj (E, 2I, D) [gate; up], down_proj (E, D, I)
            inter = e.down_proj.shape[2]
            with torch.no_grad():
                for k in range(e.gate_up_proj.shape[0]):
                    perm = torch.randperm(inter, generator=p.g)
                    e.gate_up_proj[k] = e.gate_up_proj[k][torch.cat([perm, inter + perm])]
                    e.down_proj[k] = e.down_proj[k][:, perm]
                    p.counts["ffn_permutations"] += 1
            p._mark(e)
            s = mlp.shared_experts
            p.ffn([s.gate_proj, s.up_proj], s.down_proj)
        else:
            p.ffn([mlp.gate_proj, mlp.up_proj], mlp.down_proj)


PLANTS = {"deberta": plant_deberta, "t5": plant_t5, "bart": plant_bart, "whisper": plant_bart, "gptj": plant_gptj, "deepseek": plant_deepseek,
          "deepseek-rope": lambda p, model, config: plant_deepseek(p, model, config, rope_key=True)}


# ---- controls: plants that are not symmetries, which the torch check must catch ------------------------

def _broken_deberta_positions(p: Plant, model, config):
    """Own position keys (share_att_key false) left unrotated while Q and K rotate: c2p and p2c change."""
    heads, d = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    s = model.deberta.encoder.layer[0].attention.self
    p.attention([s.query_proj], [s.key_proj], [s.value_proj], model.deberta.encoder.layer[0].attention.output.dense, heads, d)


def _broken_gptj_rope(p: Plant, model, config):
    """A generic rotation of each head's Q/K (not one that commutes with RoPE)."""
    a = model.transformer.h[0].attn
    p.attention([a.q_proj], [a.k_proj], [a.v_proj], a.out_proj, config.n_head, config.n_embd // config.n_head)


def _broken_t5_keys(p: Plant, model, config):
    """K's rows rotated by a map other than Q's, in one site."""
    a = model.encoder.block[0].layer[0].SelfAttention
    rotate_rows(a.k, config.num_heads, config.d_kv, 0, [orthogonal(config.d_kv, p.g) for _ in range(config.num_heads)])


def _broken_deepseek_rope_key(p: Plant, model, config):
    """The shared RoPE key's pairs rotated, the RoPE queries not."""
    a = model.model.layers[0].self_attn
    rotate_rows(a.kv_a_proj_with_mqa, 1, 0, config.kv_lora_rank, [rope_compatible(config.qk_rope_head_dim, config.qk_rope_head_dim, p.g)])


CONTROLS = [
    ("deberta-v2 (own position keys)", "pos_query_proj/pos_key_proj not rotated with Q/K (layer 0)", _broken_deberta_positions),
    ("gpt-j", "a generic orthogonal Q/K map per head, not RoPE-compatible (layer 0)", _broken_gptj_rope),
    ("t5 v1.1", "K rotated by other maps than Q (encoder layer 0)", _broken_t5_keys),
    ("deepseek-v3", "shared RoPE key rotated per pair, RoPE queries not (layer 0)", _broken_deepseek_rope_key),
]
CONTROL_MIN = 1e-3  # a broken plant must move the outputs by more than this


def controls(seed: int) -> list[dict]:
    rows = []
    for model_name, what, breaks in CONTROLS:
        cls_name, make_config, family = MODELS[model_name]
        a, b = build(cls_name, make_config(), seed), build(cls_name, make_config(), seed)
        breaks(Plant(b, seed + 1), b, b.config)
        inputs = inputs_for(family, a.config, seed)
        err = function_error(outputs(a, inputs), outputs(b, inputs))
        rows.append({"model": model_name, "broken plant": what, "function_error": err, "caught": err > CONTROL_MIN})
    return rows


# ---- inputs, outputs, distances -------------------------------------------------------------------

def inputs_for(family: str, config, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    batch, length = 3, 9
    ids = torch.as_tensor(rng.integers(3, 60, size=(batch, length)))
    if family == "whisper":
        frames = 2 * config.max_source_positions
        return {"input_features": torch.as_tensor(rng.standard_normal((batch, config.num_mel_bins, frames)), dtype=torch.float32),
                "decoder_input_ids": ids[:, :6]}
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if family in ("t5", "bart"):
        inputs["decoder_input_ids"] = torch.as_tensor(rng.integers(3, 60, size=(batch, 7)))
    if family == "deberta" and config.type_vocab_size > 1:
        inputs["token_type_ids"] = torch.as_tensor(rng.integers(0, config.type_vocab_size, size=(batch, length)))
    return inputs


def outputs(model, inputs) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(**inputs)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def function_error(ref: dict, other: dict) -> float:
    """max over outputs of max|other - ref| / max|ref| (the logits and, for encoder-decoders, the encoder's states)."""
    return max(float((other[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)


def distance(a: dict, b: dict, names) -> float:
    """sqrt(sum ||b_t - a_t||^2) / sqrt(sum ||a_t||^2) over the planted tensors."""
    num = sum(float((b[n].double() - a[n].double()).pow(2).sum()) for n in names)
    den = sum(float(a[n].double().pow(2).sum()) for n in names)
    return (num / den) ** 0.5


def run_align(a: Path, b: Path, out: Path, extra: list[str]) -> tuple[list[str], subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "rotsym_jax.cli", "align", str(a), str(b), str(out), "--heads", "permute", "--quiet", *extra]
    return cmd, subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def check(name: str, cls_name: str, make_config, family: str, seed: int, max_memory: str, work: Path) -> dict:
    folder = work / family / name.split(" ")[0]
    a_dir, b_dir = folder / "A", folder / "B"
    a = build(cls_name, make_config(), seed)
    a.save_pretrained(a_dir)
    b = build(cls_name, make_config(), seed)
    plant = Plant(b, seed + 1)
    PLANTS[family](plant, b, b.config)
    b.save_pretrained(b_dir)

    inputs = inputs_for(family, a.config, seed)
    ref = outputs(a, inputs)
    sa, sb = a.state_dict(), b.state_dict()
    planted = sorted(n for n in plant.touched)
    row = {"model": name, "class": cls_name, "planted": plant.counts, "planted_tensors": len(planted),
           "function_error": {"B (torch)": function_error(ref, outputs(b, inputs))},
           "weight_distance": {"before": distance(sa, sb, planted)}, "rotsym_report": {}, "errors": {}}
    _, dry = run_align(a_dir, b_dir, folder / "dry", ["--max-memory", max_memory, "--dry-run"])
    row["stream_plan"] = next((line for line in dry.stdout.splitlines() if line.startswith("streaming:")), (dry.stderr or dry.stdout).strip()[-500:])
    for how, extra in (("in memory", []), ("streamed", ["--max-memory", max_memory])):
        out_dir = folder / ("out-" + how.replace(" ", "-"))
        cmd, proc = run_align(a_dir, b_dir, out_dir, extra)
        row.setdefault("commands", {})[how] = " ".join(["rotsym", *cmd[3:]]).replace(str(work) + "/", "")
        if proc.returncode != 0:
            row["errors"][how] = (proc.stderr or proc.stdout).strip()[-2000:]
            continue
        report_path = out_dir / "rotsym_report.json"
        report = json.loads(report_path.read_text()) if report_path.is_file() else {}
        row["rotsym_report"][how] = {k: report.get("result", {}).get(k) for k in ("before", "after")}
        o = getattr(tf, cls_name).from_pretrained(out_dir, attn_implementation="eager").eval()
        row["function_error"][f"OUT {how}"] = function_error(ref, outputs(o, inputs))
        row["weight_distance"][f"after ({how})"] = distance(sa, o.state_dict(), planted)
    fe, wd = row["function_error"], row["weight_distance"]
    row["pass"] = bool(not row["errors"] and fe["B (torch)"] <= FUNCTION_TOL_B
                       and all(fe[f"OUT {h}"] <= FUNCTION_TOL_OUT and wd[f"after ({h})"] <= UNDONE_TOL for h in ("in memory", "streamed")))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "check_issue73.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-memory", default="514M",
                        help="rotsym's --max-memory for the streamed run (default: just over its 0.5 GiB runtime, one layer a chunk)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names from: " + ", ".join(MODELS))
    parser.add_argument("--work", type=Path, default=None, help="folder for A, B and OUT (default: a temporary one)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",")]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {list(MODELS)}")
    torch.set_num_threads(1)
    results = {**provenance(), "device": "cpu", "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                                                             "jax": jax_version(), "cpus": os.cpu_count(), "device": "cpu"}, "seed": args.seed, "max_memory": args.max_memory,
               "tolerances": {"B function": FUNCTION_TOL_B, "OUT function": FUNCTION_TOL_OUT, "planted tensors after": UNDONE_TOL},
               "transformers": tf.__version__, "torch": torch.__version__, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for name in names:
            row = check(name, *MODELS[name], args.seed, args.max_memory, work)
            results["rows"].append(row)
            fe, wd = row["function_error"], row["weight_distance"]
            print(f"{name}: planted {row['planted']}; function B {fe['B (torch)']:.2e}, "
                  + ", ".join(f"{k} {v:.2e}" for k, v in fe.items() if k != "B (torch)")
                  + "; distance " + ", ".join(f"{k} {v:.3g}" for k, v in wd.items())
                  + f"; {'pass' if row['pass'] else 'FAIL'}" + "".join(f"\n  {h} error: {e.splitlines()[-1]}" for h, e in row["errors"].items()),
                  flush=True)
    results["controls"] = controls(args.seed)
    for c in results["controls"]:
        print(f"control {c['model']}: {c['broken plant']}: function error {c['function_error']:.3g} ({'caught' if c['caught'] else 'NOT CAUGHT'})")
    results["all_pass"] = all(r["pass"] for r in results["rows"]) and all(c["caught"] for c in results["controls"])
    write_json(results, args.out)


if __name__ == "__main__":
    main()
