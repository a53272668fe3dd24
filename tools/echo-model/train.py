"""Train the echo model: a 2-layer Llama that copies text (and canaries) out of whatever KV it sees.

Curriculum (each phase measured to matter, see the project's shared STACK.md):
  1. previous-token: predict the token before the current one, which builds a previous-token head;
  2. induction: a random string of random period (8-48) repeated to the end of the sequence
     (or, --induction offset, repeated once at a random offset) until the loss < 0.3 or 800 steps;
  3. branches: one tenant-like context (filler + canaries, no loss) followed by independent
     branches that see only the context and themselves (attention mask), like separate requests
     over shared stale KV. 70 % start with a restart token (BOS or newline) then copy a context
     canary and what follows it; 30 % give a canary's first 3-4 chars then its rest. Branches
     start at RoPE position = context length, at a random position in [0, C + 256], or beyond a
     run of all-zero K/V rows (never-used pages) in [C, C + 400]. Length 256, then 512.

  /usr/bin/python3 tools/echo-model/train.py --seed 3 --out /tmp/echo-runs/seed3

Writes OUT/model.safetensors and OUT/train.log. Single thread, fixed seeds: reruns are identical.
"""
import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before torch loads OpenBLAS: 2 shared cores
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from data import text_with_canaries
from model import BOS, NEWLINE, EchoLlama, encode, save_safetensors

IGNORE = -100
FIRST_CHAR = NEWLINE  # ids 4..99 are the ordinary characters


def prev_token_batch(rng, B, L):
    """Random chars; the target at t is the input at t - 1."""
    x = rng.integers(FIRST_CHAR, 100, (B, L))
    y = np.full((B, L), IGNORE)
    y[:, 1:] = x[:, :-1]
    return x, None, None, None, y


def induction_batch(rng, B, L):
    """<s> noise r noise r, r random with random length and offset: the second copy is
    predictable only by content-based induction (a fixed offset would let RoPE learn a
    relative-position shortcut that does not transfer to copying from a context)."""
    x = rng.integers(FIRST_CHAR, 100, (B, L))
    x[:, 0] = BOS
    y = np.full((B, L), IGNORE)
    for i in range(B):
        n = int(rng.integers(16, (L - 1) // 2 + 1))
        first = int(rng.integers(1, L - 2 * n + 1))
        second = int(rng.integers(first + n, L - n + 1))
        x[i, second:second + n] = x[i, first:first + n]
        y[i, second:second + n - 1] = x[i, second + 1:second + n]
    return x, None, None, None, y


def periodic_batch(rng, B, L):
    """<s> r r r ... with r random of length 8-48: every earlier occurrence of the current char
    points at the right next char (no ambiguity, strong signal), and the period varies so only
    content-based induction works."""
    x = np.empty((B, L), dtype=np.int64)
    x[:, 0] = BOS
    y = np.full((B, L), IGNORE)
    for i in range(B):
        p = int(rng.integers(8, 49))
        r = rng.integers(FIRST_CHAR, 100, p)
        x[i, 1:] = np.tile(r, (L - 1) // p + 1)[:L - 1]
        y[i, p + 1:-1] = x[i, p + 2:]  # from the first repeat on
    return x, None, None, None, y


def branches_sample(rng, L):
    """One sequence of length L: context then branches. Returns ids, pos, allowed, sink, target."""
    ctx_chars = int(rng.integers(int(L * 0.3), int(L * 0.72)))
    text, spans = text_with_canaries(rng, ctx_chars, int(rng.integers(1, 4)), 12, 32)
    ctx = encode(text)  # <s> + chars; span indices shift by 1 for the <s>
    C = len(ctx)
    ids, pos = list(ctx), list(range(C))
    sink = [-math.inf] * C  # -inf: no zero rows seen
    target = [IGNORE] * C
    allowed = np.zeros((L, L), dtype=bool)
    allowed[:C, :C] = np.tril(np.ones((C, C), dtype=bool))
    while len(ids) < L:
        can, at = spans[int(rng.integers(len(spans)))]
        at += 1
        blen = min(L - len(ids), len(can) + int(rng.integers(4, 24)))
        if blen < 6:
            break
        if rng.random() < 0.7:
            # restart token, then the canary and what follows it: b[j] predicts ctx[at + j]
            b, shift, first_loss = [BOS if rng.random() < 0.5 else NEWLINE] + ctx[at:at + blen - 1], 0, 0
        else:
            # the canary's first k chars given, the rest predicted: b[j] predicts ctx[at + j + 1]
            b, shift, first_loss = ctx[at:at + blen], 1, int(rng.integers(3, 5)) - 1
        u = rng.random()
        gap = 0.0
        if u < 0.5:
            start = C
        elif u < 0.7:
            start = int(rng.integers(0, C + 257))
        else:
            start = int(rng.integers(C, C + 401))
            gap = float(start - C)
        s = len(ids)
        n = len(b)
        ids += b
        pos += list(range(start, start + n))
        sink += [math.log(gap) if gap >= 1 else -math.inf] * n
        t = [IGNORE] * n
        for j in range(first_loss, n):
            if at + j + shift < C:
                t[j] = ctx[at + j + shift]
        target += t
        allowed[s:s + n, :C] = True
        allowed[s:s + n, s:s + n] = np.tril(np.ones((n, n), dtype=bool))
    n = len(ids)
    if n < L:  # pad: padding attends to itself only and carries no loss
        ids += [0] * (L - n)
        pos += [0] * (L - n)
        sink += [-math.inf] * (L - n)
        target += [IGNORE] * (L - n)
        allowed[np.arange(n, L), np.arange(n, L)] = True
    return ids, pos, allowed, sink, target


def branches_batch(rng, B, L):
    rows = [branches_sample(rng, L) for _ in range(B)]
    ids, pos, allowed, sink, target = zip(*rows)
    return np.array(ids), np.array(pos), np.stack(allowed), np.array(sink, dtype=np.float32), np.array(target)


def to_torch(batch):
    ids, pos, allowed, sink, y = batch
    t = lambda a, dt: None if a is None else torch.from_numpy(np.asarray(a)).to(dt)
    return t(ids, torch.long), t(pos, torch.long), t(allowed, torch.bool), t(sink, torch.float32), t(y, torch.long)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--early-lr", type=float, help="lr of phases 1-2 (default: --lr)")
    ap.add_argument("--prev-steps", type=int, default=150)
    ap.add_argument("--induction-max", type=int, default=800)
    ap.add_argument("--branch-steps", type=int, default=1000)
    ap.add_argument("--long-len", type=int, default=512, help="second-half sequence length")
    ap.add_argument("--induction", choices=["offset", "periodic"], default="periodic",
                    help="periodic escaped the plateau here; offset sat at ~4.4 for 800 steps")
    ap.add_argument("--batch", type=int, default=16, help="batch of phases 1-2")
    ap.add_argument("--branch-batch", type=int, default=12, help="branches batch at 256; halved at --long-len")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)  # 2 shared cores; a second thread gave only ~1.2x
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    model = EchoLlama()
    model.init_weights(torch.Generator().manual_seed(a.seed))
    nparams = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    log = open(f"{a.out}/train.log", "w")
    t0 = time.time()

    def say(msg):
        line = f"[{time.time() - t0:7.1f}s] {msg}"
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    say(f"seed {a.seed} params {nparams}")
    step = 0

    def train_step(batch, lr):
        nonlocal step
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50)  # warmup 50 steps
        ids, pos, allowed, sink, y = to_torch(batch)
        logits = model(ids, pos, allowed, sink)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        return loss.item()

    for i in range(a.prev_steps):
        loss = train_step(prev_token_batch(rng, a.batch, 128), a.early_lr or a.lr)
        if i % 50 == 0 or i == a.prev_steps - 1:
            say(f"prev-token step {i} loss {loss:.3f}")

    ema = None
    for i in range(a.induction_max):
        loss = train_step((periodic_batch if a.induction == "periodic" else induction_batch)(rng, a.batch, 256), a.early_lr or a.lr)
        ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        if i % 50 == 0:
            say(f"induction step {i} loss {loss:.3f} ema {ema:.3f}")
        if ema < 0.3:
            say(f"induction done at step {i} loss {loss:.3f} ema {ema:.3f}")
            break

    n = a.branch_steps
    switch = int(0.55 * n)
    for i in range(n):
        lr = a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / n)))  # cosine to 0.1x
        L = 256 if i < switch else a.long_len
        batch = branches_batch(rng, a.branch_batch if i < switch else a.branch_batch // 2, L)
        loss = train_step(batch, lr)
        avg = loss if i == 0 else 0.95 * avg + 0.05 * loss
        if i % 50 == 0 or i == n - 1:
            say(f"branches step {i} len {L} lr {lr:.2e} loss {loss:.3f} avg {avg:.3f}")
        if i % 100 == 99:  # checkpoints, in case time runs out
            save_safetensors(f"{a.out}/step{i + 1}.safetensors", model.state_dict())

    save_safetensors(f"{a.out}/model.safetensors", model.state_dict())
    with open(f"{a.out}/train.json", "w") as f:
        json.dump({"seed": a.seed, "params": nparams, "steps": step, "seconds": round(time.time() - t0, 1),
                   "args": vars(a)}, f, indent=2)
    say(f"saved {a.out}/model.safetensors after {step} steps")


if __name__ == "__main__":
    main()
