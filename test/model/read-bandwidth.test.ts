/** The benchmark's read-bandwidth meter (bench/read-bandwidth.ts, the `sumF32` kernel of
 *  asm/kernels.ts run by the compute threads) reads every value of its buffer once, whatever the
 *  thread count: a round over a buffer of ones sums to the number of values. No timing here. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { openReadMeter } from '../../bench/read-bandwidth.js'

describe('read-bandwidth meter', () => {
  for (const threads of [1, 2, 3]) {
    it(`sums every one of 1 MiB + 64 B of ones exactly once with ${threads} thread(s)`, () => {
      const meter = openReadMeter(threads, 1024 * 1024 + 64)
      try {
        assert.equal(meter.bytes, 1024 * 1024 + 64)
        meter.measure(1)
        assert.equal(meter.sum(), (1024 * 1024 + 64) / 4)
      } finally {
        meter.close()
      }
    })
  }
})
