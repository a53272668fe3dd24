/** The response sentinel: checks every answer, as it is produced, for a run of another tenant's
 *  recent prompt text (suspected cross-tenant answer) and for a fragment of a canary tenant's
 *  canary (confirmed leak); in block mode it ends the answer before the run reaches the client.
 *  A run counts when at least `minRunTokens` consecutive units of the answer form n-grams that
 *  exactly one tenant — another one — sent in its recent prompts, and that neither this request's
 *  prompt nor the answering tenant's recent prompts hold (text sent by two or more tenants, such
 *  as a shared system prompt or a licence, is no evidence).
 *  Knows tenants' names, request ids, texts while checking them; keeps only keyed fingerprints. */
import { KvfenceError } from '../../errors.js'
import {
  type FingerprintStore,
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
  /** Units (characters of text; tokens with a character-level vocabulary) per n-gram. */
  readonly ngramTokens: number
  /** Shortest run of units that counts as a suspected cross-tenant answer (≥ ngramTokens). */
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

/** What the sentinel found in one answer. */
export interface SentinelEvent {
  readonly kind: 'suspected' | 'confirmed'
  /** The answering request and its tenant. */
  readonly rid: string
  readonly tenant: string
  /** The tenant whose prompt the run or canary came from (the latest to send its last n-gram). */
  readonly sourceTenant: string | null
  /** Units of the matching run when found (suspected), or of the canary fragment (confirmed). */
  readonly runTokens: number
}

/** One answer being checked. */
export interface AnswerCheck {
  /** Takes the next piece of the answer; returns the text that may go to the client now (all of
   *  it unless blocking, where a possible run's units are held back). Throws `answer_withheld`
   *  in block mode when the answer holds a suspect run or a canary fragment. */
  push(piece: string): string
  /** At the end of an answer: the text still held back. */
  finish(): string
}

/** The sentinel of one router. */
export interface Sentinel {
  readonly settings: SentinelSettings
  /** Admits a request's prompt texts for `tenant` (canaries learnt when `isCanaryTenant`), and
   *  returns the check of its answer. */
  admit(tenant: string, isCanaryTenant: boolean, rid: string, texts: readonly string[]): AnswerCheck
  /** Estimated bytes the fingerprints use. */
  readonly numBytes: number
  check(): void
}

/** Options of {@link createSentinel}. */
export interface SentinelOptions {
  settings: SentinelSettings
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
  const now = options.now ?? Date.now
  const hash = createNgramHasher(options.key)
  const windowMs = settings.windowSeconds * 1000
  const store = createFingerprintStore({ windowMs, maxBytes: settings.maxBytes, now })
  // Fingerprints of every canary fragment (of `canaryFragmentLength` units); few, kept apart.
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
  return {
    settings,
    admit(tenant, isCanaryTenant, rid, texts) {
      if (settings.mode === 'off') return passAll
      expireCanaries()
      if (isCanaryTenant) learnCanaries(tenant, texts)
      for (const text of texts) store.add(tenant, fingerprintsOf(hash, text, settings.ngramTokens))
      const answer: AnswerScope = { tenant, rid, texts }
      return createAnswerCheck(
        { settings, hash, store, canaries, onEvent: options.onEvent },
        answer,
      )
    },
    get numBytes() {
      return store.numBytes + canaries.size * bytesPerFingerprint
    },
    check: () => store.check(),
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
  hash: NgramHasher
  store: FingerprintStore
  canaries: Map<number, CanaryFragment>
  onEvent: (event: SentinelEvent) => void
}

/** The check of one answer: one n-gram (and one canary fragment) per new unit. */
function createAnswerCheck(deps: CheckDeps, scope: AnswerScope): AnswerCheck {
  const { settings, hash, store, canaries } = deps
  const n = settings.ngramTokens
  const isBlocking = settings.mode === 'block'
  // This request's own prompt is never evidence: the store has just recorded its n-grams for
  // this tenant (only a prompt over half the memory cap can lose some of them at once), and its
  // canary-length pieces are kept here.
  const ownPieces = new Set<number>()
  if (canaries.size > 0) {
    for (const text of scope.texts) {
      for (const fp of fingerprintsOf(hash, text, canaryFragmentLength)) ownPieces.add(fp)
    }
  }
  let text = ''
  let numReleased = 0
  /** Consecutive evidential n-grams ending at the last unit. */
  let runNgrams = 0
  let isSuspected = false
  let isConfirmed = false

  const report = (kind: SentinelEvent['kind'], fp: number, runTokens: number) => {
    const source = kind === 'confirmed' ? (canaries.get(fp) ?? null) : store.holderOf(fp)
    deps.onEvent({
      kind,
      rid: scope.rid,
      tenant: scope.tenant,
      sourceTenant: source?.tenant ?? null,
      runTokens,
    })
    if (isBlocking) {
      throw new KvfenceError(
        'answer_withheld',
        `request ${scope.rid}: the response sentinel withheld the answer (${kind}, ${runTokens} units)`,
      )
    }
  }
  const checkUnit = (end: number) => {
    if (end >= n) {
      const fp = hash(text, end - n, n)
      const isEvidence = store.isEvidence(scope.tenant, fp)
      runNgrams = isEvidence ? runNgrams + 1 : 0
      const runTokens = runNgrams + n - 1
      if (runNgrams > 0 && runTokens >= settings.minRunTokens && !isSuspected) {
        isSuspected = true
        report('suspected', fp, runTokens)
      }
    }
    if (end >= canaryFragmentLength && canaries.size > 0 && !isConfirmed) {
      const fp = hash(text, end - canaryFragmentLength, canaryFragmentLength)
      const canary = canaries.get(fp)
      if (canary !== undefined && canary.tenant !== scope.tenant && !ownPieces.has(fp)) {
        isConfirmed = true
        report('confirmed', fp, canaryFragmentLength)
      }
    }
  }
  return {
    push(piece) {
      const start = text.length
      text += piece
      for (let end = start + 1; end <= text.length; end++) checkUnit(end)
      if (!isBlocking) {
        numReleased = text.length
        return piece
      }
      // Held back: the current run's units, or the units a next n-gram or canary fragment could
      // still take in — nothing of a run can have left when it reaches minRunTokens.
      const numHeld = Math.max(
        runNgrams > 0 ? runNgrams + n - 1 : 0,
        n - 1,
        canaryFragmentLength - 1,
      )
      let until = Math.max(numReleased, text.length - numHeld)
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

function isHighSurrogate(code: number): boolean {
  return code >= 0xd800 && code <= 0xdbff
}
