/** randomHex: fresh CSPRNG bytes as hex, drawn from a pool that refills itself. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { randomHex } from '../src/common/random-hex.js'

describe('randomHex', () => {
  it('gives 2 × n lowercase hex characters for n bytes', () => {
    for (const n of [1, 16, 32, 4096])
      assert.match(randomHex(n), new RegExp(`^[0-9a-f]{${2 * n}}$`))
  })

  it('never hands out the same bytes twice, across many refills of its 4 KiB pool', () => {
    // 10 000 draws of 32 bytes cross the pool ~78 times; a repeat of 256 random bits would
    // mean a byte range was handed out twice.
    const seen = new Set<string>()
    for (let i = 0; i < 10_000; i++) seen.add(randomHex(32))
    assert.equal(seen.size, 10_000)
  })

  it('draws unbiased bytes: each hex digit about 1/16 of a large sample', () => {
    const counts = new Map<string, number>()
    const numChars = 2 * 200_000
    for (let i = 0; i < 200_000 / 32; i++) {
      for (const ch of randomHex(32)) counts.set(ch, (counts.get(ch) ?? 0) + 1)
    }
    assert.equal(counts.size, 16)
    // Binomial(400 000, 1/16): standard deviation ~153; 8 deviations ~1 230, never reached by
    // a fair source in practice, always by a stuck or zeroed pool.
    for (const [ch, count] of counts) {
      assert.ok(Math.abs(count - numChars / 16) < 1_230, `digit ${ch}: ${count} of ${numChars}`)
    }
  })

  it('refuses sizes outside 1 to 4096 bytes', () => {
    for (const n of [0, -1, 4097, 1.5, Number.NaN]) {
      assert.throws(() => randomHex(n), { name: 'RangeError', message: /1 to 4096 bytes/ })
    }
  })
})
