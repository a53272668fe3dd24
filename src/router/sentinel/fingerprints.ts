/** Keyed fingerprints of n-grams of units — token ids, or the UTF-16 code units of text — and
 *  the window that holds the fingerprints of every tenant's recent prompts for the response
 *  sentinel.
 *  A fingerprint is a 31-bit keyed hash of `n` consecutive units, under a secret drawn once per
 *  process (never logged, never written): the store holds no text and no token ids, and a
 *  fingerprint means nothing without the key. 31 bits fit the store's typed tables
 *  (fingerprint-table.ts), with one 32-bit value left over to mark an empty slot; a chance
 *  match is then ~1 in 1,000 per n-gram at 2 M stored fingerprints, and a run needs 9 in a row.
 *  Which unit a router uses is the sentinel's business (sentinel.ts, docs/monitoring.md).
 *  Knows tenants' names and numbers; knows nothing of HTTP or of the text itself once hashed. */
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { FingerprintTable } from './fingerprint-table.js'

/** Units to hash: a text (its UTF-16 code units) or token ids (integers). */
export type Units = string | ArrayLike<number>

/** A keyed hash of the `n` units of `units` starting at `start` (`start + n ≤ units.length`),
 *  as a 31-bit signed integer (a V8 small integer). A text and the array of its code units hash
 *  alike. */
export type NgramHasher = (units: Units, start: number, n: number) => number

/** A {@link NgramHasher} under `key` (16 bytes; default: 16 fresh random bytes). Two 32-bit
 *  multiply-xorshift lanes, each seeded and finalized with key words (MurmurHash3's finalizer
 *  constants): a keyed fast hash, not a MAC — enough here, since fingerprints never leave the
 *  process, and some 20 times cheaper per n-gram than an HMAC. */
export function createNgramHasher(key: Uint8Array = randomBytes(16)): NgramHasher {
  assert.equal(key.length, 16, 'an n-gram key is 16 bytes')
  const view = new DataView(key.buffer, key.byteOffset, key.byteLength)
  const k0 = view.getUint32(0) | 0
  const k1 = view.getUint32(4) | 0
  const k2 = view.getUint32(8) | 0
  const k3 = view.getUint32(12) | 0
  return (units, start, n) => {
    let a = k0 ^ n
    let b = k1
    // Two loops rather than one with a branch per unit: text is the hot case.
    if (typeof units === 'string') {
      for (let i = start; i < start + n; i++) {
        const c = units.charCodeAt(i)
        a = Math.imul(a ^ c, 0x9e3779b1)
        a ^= a >>> 15
        b = Math.imul(b ^ c ^ k2, 0x85ebca6b)
        b ^= b >>> 13
      }
    } else {
      for (let i = start; i < start + n; i++) {
        const c = units[i] | 0
        a = Math.imul(a ^ c, 0x9e3779b1)
        a ^= a >>> 15
        b = Math.imul(b ^ c ^ k2, 0x85ebca6b)
        b ^= b >>> 13
      }
    }
    a = finalize(a ^ k3)
    b = finalize(b ^ k2)
    return (a ^ Math.imul(b, 0x27d4eb2f)) >> 1
  }
}

/** MurmurHash3's 32-bit finalizer: every input bit reaches every output bit. */
function finalize(h: number): number {
  h ^= h >>> 16
  h = Math.imul(h, 0x85ebca6b)
  h ^= h >>> 13
  h = Math.imul(h, 0xc2b2ae35)
  return h ^ (h >>> 16)
}

/** Every fingerprint of the n-grams of `units`, in order, repeats included (none when there are
 *  fewer than `n` units). */
export function fingerprintsOf(hash: NgramHasher, units: Units, n: number): Int32Array {
  const out = new Int32Array(Math.max(0, units.length - n + 1))
  for (let start = 0; start < out.length; start++) out[start] = hash(units, start, n)
  return out
}

/** Estimated bytes one stored fingerprint costs: a slot of a {@link FingerprintTable} (key and
 *  value, 8 bytes) at its lowest load (1/4). An estimate, for the cap and the gauge, and an upper
 *  bound of the tables' own bytes. */
export const bytesPerFingerprint = 32

/** What the window knows of one fingerprint. */
export interface Holder {
  /** The (latest) tenant that sent it. */
  readonly tenant: string
  /** Whether two or more tenants sent it within the window. */
  readonly isShared: boolean
}

/** Fingerprints of every tenant's recent prompts, in two generations: a fingerprint added now
 *  is kept between `windowMs / 2` and `windowMs` (the older generation is dropped every half
 *  window), or less when the memory cap drops the older generation early. Per fingerprint, the
 *  latest tenant that sent it and whether another tenant did too. */
export interface FingerprintStore {
  /** Adds one prompt's fingerprints for `tenant`. */
  add(tenant: string, fingerprints: Int32Array): void
  /** Who holds `fingerprint` now, or null. */
  holderOf(fingerprint: number): Holder | null
  /** Whether `fingerprint` is evidence against an answer of `tenant`: held by exactly one tenant,
   *  another one. */
  isEvidence(tenant: string, fingerprint: number): boolean
  /** Drops the older generation when half a window has passed since the last drop. */
  expire(): void
  /** Estimated bytes used ({@link bytesPerFingerprint} per stored fingerprint). */
  readonly numBytes: number
  /** Asserts that no fingerprint is in the newer generation with less than the older knows. */
  check(): void
}

/** Options of {@link createFingerprintStore}. */
export interface FingerprintStoreOptions {
  /** How long a prompt's fingerprints stay at most, ms. */
  windowMs: number
  /** Cap on {@link FingerprintStore.numBytes}. */
  maxBytes: number
  /** The clock, ms (default `Date.now`). */
  now?: () => number
  /** Hears of every change of generations, so that whatever is kept beside the fingerprints
   *  (per-tenant counts) covers the same prompts: `rotate` (the newer generation becomes the
   *  older, the older is dropped), `drop-older` (the cap drops the older generation alone),
   *  `clear` (a whole window passed: both dropped). */
  onGenerations?: (change: GenerationChange) => void
}

/** How a {@link FingerprintStore}'s generations changed. */
export type GenerationChange = 'rotate' | 'drop-older' | 'clear'

/** An empty {@link FingerprintStore}. */
export function createFingerprintStore(options: FingerprintStoreOptions): FingerprintStore {
  const now = options.now ?? Date.now
  const maxFingerprints = Math.max(2, Math.floor(options.maxBytes / bytesPerFingerprint))
  // Tenants by number (values hold numbers: small integers).
  const tenantNumbers = new Map<string, number>()
  const tenantNames: string[] = []
  const numberOf = (tenant: string) => {
    let n = tenantNumbers.get(tenant)
    if (n === undefined) {
      n = tenantNames.push(tenant) - 1
      tenantNumbers.set(tenant, n)
    }
    return n
  }
  // fingerprint → tenant number × 2 + (1 when shared). `newer` is written; `older` only read.
  let newer = new FingerprintTable()
  let older = new FingerprintTable()
  let rotatedAtMs = now()
  const rotate = () => {
    older = newer
    newer = new FingerprintTable()
    rotatedAtMs = now()
    options.onGenerations?.('rotate')
  }
  /** The value of `fp` (-1: absent); the newer generation knows at least what the older does. */
  const valueOf = (fp: number) => {
    const value = newer.get(fp)
    return value !== -1 ? value : older.get(fp)
  }
  const expire = () => {
    const elapsedMs = now() - rotatedAtMs
    if (elapsedMs >= options.windowMs) {
      older = new FingerprintTable()
      newer = new FingerprintTable()
      rotatedAtMs = now()
      options.onGenerations?.('clear')
    } else if (elapsedMs >= options.windowMs / 2) rotate()
  }
  return {
    add(tenant, fingerprints) {
      expire()
      const own = numberOf(tenant) * 2
      for (let i = 0; i < fingerprints.length; i++) {
        const fp = fingerprints[i]
        // One probe for a fingerprint the newer generation holds (a shared prompt's, every
        // request); two and an insert for a new one.
        const inNewer = newer.get(fp)
        const known = inNewer !== -1 ? inNewer : older.get(fp)
        const value = known === -1 || known === own ? own : own | 1
        if (inNewer === value) continue
        newer.set(fp, value)
        // The cap: the older generation goes first, then the newer starts afresh.
        if (newer.size + older.size > maxFingerprints) {
          if (older.size > 0) {
            older = new FingerprintTable()
            options.onGenerations?.('drop-older')
          } else rotate()
        }
      }
    },
    holderOf(fp) {
      const value = valueOf(fp)
      if (value === -1) return null
      return { tenant: tenantNames[value >> 1], isShared: (value & 1) === 1 }
    },
    isEvidence(tenant, fp) {
      const value = valueOf(fp)
      return value !== -1 && (value & 1) === 0 && tenantNames[value >> 1] !== tenant
    },
    expire,
    get numBytes() {
      return (newer.size + older.size) * bytesPerFingerprint
    },
    check() {
      newer.forEach((value, fp) => {
        const before = older.get(fp)
        if (before === -1) return
        // What the older generation knew is never lost: same tenant, or shared.
        assert(
          (value & 1) === 1 || before === value,
          `fingerprint ${fp}: ${before} became ${value}`,
        )
      })
      assert(newer.size + older.size <= maxFingerprints, 'fingerprints over the cap')
    },
  }
}
