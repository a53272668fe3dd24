/** TextStream: streamed pieces always add up to the text a non-streamed answer would have, and
 *  never include any part of a stop string. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import fc from 'fast-check'
import { TextStream } from '../../../src/router/tokenize/text-stream.js'

const alphabet = ['a', 'b', 'c', ' ', '\n']
const charDecode = (ids: readonly number[]) => ids.map((id) => alphabet[id]).join('')

/** The reference: stop at the first token after which a stop string occurs in the text; cut the
 *  text where the earliest occurrence starts. */
function reference(text: string, stops: string[]): { output: string; stoppedAt: number | null } {
  for (let k = 1; k <= text.length; k++) {
    const prefix = text.slice(0, k)
    const found = stops.map((s) => prefix.indexOf(s)).filter((i) => i !== -1)
    if (found.length > 0) return { output: prefix.slice(0, Math.min(...found)), stoppedAt: k }
  }
  return { output: text, stoppedAt: null }
}

describe('TextStream', () => {
  it('streams exactly the reference text and never sends part of a stop string', () => {
    const token = fc.integer({ min: 0, max: alphabet.length - 1 })
    const stop = fc.array(token, { minLength: 1, maxLength: 4 }).map(charDecode)
    fc.assert(
      fc.property(
        fc.array(token, { maxLength: 40 }),
        fc.array(stop, { maxLength: 4 }),
        (ids, stops) => {
          const want = reference(charDecode(ids), stops)
          const stream = new TextStream(charDecode, stops)
          let sent = ''
          let stoppedAt: number | null = null
          for (const [i, id] of ids.entries()) {
            const step = stream.push(id)
            stream.check()
            sent += step.text
            assert.ok(
              want.output.startsWith(sent),
              `sent ${JSON.stringify(sent)} beyond the output`,
            )
            if (step.isStopped) {
              stoppedAt = i + 1
              break
            }
          }
          if (stoppedAt === null) sent += stream.finish().text
          assert.equal(sent, want.output)
          assert.equal(stoppedAt, want.stoppedAt)
        },
      ),
      { numRuns: 500 },
    )
  })

  it('holds back a token that ends inside a multi-byte character', () => {
    const text = 'héllo ✓ 𝄞!'
    const bytes = [...Buffer.from(text, 'utf8')]
    const byteDecode = (ids: readonly number[]) =>
      Buffer.from(ids.map((i) => bytes[i])).toString('utf8')
    const stream = new TextStream(byteDecode, [])
    const pieces = bytes.map((_, i) => stream.push(i).text)
    pieces.push(stream.finish().text)
    assert.equal(pieces.join(''), text)
    assert.ok(pieces.every((p) => !p.includes('\uFFFD')))
  })

  it('refuses tokens after a stop', () => {
    const stream = new TextStream(charDecode, ['b'])
    assert.deepEqual(stream.push(0), { text: 'a', isStopped: false })
    assert.deepEqual(stream.push(1), { text: '', isStopped: true })
    assert.throws(() => stream.push(0))
  })
})
