/** The response sentinel: checks every answer, as it is produced, for a run of another tenant's
 *  recent prompt (suspected cross-tenant answer) and for a fragment of a canary tenant's canary
 *  (confirmed leak); in block mode it ends the answer before the run reaches the client.
 *  A run counts when at least `minRunTokens` consecutive tokens of the answer form n-grams that
 *  exactly one tenant — another one — sent in its recent prompts, and that neither this request's
 *  prompt nor the answering tenant's recent prompts hold (text sent by two or more tenants, such
 *  as a shared system prompt or a licence, is no evidence).
 *  Its unit is the token where the router has the token ids of prompts and answers (native
 *  mode), else the UTF-16 code unit of text (gateway mode): there a run's length in tokens is
 *  its length in characters ÷ the characters per token measured on the source tenant's prompts.
 *  Knows tenants' names, request ids, texts and token ids while checking them; keeps only keyed
 *  fingerprints and per-tenant character and token counts. */
import { KvfenceError } from '../../common/errors.js'
import {
  type FingerprintStore,
  type GenerationChange,
  type NgramHasher,
  createFingerprintStore,
  bytesPerFingerprint,
  createNgramHasher,
  fingerprintsOf,
} from './fingerprints.js'

/** `off`: nothing is kept or checked; `observe`: events are counted and logged; `block`: an
 *  answer is also ended with an error before a suspect run or a canary fragment reaches the
 *  client. */
export type SentinelMode = 'off' | 'observe' | 'block'

/** The sentinel's settings (`sentinel:` of the router's config). */
export interface SentinelSettings {
  readonly mode: SentinelMode
  /** How long a prompt's fingerprints (and a canary) stay, seconds. */
  readonly windowSeconds: number
  /** Cap on the fingerprints' memory, bytes (estimated; oldest prompts dropped first). */
  readonly maxBytes: number
  /** Tokens per n-gram (in character mode: characters, see {@link SentinelUnit}). */
  readonly ngramTokens: number
  /** Shortest run of tokens that counts as a suspected cross-tenant answer (≥ ngramTokens). */
  readonly minRunTokens: number
}

/** Defaults of {@link SentinelSettings}. */
export const sentinelDefaults: SentinelSettings = Object.freeze({
  mode: 'observe',
  windowSeconds: 600,
  maxBytes: 64 * 1024 * 1024, // 64 MiB
  ngramTokens: 8,
  minRunTokens: 16,
})

/** Frozen settings: `fields` over {@link sentinelDefaults}. Throws `config_invalid` for an
 *  n-gram under 1 unit, a run shorter than an n-gram, or a window or cap that is not positive. */
export function buildSentinelSettings(fields: Partial<SentinelSettings>): SentinelSettings {
  const s = { ...sentinelDefaults, ...fields }
  const isCount = (v: number) => Number.isInteger(v) && v >= 1
  if (!['off', 'observe', 'block'].includes(s.mode)) {
    throw new KvfenceError(
      'config_invalid',
      `sentinel.mode must be off, observe or block, not ${s.mode}`,
    )
  }
  if (!isCount(s.ngramTokens) || !isCount(s.minRunTokens) || s.minRunTokens < s.ngramTokens) {
    throw new KvfenceError(
      'config_invalid',
      `sentinel: minRunTokens (${s.minRunTokens}) must be an integer ≥ ngramTokens (${s.ngramTokens}) ≥ 1`,
    )
  }
  if (!(s.windowSeconds > 0) || !isCount(s.maxBytes)) {
    throw new KvfenceError(
      'config_invalid',
      'sentinel: windowSeconds and maxBytes must be positive',
    )
  }
  return Object.freeze(s)
}

/** A canary fragment this long or longer in another tenant's answer is a confirmed leak (the
 *  auditor's detector's length: 62^8 random alphanumerics do not recur by chance). */
export const canaryFragmentLength = 8
/** In a canary tenant's prompt, an alphanumeric run this long with a digit, a capital and a
 *  lowercase letter is taken for a canary (the auditor's canaries are 16–24 such characters;
 *  plain words and numbers never qualify). */
export const minCanaryLength = 12
const canaryPattern = /[A-Za-z0-9]{12,}/g

/** What the sentinel matches: `token` — n-grams of token ids, of the prompt as the router
 *  tokenized it and of the answer as the model generated it (the router must hand every answer
 *  piece's token ids to {@link AnswerCheck.push}); `character` — n-grams of `ngramTokens` UTF-16
 *  code units of text, for a router that sees answers as text only. In character mode a run of
 *  `r` characters whose last n-gram another tenant sent is `r × t ÷ c` tokens, where `c` and `t`
 *  are the characters and the counted tokens of that tenant's prompts in the window — those whose
 *  fingerprints are kept (one character per token when none of them was counted). */
export type SentinelUnit = 'token' | 'character'

/** What the sentinel takes of an admitted prompt. */
export interface SentinelPrompt {
  /** Its texts: each chat message's content, or a completion's text (decoded when given as
   *  token ids and a tokenizer is at hand; none otherwise). Canaries are learnt from them; in
   *  character mode they are also what is fingerprinted and measured. */
  readonly texts: readonly string[]
  /** Its token ids as the backend runs them (chat template included), or null (gateway mode).
   *  Fingerprinted in token mode. */
  readonly tokenIds: ArrayLike<number> | null
  /** Its tokens as the router counted them (the `usage.prompt_tokens` it reports), or null when
   *  not counted. */
  readonly numTokens: number | null
}

/** What the sentinel found in one answer. */
export interface SentinelEvent {
  readonly kind: 'suspected' | 'confirmed'
  /** The answering request and its tenant. */
  readonly rid: string
  readonly tenant: string
  /** The tenant whose prompt the run or canary came from (the latest to send its last n-gram). */
  readonly sourceTenant: string | null
  /** Suspected: the run's tokens when found (in character mode `⌊characters × t ÷ c⌋`, see
   *  {@link SentinelUnit}). Confirmed: null. */
  readonly runTokens: number | null
  /** The run's characters in character mode, the canary fragment's (8) when confirmed; null for
   *  a run of tokens. */
  readonly runCharacters: number | null
}

/** One answer being checked. */
export interface AnswerCheck {
  /** Takes the next piece of the answer — its text and, in token mode, the ids of the tokens
   *  generated since the previous piece (their text may be empty); returns the text that may go
   *  to the client now (all of it unless blocking, where a possible run's text is held back).
   *  Throws `answer_withheld` in block mode when the answer holds a suspect run or a canary
   *  fragment. */
  push(piece: string, tokenIds?: readonly number[]): string
  /** At the end of an answer: the text still held back. */
  finish(): string
}

/** The sentinel of one router. */
export interface Sentinel {
  readonly settings: SentinelSettings
  readonly unit: SentinelUnit
  /** Admits a request's prompt for `tenant` (canaries learnt when `isCanaryTenant`), and returns
   *  the check of its answer. */
  admit(tenant: string, isCanaryTenant: boolean, rid: string, prompt: SentinelPrompt): AnswerCheck
  /** Estimated bytes the fingerprints use. */
  readonly numBytes: number
  check(): void
}

/** Options of {@link createSentinel}. */
export interface SentinelOptions {
  settings: SentinelSettings
  /** Default `character`. */
  unit?: SentinelUnit
  /** Hears of every event (the router counts and logs them). */
  onEvent: (event: SentinelEvent) => void
  /** The clock, ms (default `Date.now`). */
  now?: () => number
  /** The n-gram key (default: 16 random bytes, drawn here). */
  key?: Uint8Array
}

/** A canary fragment, learnt from a canary tenant's prompt. */
interface CanaryFragment {
  atMs: number
  tenant: string
}

/** A sentinel (its mode may be `off`: then nothing is kept and every answer passes). */
export function createSentinel(options: SentinelOptions): Sentinel {
  const { settings } = options
  const unit = options.unit ?? 'character'
  const now = options.now ?? Date.now
  const hash = createNgramHasher(options.key)
  const windowMs = settings.windowSeconds * 1000
  const density = createDensity()
  const store = createFingerprintStore({
    windowMs,
    maxBytes: settings.maxBytes,
    now,
    onGenerations: (change) => density.onGenerations(change),
  })
  // Fingerprints of every canary fragment (of `canaryFragmentLength` characters); few, apart.
  const canaries = new Map<number, CanaryFragment>()
  const learnCanaries = (tenant: string, texts: readonly string[]) => {
    const atMs = now()
    for (const text of texts) {
      for (const [run] of text.matchAll(canaryPattern)) {
        if (!/[0-9]/.test(run) || !/[A-Z]/.test(run) || !/[a-z]/.test(run)) continue
        for (let s = 0; s + canaryFragmentLength <= run.length; s++) {
          canaries.set(hash(run, s, canaryFragmentLength), { atMs, tenant })
        }
      }
    }
  }
  const expireCanaries = () => {
    const oldestMs = now() - windowMs
    for (const [fp, c] of canaries) if (c.atMs < oldestMs) canaries.delete(fp)
  }
  const passAll: AnswerCheck = { push: (piece) => piece, finish: () => '' }
  const deps: CheckDeps = {
    settings,
    unit,
    hash,
    store,
    canaries,
    density,
    onEvent: options.onEvent,
  }
  return {
    settings,
    unit,
    admit(tenant, isCanaryTenant, rid, prompt) {
      if (settings.mode === 'off') return passAll
      expireCanaries()
      if (isCanaryTenant) learnCanaries(tenant, prompt.texts)
      const n = settings.ngramTokens
      if (unit === 'token') {
        if (prompt.tokenIds !== null) store.add(tenant, fingerprintsOf(hash, prompt.tokenIds, n))
      } else {
        for (const text of prompt.texts) store.add(tenant, fingerprintsOf(hash, text, n))
        density.add(tenant, prompt)
      }
      return createAnswerCheck(deps, { tenant, rid, texts: prompt.texts })
    },
    get numBytes() {
      return store.numBytes + canaries.size * bytesPerFingerprint
    },
    check: () => store.check(),
  }
}

/** Characters and counted tokens of each tenant's recent prompts (character mode): the prompts
 *  whose fingerprints the store keeps, so a run is measured by what its tenant sends now, not
 *  by what it sent since the router started. */
interface Density {
  add(tenant: string, prompt: SentinelPrompt): void
  /** Follows the fingerprint store's generations (see {@link GenerationChange}). */
  onGenerations(change: GenerationChange): void
  /** Characters `c` and counted tokens `t` of `tenant`'s prompts in the window, or 1 and 1 when
   *  none was counted in it. */
  of(tenant: string): { readonly chars: number; readonly tokens: number }
}

const oneCharPerToken = Object.freeze({ chars: 1, tokens: 1 })

type Sums = Map<string, { chars: number; tokens: number }>

/** An empty {@link Density}: per-tenant sums in two generations, swapped and dropped with the
 *  fingerprints' (tenants are configured, so each generation is bounded). */
function createDensity(): Density {
  let newer: Sums = new Map()
  let older: Sums = new Map()
  return {
    add(tenant, prompt) {
      let chars = 0
      for (const text of prompt.texts) chars += text.length
      if (prompt.numTokens === null || prompt.numTokens <= 0 || chars === 0) return
      const sum = newer.get(tenant)
      if (sum === undefined) newer.set(tenant, { chars, tokens: prompt.numTokens })
      else {
        sum.chars += chars
        sum.tokens += prompt.numTokens
      }
    },
    onGenerations(change) {
      if (change === 'rotate') older = newer
      if (change !== 'drop-older') newer = new Map()
      if (change !== 'rotate') older = new Map()
    },
    of(tenant) {
      const a = newer.get(tenant)
      const b = older.get(tenant)
      if (a === undefined && b === undefined) return oneCharPerToken
      return {
        chars: (a?.chars ?? 0) + (b?.chars ?? 0),
        tokens: (a?.tokens ?? 0) + (b?.tokens ?? 0),
      }
    },
  }
}

/** The answering request. */
interface AnswerScope {
  tenant: string
  rid: string
  /** Its prompt's texts (its own conversation). */
  texts: readonly string[]
}

/** What an {@link AnswerCheck} reads. */
interface CheckDeps {
  settings: SentinelSettings
  unit: SentinelUnit
  hash: NgramHasher
  store: FingerprintStore
  canaries: Map<number, CanaryFragment>
  density: Density
  onEvent: (event: SentinelEvent) => void
}

/** The check of one answer: one n-gram per new unit, one canary fragment per new character. */
function createAnswerCheck(deps: CheckDeps, scope: AnswerScope): AnswerCheck {
  const { settings, hash, store, canaries } = deps
  const n = settings.ngramTokens
  const isTokens = deps.unit === 'token'
  const isBlocking = settings.mode === 'block'
  // This request's own prompt is never evidence: the store has just recorded its n-grams for
  // this tenant (only a prompt over half the memory cap can lose some of them at once), and its
  // canary-length pieces are kept here.
  const ownPieces = canaries.size > 0 ? canaryPiecesOf(hash, scope.texts) : new Set<number>()
  let text = ''
  /** Token mode: the answer's token ids. */
  const ids: number[] = []
  let numReleased = 0
  /** Consecutive evidential n-grams ending at the last unit. */
  let runNgrams = 0
  let isSuspected = false
  let isConfirmed = false
  const pieceEnds = createPieceEnds()

  const report = (event: Omit<SentinelEvent, 'rid' | 'tenant'>) => {
    deps.onEvent({ ...event, rid: scope.rid, tenant: scope.tenant })
    if (isBlocking) {
      throw new KvfenceError(
        'answer_withheld',
        `request ${scope.rid}: the response sentinel withheld the answer (${event.kind})`,
      )
    }
  }
  /** The n-gram ending at unit `end` (of `units`). */
  const checkNgram = (units: string | readonly number[], end: number) => {
    if (end < n) return
    const fp = hash(units, end - n, n)
    runNgrams = store.isEvidence(scope.tenant, fp) ? runNgrams + 1 : 0
    if (runNgrams === 0 || isSuspected) return
    const runUnits = runNgrams + n - 1
    if (isTokens) {
      if (runUnits < settings.minRunTokens) return
      isSuspected = true
      const source = store.holderOf(fp)?.tenant ?? null
      report({ kind: 'suspected', sourceTenant: source, runTokens: runUnits, runCharacters: null })
      return
    }
    const source = store.holderOf(fp)?.tenant ?? null
    const { chars, tokens } = source === null ? oneCharPerToken : deps.density.of(source)
    // Integer products, one division: exact where the true threshold is a whole number.
    if (runUnits < Math.max(n, Math.ceil((settings.minRunTokens * chars) / tokens))) return
    isSuspected = true
    const runTokens = Math.floor((runUnits * tokens) / chars)
    report({ kind: 'suspected', sourceTenant: source, runTokens, runCharacters: runUnits })
  }
  /** The canary fragment ending at character `end`. */
  const checkCanary = (end: number) => {
    if (end < canaryFragmentLength || canaries.size === 0 || isConfirmed) return
    const fp = hash(text, end - canaryFragmentLength, canaryFragmentLength)
    const canary = canaries.get(fp)
    if (canary !== undefined && canary.tenant !== scope.tenant && !ownPieces.has(fp)) {
      isConfirmed = true
      report({
        kind: 'confirmed',
        sourceTenant: canary.tenant,
        runTokens: null,
        runCharacters: canaryFragmentLength,
      })
    }
  }
  /** Characters that may go to the client now (blocking): none of the current run's units nor
   *  of the units a next n-gram could still take in, nor the characters a canary fragment
   *  could — nothing of a run can have left when it reaches its length. */
  const releasable = (): number => {
    const numHeldUnits = Math.max(runNgrams > 0 ? runNgrams + n - 1 : 0, n - 1)
    const canaryEnd = text.length - (canaryFragmentLength - 1)
    if (!isTokens) return Math.min(text.length - numHeldUnits, canaryEnd)
    // Text of the pieces that ended before the first held token: a later piece's text may
    // hold an earlier token's (a character split across tokens), so it waits with it.
    pieceEnds.add(ids.length, text.length)
    return Math.min(pieceEnds.textBefore(ids.length - numHeldUnits, numReleased), canaryEnd)
  }
  return {
    push(piece, tokenIds) {
      const start = text.length
      text += piece
      if (isTokens) {
        if (tokenIds === undefined) {
          throw new KvfenceError('internal_error', 'the sentinel counts tokens: pass token ids')
        }
        for (const id of tokenIds) {
          ids.push(id)
          checkNgram(ids, ids.length)
        }
        for (let end = start + 1; end <= text.length; end++) checkCanary(end)
      } else {
        for (let end = start + 1; end <= text.length; end++) {
          checkNgram(text, end)
          checkCanary(end)
        }
      }
      if (!isBlocking) {
        numReleased = text.length
        return piece
      }
      let until = Math.max(numReleased, releasable())
      // Never between the two halves of a surrogate pair.
      if (until > numReleased && isHighSurrogate(text.charCodeAt(until - 1))) until--
      const released = text.slice(numReleased, until)
      numReleased = until
      return released
    },
    finish() {
      const rest = text.slice(numReleased)
      numReleased = text.length
      return rest
    },
  }
}

/** Fingerprints of every canary-length piece of `texts`. */
function canaryPiecesOf(hash: NgramHasher, texts: readonly string[]): Set<number> {
  const pieces = new Set<number>()
  for (const text of texts) {
    for (const fp of fingerprintsOf(hash, text, canaryFragmentLength)) pieces.add(fp)
  }
  return pieces
}

/** Where each piece of an answer ended, in tokens and in characters (token mode, blocking). */
interface PieceEnds {
  add(numTokens: number, numChars: number): void
  /** Characters of the pieces that ended at or before token `heldFrom` (`atLeast` when none
   *  more); those pieces are forgotten. */
  textBefore(heldFrom: number, atLeast: number): number
}

function createPieceEnds(): PieceEnds {
  const ends: number[] = [] // [tokens, characters] pairs
  let at = 0
  return {
    add: (numTokens, numChars) => void ends.push(numTokens, numChars),
    textBefore(heldFrom, atLeast) {
      let until = atLeast
      while (at < ends.length && ends[at] <= heldFrom) {
        until = ends[at + 1]
        at += 2
      }
      return until
    },
  }
}

function isHighSurrogate(code: number): boolean {
  return code >= 0xd800 && code <= 0xdbff
}
