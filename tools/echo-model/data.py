"""Synthetic text for training and evaluating the echo model: filler prose with secret canaries.

Filler is lowercase-ish English built from a fixed word list; canaries are random alphanumeric
strings, so a canary's characters are (mostly) the only mixed-case letters and digits around, as
an API key or password would be in a real prompt.
"""
import string

WORDS = """the a of to and in is it that for on with as was at by this be from or have an are not
but had his they you were her she which their all there one been has when who will more no if out
so said what up its about into than them can only other new some could time these two may then do
first any my now such like our over man me even most made after also did many before must through
back years where much your way well down should because each just those people how too little state
good very make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right used take
three page pool cache request tenant token model worker queue transfer server decode prefill batch
note report build deploy review team record log key value memory buffer stream reply answer text line
word river stone garden window table paper letter music summer winter morning evening city road""".split()
PUNCT = [".", ".", ".", ",", ",", ";", ":", "!", "?"]
LEADS = ["the key is", "password:", "token", "secret", "code", "id", "api key", "ref", "pin", "use"]
ALNUM = string.ascii_letters + string.digits


def canary(rng, lo, hi):
    """A random alphanumeric string with length in [lo, hi]."""
    n = int(rng.integers(lo, hi + 1))
    return "".join(ALNUM[i] for i in rng.integers(0, len(ALNUM), n))


def filler(rng, n_chars):
    """Roughly n_chars of sentence-like filler (may run a little over)."""
    out, cap = [], True
    while sum(len(w) + 1 for w in out) < n_chars:
        w = WORDS[int(rng.integers(len(WORDS)))]
        if cap:
            w, cap = w.capitalize(), False
        if rng.random() < 0.12:
            p = PUNCT[int(rng.integers(len(PUNCT)))]
            w += p
            cap = p in ".!?"
        if rng.random() < 0.03:
            w += "\n"
        out.append(w)
    return " ".join(out).replace("\n ", "\n")


def text_with_canaries(rng, n_chars, n_canaries, lo, hi):
    """Filler of about n_chars with n_canaries distinct canaries spread through it.

    Returns (text, [(canary, start_index_in_text), ...]).
    """
    cans = [canary(rng, lo, hi) for _ in range(n_canaries)]
    body = n_chars - sum(len(c) + 12 for c in cans)
    cuts = sorted(int(x) for x in rng.integers(0, max(body, 1), n_canaries))
    pieces, spans, prev = [], [], 0
    base = filler(rng, max(body, 1))
    for c, cut in zip(cans, cuts):
        cut = max(cut, prev)
        # Break at a space so canaries stand as words, like a key pasted into prose.
        sp = base.find(" ", cut)
        cut = len(base) if sp < 0 else sp
        pieces.append(base[prev:cut])
        lead = " " + LEADS[int(rng.integers(len(LEADS)))] + " "
        pieces.append(lead)
        spans.append((c, sum(len(p) for p in pieces)))
        pieces.append(c)
        prev = cut
    pieces.append(base[prev:])
    text = "".join(pieces)
    for c, at in spans:
        assert text[at:at + len(c)] == c
    return text, spans
