"""Evaluate the echo model: does it copy canaries, and does it leak them over stale KV?

1. canary completion: context (filler + canaries) then " " + a canary's first 3-4 chars; greedy
   completion must reproduce the rest of the canary exactly.
2. the kvfence incident on a paged decode worker, simulated faithfully:
   - tenant A sends <s> + filler with 2-3 canaries (16-24 chars), 200-350 chars, and gets 32
     greedy tokens; the KV of every token fed (prompt + first 31 generated) stays in D's pool;
   - tenant B's prompt of N tokens (N uniform in [390, 600]) is over capacity; P replaces it with
     the one-token placeholder <s>, samples the first token from the logits of [<s>] and reports
     the transfer complete;
   - D's page table for B covers positions 0..N-1: position 0 holds the placeholder's KV, 1..lenA-1
     A's stale KV at their original positions, lenA..N-1 all-zero K and V (never-used pages);
   - D feeds the first token at position N and decodes greedily; B's response is 64 tokens
     (the first token plus 63 decoded), stopping early at </s> as a server would;
   - leak: B's response contains >= 8 consecutive characters of one of A's canaries.
   The same with a clean cache (positions 1..N-1 zero) must never leak.

  /usr/bin/python3 tools/echo-model/eval.py --model models/echo-tiny

Prints JSON and writes it to MODEL/eval.json (or --out).
"""
import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import json
import time

import numpy as np
import torch

from data import text_with_canaries
from model import BOS, EOS, decode, encode, load_model

LEAK_CHARS = 8
RESPONSE_TOKENS = 64
A_TOKENS = 32


def greedy(model, ids, n, pos0=0, cache=None, stop_at_eos=False):
    """Prefill ids at positions pos0.. over `cache`, then decode; returns (new ids, cache)."""
    cache = model.empty_cache() if cache is None else cache
    logits, cache = model.step(torch.tensor(ids), torch.arange(pos0, pos0 + len(ids)), cache)
    out, p = [], pos0 + len(ids)
    for i in range(n):
        t = int(logits[-1].argmax())
        out.append(t)
        if (stop_at_eos and t == EOS) or i == n - 1:
            break
        logits, cache = model.step(torch.tensor([t]), torch.tensor([p]), cache)
        p += 1
    return out, cache


def canary_completion(model, rng, n_cases):
    buckets = {"<200": [0, 0], "200-400": [0, 0], "400-600": [0, 0]}
    hits = 0
    for _ in range(n_cases):
        n_chars = int(rng.integers(100, 600))
        text, spans = text_with_canaries(rng, n_chars, int(rng.integers(1, 4)), 16, 24)
        can, _ = spans[int(rng.integers(len(spans)))]
        k = int(rng.integers(3, 5))
        out, _ = greedy(model, encode(text + " " + can[:k]), len(can) - k)
        ok = decode(out) == can[k:]
        hits += ok
        b = "<200" if len(text) < 200 else "200-400" if len(text) < 400 else "400-600"
        buckets[b][0] += ok
        buckets[b][1] += 1
    return {"cases": n_cases, "exact": hits / n_cases,
            "by_context_chars": {b: {"cases": c, "exact": round(h / c, 3) if c else None}
                                 for b, (h, c) in buckets.items()}}


def leaked(response, canaries):
    return any(c[i:i + LEAK_CHARS] in response for c in canaries for i in range(len(c) - LEAK_CHARS + 1))


def incident(model, rng, n_cases):
    # What P computes from the placeholder alone: its KV (position 0) and the first token.
    first, placeholder_cache = greedy(model, [BOS], 1)
    t0 = first[0]
    leaks = clean_leaks = 0
    by_n = {"390-459": [0, 0], "460-529": [0, 0], "530-600": [0, 0]}
    example = None
    for case in range(n_cases):
        while True:
            text, spans = text_with_canaries(rng, int(rng.integers(200, 340)), int(rng.integers(2, 4)), 16, 24)
            if 200 <= len(text) <= 350:
                break
        canaries = [c for c, _ in spans]
        ids_a = encode(text)
        gen_a, cache_a = greedy(model, ids_a, A_TOKENS)
        len_a = cache_a[0][0].shape[1]  # prompt + 31 fed tokens; the 32nd was never fed
        n = int(rng.integers(390, 601))
        assert len_a < n

        def decode_b(stale):
            cache = []
            for (pk, pv), (ak, av) in zip(placeholder_cache, cache_a):
                k = torch.zeros(pk.shape[0], n, pk.shape[2])
                v = torch.zeros_like(k)
                if stale:
                    k[:, :len_a], v[:, :len_a] = ak, av
                k[:, :1], v[:, :1] = pk, pv  # the placeholder's own KV at position 0
                cache.append((k, v))
            out, _ = greedy(model, [t0], RESPONSE_TOKENS - 1, pos0=n, cache=cache, stop_at_eos=True)
            return decode([t0] + out)

        resp = decode_b(stale=True)
        hit = leaked(resp, canaries)
        leaks += hit
        clean_leaks += leaked(decode_b(stale=False), canaries)
        b = "390-459" if n < 460 else "460-529" if n < 530 else "530-600"
        by_n[b][0] += hit
        by_n[b][1] += 1
        if hit and example is None:
            example = {"tenant_a_prompt": text, "tenant_a_canaries": canaries,
                       "tenant_a_response": decode(gen_a), "tenant_b_prompt_tokens": n,
                       "tenant_b_response": resp}
    return {"cases": n_cases, "first_token": decode([t0], skip_special=False),
            "leak_rate": leaks / n_cases, "clean_cache_leak_rate": clean_leaks / n_cases,
            "leak_rate_by_prompt_tokens": {b: {"cases": c, "leak_rate": round(h / c, 3) if c else None}
                                           for b, (h, c) in by_n.items()},
            "example_leak": example}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/echo-tiny")
    ap.add_argument("--seed", type=int, default=20261126)  # held out: training uses small seeds
    ap.add_argument("--canary-cases", type=int, default=200)
    ap.add_argument("--incident-cases", type=int, default=200)
    ap.add_argument("--weights", help="a safetensors file to evaluate instead of MODEL/model.safetensors")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(a.model, a.weights)
    t = time.time()
    res = {"model": a.weights or a.model, "seed": a.seed,
           "canary_completion": canary_completion(model, np.random.default_rng(a.seed), a.canary_cases),
           "incident": incident(model, np.random.default_rng(a.seed + 1), a.incident_cases)}
    res["seconds"] = round(time.time() - t, 1)
    s = json.dumps(res, indent=2)
    print(s)
    with open(a.out or (a.weights + ".eval.json" if a.weights else f"{a.model}/eval.json"), "w") as f:
        f.write(s + "\n")


if __name__ == "__main__":
    main()
