"""Write the tiny random Hugging Face checkpoints under models/test/ that pin the forward pass to
HF semantics, one directory per architecture variant:

    config.json        as transformers would write it for that architecture
    model.safetensors  random weights (F32, BF16 or F16 storage), written byte by byte here
    reference.json     prompt ids, logits at every position from the torch reference below, and the
                       SHA-256 of every tensor as F32 (so a loader can prove BF16/F16 → F32 is exact)

The reference is an independent re-implementation of HF `modeling_llama.py` / `modeling_qwen2.py`
(transformers 4.4x) in float64 torch, except RoPE's inverse frequencies and angles, which HF
computes in float32 (`_compute_default_rope_parameters`, `_compute_llama3_parameters` in
`modeling_rope_utils.py`, then `inv_freq @ position_ids` in float32) and so does this.
Offline, deterministic (fixed seeds). Run with Debian's python3 (torch 1.13):

    /usr/bin/python3 tools/checkpoints/make.py [OUT_DIR=models/test]
"""
import hashlib
import json
import math
import os
import struct
import sys

import torch

F64 = torch.float64

# name → (config fields, storage dtype, prompt length). Small on purpose: the whole set stays
# a few hundred KB. Each variant exercises one thing the loader or forward pass must get right.
VARIANTS = {
    # Llama, GQA 4 query heads / 1 KV head, untied lm_head.
    "llama-gqa-4-1": (
        dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=1, vocab_size=48,
             max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False),
        "F32", 16),
    # Llama 3.1-style RoPE scaling; GQA 6/2 with head_dim 8 (6 × 8 = 48 ≠ hidden 32); BF16.
    # original_max_position_embeddings 32 puts the 4 frequency pairs in all three regimes
    # (wavelength < 8: kept; > 32: divided by factor; between: smoothed).
    "llama3-rope-bf16": (
        dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=2, head_dim=8, vocab_size=48,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=32),
             tie_word_embeddings=False),
        "BF16", 40),
    # Qwen2: q/k/v biases (no o_proj bias), 8/8 heads (plain MHA), tied embeddings; F16.
    "qwen2-bias-f16": (
        dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=8, vocab_size=48,
             max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
             tie_word_embeddings=True, use_sliding_window=False),
        "F16", 16),
    # SmolLM2-style: Llama with tied embeddings (no lm_head.weight in the file), heads 9/3.
    "smollm2-tied": (
        dict(model_type="llama", hidden_size=36, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=9, num_key_value_heads=3, vocab_size=48,
             max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=100000.0,
             tie_word_embeddings=True),
        "F32", 16),
    # Llama with attention_bias: biases on q, k, v and o_proj; 4/2 heads.
    "llama-attention-bias": (
        dict(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=48,
             max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
             attention_bias=True, tie_word_embeddings=False),
        "F32", 16),
}


def make_weights(cfg, gen):
    """Random weights by HF tensor name, float32, scaled so logits differ by O(1)."""
    d, ff, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H = cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads", H)
    hd = cfg.get("head_dim") or d // H
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    o_bias = cfg["model_type"] != "qwen2" and cfg.get("attention_bias", False)

    def randn(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    w = {"model.embed_tokens.weight": randn(V, d, std=0.5)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + randn(d, std=0.1)
        w[p + "self_attn.q_proj.weight"] = randn(H * hd, d, std=0.25)
        w[p + "self_attn.k_proj.weight"] = randn(KV * hd, d, std=0.25)
        w[p + "self_attn.v_proj.weight"] = randn(KV * hd, d, std=0.25)
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = randn(H * hd, std=0.2)
            w[p + "self_attn.k_proj.bias"] = randn(KV * hd, std=0.2)
            w[p + "self_attn.v_proj.bias"] = randn(KV * hd, std=0.2)
        w[p + "self_attn.o_proj.weight"] = randn(d, H * hd, std=0.2)
        if o_bias:
            w[p + "self_attn.o_proj.bias"] = randn(d, std=0.2)
        w[p + "post_attention_layernorm.weight"] = 1 + randn(d, std=0.1)
        w[p + "mlp.gate_proj.weight"] = randn(ff, d, std=0.2)
        w[p + "mlp.up_proj.weight"] = randn(ff, d, std=0.2)
        w[p + "mlp.down_proj.weight"] = randn(d, ff, std=0.15)
    w["model.norm.weight"] = 1 + randn(d, std=0.1)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = randn(V, d, std=0.2)
    return w


def round_to(w, dtype):
    """The weights as the file stores them: rounded to BF16/F16 (round to nearest even)."""
    if dtype == "F32":
        return dict(w)
    tdtype = torch.bfloat16 if dtype == "BF16" else torch.float16
    return {k: v.to(tdtype) for k, v in w.items()}


def write_safetensors(path, tensors, dtype):
    """safetensors format: u64 LE header length, JSON header, raw LE tensor bytes."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        if dtype == "BF16":
            raw = t.contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
        elif dtype == "F16":
            raw = t.contiguous().numpy().astype("<f2").tobytes()
        else:
            raw = t.contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def inv_freq_hf(cfg):
    """RoPE inverse frequencies exactly as HF computes them (float32)."""
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = cfg["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.get("rope_scaling")
    if rs is None:
        return inv
    assert rs["rope_type"] == "llama3"
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def reference_logits(cfg, w, ids):
    """Logits [n, vocab] for every position: HF Llama/Qwen2 semantics, float64 except RoPE tables."""
    d, V = cfg["hidden_size"], cfg["vocab_size"]
    H = cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads", H)
    hd = cfg.get("head_dim") or d // H
    eps = cfg["rms_norm_eps"]
    n = len(ids)
    W = {k: v.to(F64) for k, v in w.items()}

    def rmsnorm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def linear(x, name):
        y = x @ W[name + ".weight"].T
        return y + W[name + ".bias"] if name + ".bias" in W else y

    inv = inv_freq_hf(cfg)
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]  # float32, as HF
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(F64), emb.sin().to(F64)  # [n, hd]

    def rotate_half(x):
        return torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1)

    x = W["model.embed_tokens.weight"][torch.tensor(ids)]
    mask = torch.full((n, n), float("-inf"), dtype=F64).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rmsnorm(x, W[p + "input_layernorm.weight"])
        q = linear(h, p + "self_attn.q_proj").view(n, H, hd).transpose(0, 1)  # [H, n, hd]
        k = linear(h, p + "self_attn.k_proj").view(n, KV, hd).transpose(0, 1)
        v = linear(h, p + "self_attn.v_proj").view(n, KV, hd).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=0)  # HF repeat_kv: query head j uses KV head j // (H/KV)
        v = v.repeat_interleave(H // KV, dim=0)
        scores = q @ k.transpose(1, 2) / math.sqrt(hd) + mask
        attn = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, H * hd)
        x = x + linear(attn, p + "self_attn.o_proj")
        h = rmsnorm(x, W[p + "post_attention_layernorm.weight"])
        gate = linear(h, p + "mlp.gate_proj")
        x = x + linear(torch.nn.functional.silu(gate) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rmsnorm(x, W["model.norm.weight"])
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return x @ head.T


def main():
    out_root = sys.argv[1] if len(sys.argv) > 1 else os.path.join("models", "test")
    for index, (name, (cfg, dtype, prompt_len)) in enumerate(VARIANTS.items()):
        gen = torch.Generator().manual_seed(1000 + index)
        stored = round_to(make_weights(cfg, gen), dtype)
        if dtype == "F16":
            # F16 subnormals and the smallest normal, in an embedding row no prompt uses.
            row = stored["model.embed_tokens.weight"][cfg["vocab_size"] - 1]
            row[:4] = torch.tensor([6e-8, -1e-5, 2.0 ** -14, 3e-7], dtype=torch.float16)
        as_f32 = {k: v.to(torch.float32) for k, v in stored.items()}
        ids = torch.randint(0, cfg["vocab_size"] - 1, (prompt_len,), generator=gen).tolist()
        logits = reference_logits(cfg, as_f32, ids)
        d = os.path.join(out_root, name)
        os.makedirs(d, exist_ok=True)
        config = dict(cfg, architectures=["Qwen2ForCausalLM" if cfg["model_type"] == "qwen2" else "LlamaForCausalLM"],
                      hidden_act="silu", torch_dtype={"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[dtype])
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        write_safetensors(os.path.join(d, "model.safetensors"), stored, dtype)
        reference = {
            "source": "tools/checkpoints/make.py (float64 torch re-implementation of HF Llama/Qwen2)",
            "storage_dtype": dtype,
            "ids": ids,
            "tensors_f32_sha256": {
                k: hashlib.sha256(v.contiguous().numpy().astype("<f4").tobytes()).hexdigest()
                for k, v in as_f32.items()
            },
            "logits": [[round(float(a), 7) for a in row] for row in logits],
        }
        with open(os.path.join(d, "reference.json"), "w") as f:
            json.dump(reference, f, separators=(",", ":"))
            f.write("\n")
        print(f"{name}: {dtype}, {sum(v.numel() for v in stored.values())} parameters, "
              f"logits range [{logits.min():.3f}, {logits.max():.3f}]")


if __name__ == "__main__":
    main()
