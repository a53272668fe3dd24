/** A map from fingerprints (31-bit signed integers, see fingerprints.ts) to small non-negative
 *  values, in two typed arrays with open addressing (linear probing): one generation of the
 *  sentinel's fingerprint store. Entries are only added or changed, never removed one by one — a
 *  generation is dropped whole — so no deletion marks are needed.
 *  Why not a `Map`: every prompt token of every request is looked up and most are inserted, and
 *  V8's Map (a hash table of boxed entries with chains) cost several times what a probe into two
 *  typed arrays does, plus a garbage collector that walks the entries; here the tables are two
 *  flat allocations.
 *  Bytes: 8 per slot, the load kept between 1/4 and 1/2 (doubling), so 16–32 bytes per entry:
 *  within fingerprints.ts's estimate of 32.
 *  Knows integers only. */

/** The key of an empty slot: a fingerprint is `h >> 1` of a 32-bit `h`, in [-2^30, 2^30), so
 *  2^31 − 1 is never one. */
const emptyKey = 0x7fffffff

/** Slots of a new table (a power of two). */
const initialSlots = 1024

/** The table: see the module's header. */
export class FingerprintTable {
  private keys = new Int32Array(initialSlots).fill(emptyKey)
  private values = new Int32Array(initialSlots)
  private mask = initialSlots - 1
  /** Entries held. */
  size = 0

  /** The value of `fp`, or -1 when absent. */
  get(fp: number): number {
    const { keys, mask } = this
    for (let i = slotOf(fp, mask); ; i = (i + 1) & mask) {
      const key = keys[i]
      if (key === fp) return this.values[i]
      if (key === emptyKey) return -1
    }
  }

  /** Sets `fp`'s value (≥ 0), adding the entry when absent. */
  set(fp: number, value: number): void {
    const { keys, mask } = this
    let i = slotOf(fp, mask)
    for (; ; i = (i + 1) & mask) {
      const key = keys[i]
      if (key === fp) {
        this.values[i] = value
        return
      }
      if (key === emptyKey) break
    }
    keys[i] = fp
    this.values[i] = value
    this.size++
    if (this.size * 2 > keys.length) this.grow()
  }

  /** Calls `visit` with each entry. */
  forEach(visit: (value: number, fp: number) => void): void {
    const { keys, values } = this
    for (let i = 0; i < keys.length; i++) if (keys[i] !== emptyKey) visit(values[i], keys[i])
  }

  /** Doubles the slots and puts every entry back. */
  private grow(): void {
    const { keys, values } = this
    const numSlots = keys.length * 2
    this.keys = new Int32Array(numSlots).fill(emptyKey)
    this.values = new Int32Array(numSlots)
    this.mask = numSlots - 1
    for (let j = 0; j < keys.length; j++) {
      const fp = keys[j]
      if (fp === emptyKey) continue
      let i = slotOf(fp, this.mask)
      while (this.keys[i] !== emptyKey) i = (i + 1) & this.mask
      this.keys[i] = fp
      this.values[i] = values[j]
    }
  }
}

/** The first slot of `fp`: its low bits. A fingerprint is a keyed hash under a secret no client
 *  knows, so its bits are even and no tenant can choose prompts whose fingerprints collide in
 *  one run of slots. */
function slotOf(fp: number, mask: number): number {
  return fp & mask
}
