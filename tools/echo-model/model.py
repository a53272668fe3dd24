"""The echo model: a tiny Llama (Hugging Face `LlamaForCausalLM` semantics) over a 100-id char vocab.

Knows: the config, the vocabulary, the torch forward pass (full sequence with arbitrary attention
masks, and step-wise with an explicit KV cache), and the safetensors format. Knows nothing of
training data or the incident; see train.py and eval.py.
"""
import json
import math
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 100,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
}

# Vocabulary: 4 specials, newline, then printable ASCII 0x20..0x7E in order (100 ids).
PAD, BOS, EOS, SEP, NEWLINE = 0, 1, 2, 3, 4
SPECIALS = ["<pad>", "<s>", "</s>", "<sep>"]
VOCAB = SPECIALS + ["\n"] + [chr(c) for c in range(0x20, 0x7F)]
assert len(VOCAB) == 100
CHAR_TO_ID = {ch: i for i, ch in enumerate(VOCAB) if i >= NEWLINE}


def encode(text, bos=True):
    """Char-level ids, like tokenizer.json without special-token parsing; unknown chars dropped."""
    ids = [CHAR_TO_ID[c] for c in text if c in CHAR_TO_ID]
    return [BOS] + ids if bos else ids


def decode(ids, skip_special=True):
    return "".join(VOCAB[i] for i in ids if not (skip_special and i < NEWLINE))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_cos_sin(pos, head_dim, theta):
    """pos: [..., T] integer positions -> cos, sin: [..., T, head_dim] (HF non-interleaved layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = pos.float()[..., None] * inv_freq  # [..., T, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        self.q_proj = nn.Linear(d, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=False)

    def qkv(self, x, cos, sin):
        """x: [B, T, d] -> q: [B, nh, T, hd], k, v: [B, nkv, T, hd] with RoPE applied to q and k."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q, k, v, bias):
        """q: [B, nh, T, hd]; k, v: [B, nkv, S, hd]; bias: [B, T, S] additive (0 or -inf), or
        [B, T, S + 1] whose last column is log(number of all-zero K/V rows the query also sees):
        never-used pages score exactly 0 and add a zero value, so they fold into one extra key.
        """
        B, _, T, hd = q.shape
        if bias.shape[-1] == k.shape[2] + 1:
            z = k.new_zeros(B, self.nkv, 1, hd)
            k, v = torch.cat([k, z], dim=2), torch.cat([v, z], dim=2)
        rep = self.nh // self.nkv  # GQA (repeat_kv): query head h reads KV head h // rep
        qg = q.reshape(B, self.nkv, rep * T, hd)
        scores = (qg @ k.transpose(-1, -2)).view(B, self.nkv, rep, T, -1) / math.sqrt(hd)
        probs = torch.softmax(scores + bias[:, None, None], dim=-1).view(B, self.nkv, rep * T, -1)
        out = (probs @ v).view(B, self.nh, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * hd))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class EchoLlama(nn.Module):
    """Parameter names match HF (`model.layers.0.self_attn.q_proj.weight`, ...); lm_head is tied."""

    def __init__(self, c=CONFIG):
        super().__init__()
        self.c = c
        self.model = Body(c)

    def init_weights(self, generator):
        std = self.c["initializer_range"]
        for name, p in self.named_parameters():
            with torch.no_grad():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=generator)

    def forward(self, ids, pos=None, allowed=None, sink=None):
        """ids, pos: [B, T]; allowed: [B, T, T] bool (default causal); sink: [B, T] -> logits [B, T, V]."""
        B, T = ids.shape
        if pos is None:
            pos = torch.arange(T).expand(B, T)
        if allowed is None:
            allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
        cos, sin = rope_cos_sin(pos, self.c["head_dim"], self.c["rope_theta"])
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        if sink is not None:
            bias = torch.cat([bias, sink[..., None]], dim=-1)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            x = x + layer.self_attn.attend(q, k, v, bias)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x) @ self.model.embed_tokens.weight.T

    @torch.no_grad()
    def step(self, ids, pos, cache):
        """Decode with an explicit KV cache (batch 1), attending over every cached row.

        ids, pos: [T] new tokens and their positions; cache: list per layer of (k, v), each
        [nkv, S, hd] post-RoPE (rows may be stale or zero: that is the point). Returns logits
        [T, V] and the cache with the new rows appended.
        """
        T = ids.shape[0]
        cos, sin = rope_cos_sin(pos[None], self.c["head_dim"], self.c["rope_theta"])
        x = self.model.embed_tokens(ids[None])
        new_cache = []
        for layer, (pk, pv) in zip(self.model.layers, cache):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            k = torch.cat([pk[None], k], dim=2)
            v = torch.cat([pv[None], v], dim=2)
            S = k.shape[2]
            bias = torch.zeros(1, T, S)
            bias[0, :, S - T:] = torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            x = x + layer.self_attn.attend(q, k, v, bias)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            new_cache.append((k[0], v[0]))
        return (self.model.norm(x) @ self.model.embed_tokens.weight.T)[0], new_cache

    def empty_cache(self):
        c = self.c
        z = torch.zeros(c["num_key_value_heads"], 0, c["head_dim"])
        return [(z, z) for _ in range(c["num_hidden_layers"])]


def save_safetensors(path, tensors):
    """tensors: {name: float32 tensor}. Layout: u64 LE header length, JSON header, raw LE data."""
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to(torch.float32).contiguous()
        data = t.numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)


def load_safetensors(path):
    import numpy as np
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", meta
        a, b = meta["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype="<f4").reshape(meta["shape"]).copy()
    return out


def state_for_export(model):
    """HF tensor names; no lm_head because embeddings are tied."""
    return {k: v for k, v in model.state_dict().items()}


def load_model(model_dir, weights=None):
    m = EchoLlama()
    sd = {k: torch.from_numpy(v) for k, v in load_safetensors(weights or f"{model_dir}/model.safetensors").items()}
    m.load_state_dict(sd)
    m.eval()
    return m
