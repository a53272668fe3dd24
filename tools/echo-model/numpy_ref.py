"""Independent numpy forward pass of the HF Llama model, checked against reference.json.

Shares nothing with model.py but the file formats, so that it is a second witness for the golden
logits the TypeScript tests use.

  /usr/bin/python3 tools/echo-model/numpy_ref.py models/echo-tiny
"""
import json
import struct
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n).decode())
        data = f.read()
    return {k: np.frombuffer(data[m["data_offsets"][0]:m["data_offsets"][1]], "<f4").reshape(m["shape"])
            for k, m in header.items() if k != "__metadata__"}


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """x: [T, heads, hd]; non-interleaved: the pair (i, i + hd/2) rotates by pos * theta^(-2i/hd)."""
    hd = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, hd, 2) / hd)  # [T, hd/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def forward(w, cfg, ids):
    """ids: list of T token ids -> logits [T, vocab] (float64 accumulation)."""
    T, nh, nkv, hd = len(ids), cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    W = {k: v.astype(np.float64) for k, v in w.items()}
    emb = W["model.embed_tokens.weight"]
    x = emb[ids]
    pos = np.arange(T, dtype=np.float64)
    causal = np.tril(np.ones((T, T), dtype=bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, W[p + "input_layernorm.weight"], eps)
        q = rope((h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd), pos, theta)
        k = rope((h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd), pos, theta)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
        out = np.zeros((T, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)  # grouped-query attention
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(T, nh * hd) @ W[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, W[p + "post_attention_layernorm.weight"], eps)
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ W[p + "mlp.down_proj.weight"].T
    return rms_norm(x, W["model.norm.weight"], eps) @ emb.T  # tied lm_head


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "models/echo-tiny"
    cfg = json.load(open(f"{d}/config.json"))
    ref = json.load(open(f"{d}/reference.json"))
    w = read_safetensors(f"{d}/model.safetensors")
    worst = 0.0
    for p in ref["prompts"]:
        logits = forward(w, cfg, p["ids"])
        for key, row in (("logits_first", 0), ("logits_last", -1)):
            diff = float(np.abs(logits[row] - np.array(p[key])).max())
            worst = max(worst, diff)
            print(f"len {len(p['ids']):4d} {key:12s} max abs diff {diff:.3e}")
    g = ref["greedy"]
    ids = list(g["ids"])
    for _ in range(len(g["tokens"])):
        ids.append(int(forward(w, cfg, ids)[-1].argmax()))
    same = ids[len(g["ids"]):] == g["tokens"]
    print(f"greedy {len(g['tokens'])} tokens identical: {same}")
    print(f"max abs diff over all reference logits: {worst:.3e}")
    sys.exit(0 if worst <= 1e-4 and same else 1)


if __name__ == "__main__":
    main()
