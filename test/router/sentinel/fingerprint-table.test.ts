/** The sentinel's fingerprint table answers as a `Map` would, through every growth: property
 *  tests over random fingerprints (the full 31-bit signed range, repeats and updates included). */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import fc from 'fast-check'
import { FingerprintTable } from '../../../src/router/sentinel/fingerprint-table.js'

/** A fingerprint as fingerprints.ts makes them: `h >> 1` of a 32-bit `h`. */
const fingerprint = fc.integer({ min: -(2 ** 30), max: 2 ** 30 - 1 })

describe('FingerprintTable', () => {
  it('property: after any sets, get, size and forEach agree with a Map', () => {
    fc.assert(
      fc.property(
        fc.array(fc.tuple(fingerprint, fc.nat({ max: 2 ** 20 })), { maxLength: 3000 }),
        fc.array(fingerprint, { maxLength: 50 }),
        (sets, probes) => {
          const table = new FingerprintTable()
          const model = new Map<number, number>()
          for (const [fp, value] of sets) {
            table.set(fp, value)
            model.set(fp, value)
          }
          assert.equal(table.size, model.size)
          for (const fp of [...model.keys(), ...probes])
            assert.equal(table.get(fp), model.get(fp) ?? -1)
          const seen = new Map<number, number>()
          table.forEach((value, fp) => seen.set(fp, value))
          assert.deepEqual(seen, model)
        },
      ),
      { numRuns: 200 },
    )
  })

  it('keeps keys that share their low bits apart (one run of slots), through growth', () => {
    const table = new FingerprintTable()
    const keys = Array.from({ length: 5000 }, (_, i) => i * 4096 - 2 ** 30)
    keys.forEach((fp, i) => table.set(fp, i))
    assert.equal(table.size, keys.length)
    keys.forEach((fp, i) => assert.equal(table.get(fp), i))
    assert.equal(table.get(4096 * 5000), -1)
  })
})
