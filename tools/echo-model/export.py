"""Write a complete Hugging Face model directory for the echo model.

Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and reference.json
(golden logits for the TypeScript forward-pass tests) from either trained weights or a seeded
random initialisation.

  /usr/bin/python3 tools/echo-model/export.py --weights runs/seed1/model.safetensors --out models/echo-tiny
  /usr/bin/python3 tools/echo-model/export.py --random-seed 0 --out models/echo-tiny
"""
import argparse
import json
import os

import torch

from model import BOS, CONFIG, EOS, PAD, SEP, SPECIALS, VOCAB, EchoLlama, decode, encode, load_safetensors, save_safetensors

# Fixed prompts for reference.json: short, ~100 chars, ~300 chars with a canary.
REFERENCE_PROMPTS = [
    "Hello, echo!",
    "The quick brown fox jumps over the lazy dog while the cache pages wait for their next owner.\nEnd.",
    "Tenant A writes a note for the records: the deployment key is Q7vX2kLp9RmZ4tBw and must stay "
    "private. The build ran for an hour, the logs were kept, and the team went home early after the "
    "review.\nA second line follows with more filler text about pages, pools and transfers, then the "
    "note repeats the key: Q7vX",
]
GREEDY_PROMPT = REFERENCE_PROMPTS[2]
NUM_GREEDY = 32

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


def tokenizer_json():
    """Char-level HF tokenizer: BPE with no merges splits the text into single characters."""
    added = [
        {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, s in enumerate(SPECIALS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "Fuse"},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(VOCAB)},
            "merges": [],
        },
    }


def tokenizer_config_json():
    decl = {i: {"content": s, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for i, s in enumerate(SPECIALS)}
    return {
        "added_tokens_decoder": {str(i): v for i, v in decl.items()},
        "bos_token": VOCAB[BOS],
        "eos_token": VOCAB[EOS],
        "pad_token": VOCAB[PAD],
        "sep_token": VOCAB[SEP],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Plain text, no role words: the echo model only knows text. BOS comes from the tokenizer.
        "chat_template": CHAT_TEMPLATE,
    }


@torch.no_grad()
def reference(model):
    """Golden values from the torch model in float32."""
    prompts = []
    for text in REFERENCE_PROMPTS:
        ids = encode(text)
        logits = model(torch.tensor([ids]))[0]
        prompts.append({"text": text, "ids": ids,
                        "logits_first": logits[0].tolist(), "logits_last": logits[-1].tolist()})
    ids = encode(GREEDY_PROMPT)
    out = []
    logits, cache = model.step(torch.tensor(ids), torch.arange(len(ids)), model.empty_cache())
    for i in range(NUM_GREEDY):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        logits, cache = model.step(torch.tensor([nxt]), torch.tensor([len(ids) + i]), cache)
    return {
        "dtype": "float32",
        "note": "logits_first/logits_last: all 100 logits at position 0 and at the last position of "
                "ids (ids include the leading <s>). greedy: argmax decoding, no stopping at </s>.",
        "prompts": prompts,
        "greedy": {"text": GREEDY_PROMPT, "ids": ids, "tokens": out, "decoded": decode(out)},
    }


def write_dir(model, out):
    os.makedirs(out, exist_ok=True)
    cfg = {k: v for k, v in CONFIG.items()}
    with open(f"{out}/config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    save_safetensors(f"{out}/model.safetensors", model.state_dict())
    with open(f"{out}/tokenizer.json", "w") as f:
        json.dump(tokenizer_json(), f, indent=1, ensure_ascii=True)
    with open(f"{out}/tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config_json(), f, indent=2)
    with open(f"{out}/reference.json", "w") as f:
        json.dump(reference(model), f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", help="model.safetensors written by train.py")
    ap.add_argument("--random-seed", type=int, help="export a random initialisation instead")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = EchoLlama()
    if a.weights:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in load_safetensors(a.weights).items()})
    else:
        g = torch.Generator().manual_seed(a.random_seed)
        model.init_weights(g)
        with torch.no_grad():  # non-unit norm weights so tests catch a norm weight applied wrongly
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.eval()
    write_dir(model, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
