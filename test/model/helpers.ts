/** Shared by the forward-pass tests: a pool with scattered pages, and the largest difference of
 *  two logit vectors. */
import assert from 'node:assert/strict'
import { makeGuards } from '../../src/kv/guards.js'
import { KvPool } from '../../src/kv/pool.js'
import type { Model } from '../../src/model/weights.js'

/** Largest |a[i] − b[i]|; asserts equal lengths. */
export function maxAbsDiff(a: ArrayLike<number>, b: ArrayLike<number>): number {
  assert.equal(a.length, b.length)
  let m = 0
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i] - b[i]))
  return m
}

/** A 64-page pool (guards on) for `model` whose request pages (owner 7) alternate with another
 *  owner's, so that a forward pass must follow the page table; pages for `numTokens` tokens. */
export function scatteredSequence(model: Model, pageSize: number, numTokens: number) {
  const c = model.config
  const pool = new KvPool(
    {
      numPages: 64,
      pageSize,
      numLayers: c.numLayers,
      numKvHeads: c.numKvHeads,
      headDim: c.headDim,
    },
    makeGuards(true),
  )
  const pages = []
  for (let i = 0; i < pool.pagesFor(numTokens); i++) {
    pool.allocate(1, 99, 1) // someone else's page in between
    pages.push(...pool.allocate(1, 7, 2).pages)
  }
  return { pool, seq: { lease: { owner: 7, tenant: 2, pages } } }
}
