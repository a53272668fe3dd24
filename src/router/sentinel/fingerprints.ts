/** Keyed fingerprints of text n-grams, and the per-tenant window that holds the fingerprints of
 *  every tenant's recent prompts for the response sentinel.
 *  A fingerprint is a 52-bit keyed hash of `n` consecutive UTF-16 code units of text, under a
 *  secret drawn once per process (never logged, never written): the store holds no text, and a
 *  fingerprint means nothing without the key. With the bundled model's character-level
 *  vocabulary a code unit is a token; the router's answer hooks see text, not token ids, in both
 *  modes, which is why the unit is the character (see docs/monitoring.md).
 *  Knows tenants' names, request ids and numbers; knows nothing of HTTP or of the text itself
 *  once hashed. */
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

/** A keyed hash of `n` code units of `text` starting at `start` (`start + n ≤ text.length`),
 *  as a non-negative integer below 2^52 (exact in a double, so usable as a Map key). */
export type NgramHasher = (text: string, start: number, n: number) => number

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
  return (text, start, n) => {
    let a = k0 ^ n
    let b = k1
    for (let i = start; i < start + n; i++) {
      const c = text.charCodeAt(i)
      a = Math.imul(a ^ c, 0x9e3779b1)
      a ^= a >>> 15
      b = Math.imul(b ^ c ^ k2, 0x85ebca6b)
      b ^= b >>> 13
    }
    a = finalize(a ^ k3)
    b = finalize(b ^ k2)
    return (a >>> 0) * 0x100000 + (b >>> 12)
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

/** Every distinct fingerprint of `text`'s n-grams (none when `text` is shorter than `n`). */
export function fingerprintsOf(hash: NgramHasher, text: string, n: number): Float64Array {
  const seen = new Set<number>()
  for (let start = 0; start + n <= text.length; start++) seen.add(hash(text, start, n))
  return Float64Array.from(seen)
}

/** Estimated bytes one stored fingerprint costs: 8 in its prompt's array, and an entry (~40 bytes
 *  each, V8's Map on 64-bit) in its tenant's map and in the map of holders. An estimate, for the
 *  cap and the gauge, not a measurement. */
export const bytesPerFingerprint = 88

/** One prompt's fingerprints, as admitted. */
interface Entry {
  readonly atMs: number
  readonly tenant: string
  /** The prompt's request id, for the sentinel's log line. */
  readonly rid: string
  readonly fingerprints: Float64Array
}

/** Fingerprints of every tenant's recent prompts: a prompt stays for `windowMs` after its
 *  admission, or until the memory cap makes room for newer ones (oldest first). */
export interface FingerprintStore {
  /** Adds one prompt's distinct fingerprints for `tenant` (truncated to what the cap holds). */
  add(tenant: string, rid: string, fingerprints: Float64Array): void
  /** Tenants holding `fingerprint` in their window now (0, 1, 2, ...). */
  numHolders(fingerprint: number): number
  /** Whether `tenant` holds `fingerprint` in its window now. */
  isHeldBy(tenant: string, fingerprint: number): boolean
  /** The most recent prompt of a tenant other than `except` holding `fingerprint`, or null
   *  (a scan: for the log line of an event only). */
  sourceOf(fingerprint: number, except: string): { tenant: string; rid: string } | null
  /** Drops prompts older than the window. */
  expire(): void
  /** Estimated bytes used ({@link bytesPerFingerprint} per stored fingerprint). */
  readonly numBytes: number
  /** Asserts that the maps and the prompts agree. */
  check(): void
}

/** Options of {@link createFingerprintStore}. */
export interface FingerprintStoreOptions {
  /** How long a prompt's fingerprints stay, ms. */
  windowMs: number
  /** Cap on {@link FingerprintStore.numBytes}. */
  maxBytes: number
  /** The clock, ms (default `Date.now`). */
  now?: () => number
}

/** An empty {@link FingerprintStore}. */
export function createFingerprintStore(options: FingerprintStoreOptions): FingerprintStore {
  const now = options.now ?? Date.now
  const maxFingerprints = Math.floor(options.maxBytes / bytesPerFingerprint)
  // Oldest first; `head` is the first live one (the array is compacted when half is dead).
  let entries: Entry[] = []
  let head = 0
  let numStored = 0
  /** Per tenant: fingerprint → how many of its live prompts hold it. */
  const byTenant = new Map<string, Map<number, number>>()
  /** Fingerprint → how many tenants hold it. */
  const holders = new Map<number, number>()

  const dropOldest = () => {
    const entry = entries[head]
    entries[head] = undefined as unknown as Entry
    head++
    numStored -= entry.fingerprints.length
    const own = byTenant.get(entry.tenant)
    assert(own !== undefined, `tenant ${entry.tenant} has a prompt but no fingerprints`)
    for (const fp of entry.fingerprints) {
      const count = own.get(fp) ?? 0
      if (count > 1) {
        own.set(fp, count - 1)
        continue
      }
      own.delete(fp)
      const numHolders = holders.get(fp) ?? 0
      if (numHolders > 1) holders.set(fp, numHolders - 1)
      else holders.delete(fp)
    }
    if (own.size === 0) byTenant.delete(entry.tenant)
    if (head > 64 && head * 2 > entries.length) {
      entries = entries.slice(head)
      head = 0
    }
  }
  const expire = () => {
    const oldestMs = now() - options.windowMs
    while (head < entries.length && entries[head].atMs < oldestMs) dropOldest()
  }

  return {
    add(tenant, rid, fingerprints) {
      expire()
      const kept =
        fingerprints.length > maxFingerprints
          ? fingerprints.subarray(0, maxFingerprints)
          : fingerprints
      while (head < entries.length && numStored + kept.length > maxFingerprints) dropOldest()
      if (kept.length === 0) return
      let own = byTenant.get(tenant)
      if (own === undefined) byTenant.set(tenant, (own = new Map()))
      for (const fp of kept) {
        const count = own.get(fp) ?? 0
        own.set(fp, count + 1)
        if (count === 0) holders.set(fp, (holders.get(fp) ?? 0) + 1)
      }
      entries.push({ atMs: now(), tenant, rid, fingerprints: kept })
      numStored += kept.length
    },
    numHolders: (fp) => holders.get(fp) ?? 0,
    isHeldBy: (tenant, fp) => byTenant.get(tenant)?.has(fp) ?? false,
    sourceOf(fp, except) {
      for (let i = entries.length - 1; i >= head; i--) {
        const entry = entries[i]
        if (entry.tenant !== except && entry.fingerprints.includes(fp)) {
          return { tenant: entry.tenant, rid: entry.rid }
        }
      }
      return null
    },
    expire,
    get numBytes() {
      return numStored * bytesPerFingerprint
    },
    check() {
      let numInEntries = 0
      const numTenantsOf = new Map<number, Set<string>>()
      for (let i = head; i < entries.length; i++) {
        numInEntries += entries[i].fingerprints.length
        for (const fp of entries[i].fingerprints) {
          let set = numTenantsOf.get(fp)
          if (set === undefined) numTenantsOf.set(fp, (set = new Set()))
          set.add(entries[i].tenant)
        }
      }
      assert.equal(
        numStored,
        numInEntries,
        `${numStored} fingerprints counted, ${numInEntries} held`,
      )
      assert.equal(holders.size, numTenantsOf.size, 'holders and prompts disagree on fingerprints')
      for (const [fp, set] of numTenantsOf) {
        assert.equal(holders.get(fp), set.size, `fingerprint ${fp}: holder count`)
      }
      assert(
        numStored <= maxFingerprints,
        `${numStored} fingerprints over the cap ${maxFingerprints}`,
      )
    },
  }
}
