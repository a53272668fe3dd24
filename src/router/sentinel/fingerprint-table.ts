/** A map from fingerprints (31-bit signed integers, see fingerprints.ts) to small non-negative
 *  values, in one typed array with open addressing (linear probing): one generation of the
 *  sentinel's fingerprint store. Entries are only added or changed, never removed one by one — a
 *  generation is dropped whole — so no deletion marks are needed.
 *  Why not a `Map`: every prompt token of every request is looked up and most are inserted, and
 *  V8's Map (a hash table of boxed entries with chains) cost several times what a probe into a
 *  typed array does, plus a garbage collector that walks the entries; here a table is one flat
 *  allocation.
 *  Bytes: 8 per slot, the load kept between 1/4 and 1/2 (doubling), so 16–32 bytes per entry:
 *  within fingerprints.ts's estimate of 32.
 *  Knows integers only. */

/** The key of an empty slot: a fingerprint is `h >> 1` of a 32-bit `h`, in [-2^30, 2^30), so
 *  2^31 − 1 is never one. */
const emptyKey = 0x7fffffff

/** Slots of a new table (a power of two). */
const initialSlots = 1024

/** The table: see the module's header. Each slot is two neighbouring words — key, then value —
 *  of one array, so a probe touches one cache line, not one in each of two arrays: the tables
 *  outgrow the caches within minutes of traffic, and a miss per array per probe was most of the
 *  sentinel's cost inside a busy router. */
export class FingerprintTable {
  /** `[key, value]` per slot; an empty slot's key is {@link emptyKey}. */
  private slots = emptySlots(initialSlots)
  /** Slots − 1 (a power of two − 1). */
  private mask = initialSlots - 1
  /** Entries held. */
  size = 0

  /** The value of `fp`, or -1 when absent. */
  get(fp: number): number {
    const { slots, mask } = this
    for (let i = slotOf(fp, mask); ; i = (i + 1) & mask) {
      const key = slots[2 * i]
      if (key === fp) return slots[2 * i + 1]
      if (key === emptyKey) return -1
    }
  }

  /** Sets `fp`'s value (≥ 0), adding the entry when absent. */
  set(fp: number, value: number): void {
    const { slots, mask } = this
    let i = slotOf(fp, mask)
    for (; ; i = (i + 1) & mask) {
      const key = slots[2 * i]
      if (key === fp) {
        slots[2 * i + 1] = value
        return
      }
      if (key === emptyKey) break
    }
    slots[2 * i] = fp
    slots[2 * i + 1] = value
    this.size++
    if (this.size * 2 > mask + 1) this.grow()
  }

  /** Calls `visit` with each entry. */
  forEach(visit: (value: number, fp: number) => void): void {
    const { slots } = this
    for (let i = 0; i < slots.length; i += 2)
      if (slots[i] !== emptyKey) visit(slots[i + 1], slots[i])
  }

  /** Doubles the slots and puts every entry back. */
  private grow(): void {
    const old = this.slots
    const numSlots = (this.mask + 1) * 2
    const slots = emptySlots(numSlots)
    const mask = numSlots - 1
    for (let j = 0; j < old.length; j += 2) {
      const fp = old[j]
      if (fp === emptyKey) continue
      let i = slotOf(fp, mask)
      while (slots[2 * i] !== emptyKey) i = (i + 1) & mask
      slots[2 * i] = fp
      slots[2 * i + 1] = old[j + 1]
    }
    this.slots = slots
    this.mask = mask
  }
}

/** `numSlots` empty slots (keys {@link emptyKey}, values 0). */
function emptySlots(numSlots: number): Int32Array {
  const slots = new Int32Array(2 * numSlots)
  for (let i = 0; i < slots.length; i += 2) slots[i] = emptyKey
  return slots
}

/** The first slot of `fp`: its low bits. A fingerprint is a keyed hash under a secret no client
 *  knows, so its bits are even and no tenant can choose prompts whose fingerprints collide in
 *  one run of slots. */
function slotOf(fp: number, mask: number): number {
  return fp & mask
}
