/** The store of the Responses API: each tenant's bounds in count and bytes, its oldest evicted
 *  first and no other tenant's; lookups answer an unknown and a foreign id alike. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import fc from 'fast-check'
import { KvfenceError } from '../../../src/common/errors.js'
import { ResponseStore } from '../../../src/router/responses/store.js'

const idOf = (n: number) => `resp_${n.toString(16).padStart(32, '0')}`
const body = (n: number) => ({ id: idOf(n), object: 'response' })

/** The error `call` throws, as {code, message, param}. */
function thrown(call: () => unknown): { code: string; message: string; param: string | null } {
  try {
    call()
  } catch (err) {
    assert.ok(err instanceof KvfenceError)
    return { code: err.code, message: err.message, param: err.param }
  }
  assert.fail('did not throw')
}

describe('ResponseStore', () => {
  it("keeps each tenant's newest responses within the count bound; another tenant's are untouched", () => {
    const store = new ResponseStore({ maxResponsesPerTenant: 3, maxBytesPerTenant: 1 << 20 })
    store.put('beta', body(100), [])
    for (let n = 1; n <= 5; n++) store.put('alpha', body(n), [])
    assert.equal(store.size, 4)
    for (const n of [1, 2])
      assert.equal(thrown(() => store.get('alpha', idOf(n), null)).code, 'not_found')
    for (const n of [3, 4, 5]) assert.equal(store.get('alpha', idOf(n), null).body.id, idOf(n))
    assert.equal(store.get('beta', idOf(100), null).tenant, 'beta')
  })

  it('evicts by bytes: an entry of B bytes under a bound of 2B + 1 keeps two', () => {
    const conversation = [{ role: 'user', content: 'x'.repeat(1000) }]
    const probe = new ResponseStore()
    probe.put('alpha', body(1), conversation)
    const numBytes = probe.get('alpha', idOf(1), null).numBytes
    assert.equal(numBytes, JSON.stringify(body(1)).length + 1000 + 'user'.length + 16)
    const store = new ResponseStore({
      maxResponsesPerTenant: 100,
      maxBytesPerTenant: 2 * numBytes + 1,
    })
    for (let n = 1; n <= 4; n++) assert.equal(store.put('alpha', body(n), conversation), true)
    assert.equal(store.size, 2)
    assert.equal(store.get('alpha', idOf(4), null).body.id, idOf(4))
    // Larger than the bound alone: not stored.
    const small = new ResponseStore({ maxResponsesPerTenant: 100, maxBytesPerTenant: numBytes - 1 })
    assert.equal(small.put('alpha', body(1), conversation), false)
    assert.equal(small.size, 0)
  })

  it("an unknown id and another tenant's id throw the same error; a malformed one 400", () => {
    const store = new ResponseStore()
    store.put('alpha', body(7), [])
    const foreign = thrown(() => store.get('beta', idOf(7), 'previous_response_id'))
    const unknown = thrown(() => store.get('beta', idOf(8), 'previous_response_id'))
    assert.deepEqual(foreign, { ...unknown, message: unknown.message.replace(idOf(8), idOf(7)) })
    assert.equal(foreign.code, 'not_found')
    assert.equal(thrown(() => store.get('beta', 'resp_7', null)).code, 'invalid_request')
    assert.equal(thrown(() => store.delete('beta', idOf(7))).code, 'not_found')
    assert.equal(store.get('alpha', idOf(7), null).tenant, 'alpha')
  })

  it('property: within the bounds, every tenant keeps exactly its newest puts', () => {
    fc.assert(
      fc.property(
        fc.array(fc.constantFrom('a', 'b', 'c'), { maxLength: 60 }),
        fc.integer({ min: 1, max: 5 }),
        (tenants, maxCount) => {
          const store = new ResponseStore({
            maxResponsesPerTenant: maxCount,
            maxBytesPerTenant: 1 << 20,
          })
          tenants.forEach((t, n) => store.put(t, body(n), []))
          for (const t of ['a', 'b', 'c']) {
            const mine = tenants.flatMap((u, n) => (u === t ? [n] : []))
            const kept = mine.slice(-maxCount)
            for (const n of mine) {
              const isKept = kept.includes(n)
              const found = (() => {
                try {
                  return store.get(t, idOf(n), null).tenant === t
                } catch {
                  return false
                }
              })()
              assert.equal(found, isKept)
            }
          }
        },
      ),
    )
  })
})
