/** Tokenizer and chat template of a Hugging Face model directory (`tokenizer.json`,
 *  `tokenizer_config.json`), wrapped behind the few calls kvfence needs.
 *  Knows text and token ids; knows nothing of HTTP, tenants, pools or the model's weights. */
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { Tokenizer as HfTokenizer } from '@huggingface/tokenizers'
import { Template } from '@huggingface/jinja'
import { KvfenceError } from '../common/errors.js'

/** One chat message as the chat template sees it (content already flattened to text). */
export interface ChatMessage {
  role: string
  content: string
  /** The participant's name (OpenAI's `name`), passed to the template as `message.name`. */
  name?: string
}

/** Options of {@link Tokenizer.encode}. */
export interface EncodeOptions {
  /** Add BOS/EOS as `tokenizer_config.json` says (default true). False encodes the text alone. */
  addSpecialTokens?: boolean
}

/** Options of {@link Tokenizer.decode}. */
export interface DecodeOptions {
  /** Drop special tokens (`<s>`, `</s>`, ...) from the text (default true, as vLLM's output). */
  skipSpecialTokens?: boolean
}

/** A loaded tokenizer. Immutable; safe to share between requests. */
export interface Tokenizer {
  /** Token ids of `text`; with special tokens (default), BOS first when `add_bos_token` says so. */
  encode(text: string, options?: EncodeOptions): number[]
  /** Text of `ids`. */
  decode(ids: readonly number[], options?: DecodeOptions): string
  /** The prompt text the model's chat template renders for `messages`, with the generation
   *  prompt appended. Throws `invalid_request` (param `messages`) when the model has no chat
   *  template or the template rejects the conversation. */
  applyChatTemplate(messages: readonly ChatMessage[]): string
  /** Id of the beginning-of-sequence token, or null when the model has none. */
  readonly bosTokenId: number | null
  /** Id of the end-of-sequence token, or null when the model has none. */
  readonly eosTokenId: number | null
  /** Text of the BOS token (e.g. `<s>`), or null. */
  readonly bosToken: string | null
  /** Text of the EOS token (e.g. `</s>`), or null. */
  readonly eosToken: string | null
  /** Number of token ids (largest id + 1). */
  readonly vocabSize: number
  /** Length (UTF-16 code units) of the longest vocabulary entry, added tokens included: no token
   *  stands for more text than that, before normalization. */
  readonly maxTokenChars: number
  /** The first character of `text` its tokens cannot give back — `decode(encode(text))` compared
   *  with `text` after the tokenizer's own normalizer, whitespace aside (decoders legitimately
   *  strip or merge it) — or null when nothing is lost. Always null for a byte-level or
   *  byte-fallback tokenizer, which represents any text. */
  firstLostCharacter(text: string): string | null
  /** {@link encode}'s ids of `text` and {@link firstLostCharacter}'s answer for it, from one
   *  encoding of the text where the tokenizer allows (the special tokens added around the text
   *  are then the ones `encode` adds); a tokenizer that represents any text is not checked. */
  encodeChecked(text: string, options?: EncodeOptions): CheckedEncoding
}

/** What {@link Tokenizer.encodeChecked} returns. */
export interface CheckedEncoding {
  /** As {@link Tokenizer.encode} gives them. */
  ids: number[]
  /** As {@link Tokenizer.firstLostCharacter} gives it. */
  lost: string | null
}

/** `invalid_request` (param `param`) for text the tokenizer would silently drop characters of:
 *  names the first character lost and its code point. */
export function unrepresentableTextError(lost: string, param: string): KvfenceError {
  const codePoint = lost.codePointAt(0)!.toString(16).toUpperCase().padStart(4, '0')
  return new KvfenceError(
    'invalid_request',
    `${param} holds characters this model's tokenizer cannot represent (the first: ${JSON.stringify(lost)}, U+${codePoint}); they would be dropped from the prompt`,
    param,
  )
}

// ---------------------------------------------------------------------------------------------
// Loading

/** Loads `tokenizer.json` and `tokenizer_config.json` from a model directory.
 *  Throws `internal_error` naming the file when one is missing or not a valid tokenizer. */
export function loadTokenizer(dir: string): Tokenizer {
  const tokenizerJson = readJsonObject(join(dir, 'tokenizer.json'))
  const config = readJsonObject(join(dir, 'tokenizer_config.json'))
  let hf: HfTokenizer
  try {
    hf = new HfTokenizer(tokenizerJson, config)
  } catch (err) {
    throw new KvfenceError(
      'internal_error',
      `${join(dir, 'tokenizer.json')} is not a valid tokenizer: ${errorMessage(err)}`,
    )
  }

  const bosToken = specialTokenText(config.bos_token)
  const eosToken = specialTokenText(config.eos_token)
  const bosTokenId = tokenId(hf, bosToken, 'bos_token', dir)
  const eosTokenId = tokenId(hf, eosToken, 'eos_token', dir)
  // `add_bos_token` / `add_eos_token`, when present, decide; when absent the tokenizer's own
  // post-processor does (as in transformers).
  const addBos = typeof config.add_bos_token === 'boolean' ? config.add_bos_token : null
  const addEos = typeof config.add_eos_token === 'boolean' ? config.add_eos_token : null
  const template = compileChatTemplate(config.chat_template, dir)

  const losesNoText = representsAnyText(tokenizerJson)
  const around = addBos === null && addEos === null ? specialTokensAround(hf) : null
  let maxId = -1
  let maxTokenChars = 1
  for (const [text, id] of hf.get_vocab(true)) {
    maxId = Math.max(maxId, id)
    maxTokenChars = Math.max(maxTokenChars, text.length)
  }

  /** The text of each single token (special tokens skipped) decoded so far: streaming decodes
   *  every generated token alone once per step (text-stream.ts), and that text never changes.
   *  Ids in the vocabulary only, so it holds at most one string per token of the vocabulary. */
  const singleTokenTexts = new Map<number, string>()

  /** `bare` (the text's ids alone) with BOS/EOS as `add_bos_token`/`add_eos_token` say. */
  const withConfiguredSpecials = (bare: number[]): number[] => {
    if (addBos && bosTokenId !== null) bare.unshift(bosTokenId)
    if (addEos && eosTokenId !== null) bare.push(eosTokenId)
    return bare
  }
  /** The first character of `text` its ids `bare` do not give back (see firstLostCharacter). */
  const lostIn = (text: string, bare: number[]): string | null => {
    const normalized = hf.normalizer === null ? text : hf.normalizer.normalize(text)
    const decoded = bare.length === 0 ? '' : hf.decode(bare, { skip_special_tokens: false })
    return firstMissing(normalized, decoded)
  }

  return Object.freeze({
    bosTokenId,
    eosTokenId,
    bosToken,
    eosToken,
    vocabSize: maxId + 1,
    maxTokenChars,

    encode(text: string, options: EncodeOptions = {}): number[] {
      const withSpecial = options.addSpecialTokens ?? true
      if (!withSpecial || (addBos === null && addEos === null)) {
        return hf.encode(text, { add_special_tokens: withSpecial }).ids
      }
      return withConfiguredSpecials(hf.encode(text, { add_special_tokens: false }).ids)
    },

    firstLostCharacter(text: string): string | null {
      if (losesNoText) return null
      return lostIn(text, hf.encode(text, { add_special_tokens: false }).ids)
    },

    encodeChecked(text: string, options: EncodeOptions = {}): CheckedEncoding {
      if (losesNoText) return { ids: this.encode(text, options), lost: null }
      const bare = hf.encode(text, { add_special_tokens: false }).ids
      const lost = lostIn(text, bare)
      if (!(options.addSpecialTokens ?? true)) return { ids: bare, lost }
      if (addBos !== null || addEos !== null) return { ids: withConfiguredSpecials(bare), lost }
      if (around !== null) return { ids: [...around.prefix, ...bare, ...around.suffix], lost }
      return { ids: this.encode(text, options), lost } // a post-processor of unknown shape
    },

    decode(ids: readonly number[], options: DecodeOptions = {}): string {
      if (ids.length === 0) return ''
      const skipSpecialTokens = options.skipSpecialTokens ?? true
      if (ids.length === 1 && skipSpecialTokens && ids[0] >= 0 && ids[0] <= maxId) {
        const cached = singleTokenTexts.get(ids[0])
        if (cached !== undefined) return cached
        const text: string = hf.decode([ids[0]], {
          skip_special_tokens: true,
          clean_up_tokenization_spaces: false,
        })
        singleTokenTexts.set(ids[0], text)
        return text
      }
      return hf.decode([...ids], {
        skip_special_tokens: skipSpecialTokens,
        clean_up_tokenization_spaces: false,
      })
    },

    applyChatTemplate(messages: readonly ChatMessage[]): string {
      return renderChatTemplate(template, messages, bosToken, eosToken)
    },
  })
}

// ---------------------------------------------------------------------------------------------
// Helpers

/** `messages` rendered by the model's chat template with the generation prompt added. Throws
 *  `invalid_request` (param `messages`) when the model has none or the template rejects them. */
function renderChatTemplate(
  template: Template | null,
  messages: readonly ChatMessage[],
  bosToken: string | null,
  eosToken: string | null,
): string {
  if (template === null) {
    throw new KvfenceError(
      'invalid_request',
      'this model has no chat template; use /v1/completions',
      'messages',
    )
  }
  try {
    return template.render({
      messages,
      add_generation_prompt: true,
      bos_token: bosToken ?? '',
      eos_token: eosToken ?? '',
    })
  } catch (err) {
    throw new KvfenceError(
      'invalid_request',
      `the chat template rejected the messages: ${errorMessage(err)}`,
      'messages',
    )
  }
}

function readJsonObject(path: string): Record<string, unknown> {
  let text: string
  try {
    text = readFileSync(path, 'utf8')
  } catch (err) {
    throw new KvfenceError('internal_error', `cannot read ${path}: ${errorMessage(err)}`)
  }
  let value: unknown
  try {
    value = JSON.parse(text)
  } catch (err) {
    throw new KvfenceError('internal_error', `${path} is not valid JSON: ${errorMessage(err)}`)
  }
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new KvfenceError('internal_error', `${path} must hold a JSON object`)
  }
  return value as Record<string, unknown>
}

/** `bos_token` / `eos_token` are a string or an AddedToken-like `{ content }` object. */
function specialTokenText(value: unknown): string | null {
  if (typeof value === 'string') return value
  if (typeof value === 'object' && value !== null && 'content' in value) {
    const content = (value as { content: unknown }).content
    if (typeof content === 'string') return content
  }
  return null
}

function tokenId(hf: HfTokenizer, token: string | null, field: string, dir: string): number | null {
  if (token === null) return null
  const id = hf.token_to_id(token)
  if (id === undefined) {
    throw new KvfenceError(
      'internal_error',
      `${join(dir, 'tokenizer_config.json')}: ${field} ${JSON.stringify(token)} is not in the vocabulary`,
    )
  }
  return id
}

/** `chat_template` is a string, or a list of `{ name, template }` (the one named `default`). */
function compileChatTemplate(value: unknown, dir: string): Template | null {
  let source: string | null = null
  if (typeof value === 'string') source = value
  else if (Array.isArray(value)) {
    const named = value.find(
      (t: unknown) =>
        typeof t === 'object' && t !== null && (t as { name?: unknown }).name === 'default',
    ) as { template?: unknown } | undefined
    if (typeof named?.template === 'string') source = named.template
  }
  if (source === null) return null
  try {
    return new Template(source)
  } catch (err) {
    throw new KvfenceError(
      'internal_error',
      `${join(dir, 'tokenizer_config.json')}: chat_template does not parse: ${errorMessage(err)}`,
    )
  }
}

/** Whether a `tokenizer.json` can represent any text: a byte-level pre-tokenizer or decoder (GPT-2,
 *  Llama 3, Qwen) or a BPE model with `byte_fallback` (Llama 2, Mistral). */
function representsAnyText(json: Record<string, unknown>): boolean {
  const mentionsByteLevel = (part: unknown): boolean => {
    if (typeof part !== 'object' || part === null) return false
    const p = part as { type?: unknown; pretokenizers?: unknown; decoders?: unknown }
    if (p.type === 'ByteLevel' || p.type === 'ByteFallback') return true
    const inner = [p.pretokenizers, p.decoders].flatMap((x) => (Array.isArray(x) ? x : []))
    return inner.some(mentionsByteLevel)
  }
  const model = json.model as { byte_fallback?: unknown } | undefined
  return (
    model?.byte_fallback === true ||
    mentionsByteLevel(json.pre_tokenizer) ||
    mentionsByteLevel(json.decoder)
  )
}

/** The special tokens the tokenizer's post-processor puts before and after a single text (e.g.
 *  TemplateProcessing's `<s>` … `</s>`, BERT's `[CLS]` … `[SEP]`; none for a byte-level one),
 *  when they are the same whatever the text: found by encoding probe texts with and without
 *  special tokens. Null when they are not (such a post-processor's ids are then always taken
 *  from a full encoding). */
function specialTokensAround(hf: HfTokenizer): { prefix: number[]; suffix: number[] } | null {
  const encode = (text: string, withSpecial: boolean) =>
    hf.encode(text, { add_special_tokens: withSpecial }).ids
  let found: { prefix: number[]; suffix: number[] } | null = null
  for (const probe of ['a', 'Hello, world! 12 ab']) {
    const full = encode(probe, true)
    const bare = encode(probe, false)
    const at = bare.length === 0 ? -1 : indexOfRun(full, bare)
    if (at === -1) return null
    const parts = { prefix: full.slice(0, at), suffix: full.slice(at + bare.length) }
    if (found === null) found = parts
    else if (!sameIds(found.prefix, parts.prefix) || !sameIds(found.suffix, parts.suffix))
      return null
  }
  // The empty text too: nothing between them.
  if (found === null || !sameIds(encode('', true), [...found.prefix, ...found.suffix])) return null
  return found
}

/** Where `run` first occurs in `ids` as a contiguous run (0 for an empty run), or -1. */
function indexOfRun(ids: readonly number[], run: readonly number[]): number {
  for (let at = 0; at + run.length <= ids.length; at++) {
    if (run.every((id, i) => ids[at + i] === id)) return at
  }
  return -1
}

function sameIds(a: readonly number[], b: readonly number[]): boolean {
  return a.length === b.length && a.every((id, i) => b[i] === id)
}

/** The first non-whitespace character of `want` that `got` does not give back in order, or null. */
function firstMissing(want: string, got: string): string | null {
  const gotChars = [...got.replace(/\s+/g, '')]
  let j = 0
  for (const ch of want.replace(/\s+/g, '')) {
    if (gotChars[j] === ch) j++
    else return ch
  }
  return null
}

function errorMessage(err: unknown): string {
  return err instanceof Error ? err.message : String(err)
}
