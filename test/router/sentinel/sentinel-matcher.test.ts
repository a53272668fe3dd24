/** The response sentinel's matcher and fingerprint store, without sockets: exact run lengths,
 *  the exclusions (own prompt, own tenant, text sent by two tenants), canaries, the window, the
 *  memory cap, and what block mode holds back. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import {
  bytesPerFingerprint,
  createFingerprintStore,
  createNgramHasher,
  fingerprintsOf,
} from '../../../src/router/sentinel/fingerprints.js'
import {
  type SentinelEvent,
  type SentinelSettings,
  buildSentinelSettings,
  createSentinel,
} from '../../../src/router/sentinel/sentinel.js'

/** A prompt of `texts`, not counted: one character per token. */
const textPrompt = (...texts: string[]) => ({ texts, tokenIds: null, numTokens: null })

/** 40 characters that occur nowhere else in these tests. */
const passage = 'Zebra quilts vex jumpy frogs; 4 owls hum'

function sentinelOf(fields: Partial<SentinelSettings> = {}, now = () => 0) {
  const events: SentinelEvent[] = []
  const settings = buildSentinelSettings({ mode: 'observe', ...fields })
  const key = new Uint8Array(16).fill(7)
  const sentinel = createSentinel({ settings, onEvent: (e) => events.push(e), now, key })
  return { sentinel, events }
}

/** Pushes `answer` one character at a time; returns what was released and the thrown error. */
function answerWith(
  check: ReturnType<ReturnType<typeof sentinelOf>['sentinel']['admit']>,
  answer: string,
) {
  let released = ''
  try {
    for (const c of answer) released += check.push(c)
    released += check.finish()
    return { released, error: null }
  } catch (err) {
    return { released, error: err as Error & { code?: string } }
  }
}

describe('fingerprints', () => {
  it('a keyed hash: the same n-gram under the same key matches, under another key does not', () => {
    const a = createNgramHasher(new Uint8Array(16).fill(1))
    const b = createNgramHasher(new Uint8Array(16).fill(2))
    assert.equal(a('xxabcdefgh', 2, 8), a('abcdefgh', 0, 8))
    assert.notEqual(a('abcdefgh', 0, 8), b('abcdefgh', 0, 8))
    assert.notEqual(a('abcdefgh', 0, 8), a('abcdefgi', 0, 8))
    assert(a('abcdefgh', 0, 8) < 2 ** 52 && a('abcdefgh', 0, 8) >= 0)
  })

  it('a 40-character text has 33 8-grams, 12 repeated letters 5 equal ones, 5 letters none', () => {
    const hash = createNgramHasher()
    assert.equal(fingerprintsOf(hash, passage, 8).length, 33)
    assert.equal(new Set(fingerprintsOf(hash, passage, 8)).size, 33)
    assert.equal(new Set(fingerprintsOf(hash, 'aaaaaaaaaaaa', 8)).size, 1)
    assert.equal(fingerprintsOf(hash, 'aaaaaaaaaaaa', 8).length, 5)
    assert.equal(fingerprintsOf(hash, 'short', 8).length, 0)
  })

  it('the store knows the latest tenant and sharing, drops a generation each half window and at its cap', () => {
    let nowMs = 0
    const store = createFingerprintStore({
      windowMs: 1000,
      maxBytes: 10 * bytesPerFingerprint,
      now: () => nowMs,
    })
    store.add('a', Int32Array.of(1, 2, 3))
    store.add('b', Int32Array.of(3, 4))
    store.add('a', Int32Array.of(3))
    store.check()
    assert.deepEqual(store.holderOf(1), { tenant: 'a', isShared: false })
    assert.deepEqual(store.holderOf(3), { tenant: 'a', isShared: true })
    assert.deepEqual(store.holderOf(4), { tenant: 'b', isShared: false })
    assert.equal(store.holderOf(5), null)
    assert.deepEqual(
      [
        store.isEvidence('a', 4),
        store.isEvidence('b', 4),
        store.isEvidence('b', 1),
        store.isEvidence('c', 3),
      ],
      [true, false, true, false],
    )
    assert.equal(store.numBytes, 4 * bytesPerFingerprint)
    // Half a window: 1..4 become the older generation, still known.
    nowMs = 500
    store.add('c', Int32Array.of(10))
    assert.equal(store.numBytes, 5 * bytesPerFingerprint)
    assert.deepEqual(store.holderOf(1), { tenant: 'a', isShared: false })
    // 4 older + 7 newer > 10: the older generation goes.
    store.add('c', Int32Array.of(11, 12, 13, 14, 15, 16))
    store.check()
    assert.equal(store.holderOf(1), null)
    assert.equal(store.numBytes, 7 * bytesPerFingerprint)
    nowMs = 1000
    store.expire()
    assert.deepEqual(store.holderOf(10), { tenant: 'c', isShared: false })
    nowMs = 2000
    store.expire()
    assert.equal(store.numBytes, 0)
    assert.equal(store.holderOf(10), null)
  })
})

describe('the matcher in character mode, prompts not counted (1 character a token; n = 8, minRunTokens = 16)', () => {
  it('a 16-character run of another tenant’s prompt is suspected; 15 characters are not', () => {
    const { sentinel, events } = sentinelOf()
    sentinel.admit('a', false, 'ra', textPrompt(`tell me: ${passage}`))
    answerWith(
      sentinel.admit('b', false, 'rb1', textPrompt('hello')),
      `ok#${passage.slice(0, 15)}#ok`,
    )
    assert.deepEqual(events, [])
    answerWith(
      sentinel.admit('b', false, 'rb2', textPrompt('hello')),
      `ok#${passage.slice(0, 16)}#ok`,
    )
    assert.deepEqual(events, [
      {
        kind: 'suspected',
        rid: 'rb2',
        tenant: 'b',
        sourceTenant: 'a',
        runTokens: 16,
        runCharacters: 16,
      },
    ])
    sentinel.check()
  })

  it('one changed character in the middle splits a 31-character echo into runs of 15: no event', () => {
    const { sentinel, events } = sentinelOf()
    sentinel.admit('a', false, 'ra', textPrompt(passage))
    // passage[0..31) with the 16th character replaced: 15 + 1 + 15, each side shorter than 16.
    const echo = `${passage.slice(0, 15)}#${passage.slice(16, 31)}`
    answerWith(sentinel.admit('b', false, 'rb', textPrompt('x')), echo)
    assert.deepEqual(events, [])
  })

  it('text in the answering request’s own prompt or its tenant’s recent prompts is no evidence', () => {
    const { sentinel, events } = sentinelOf()
    sentinel.admit('a', false, 'ra', textPrompt(passage))
    answerWith(sentinel.admit('b', false, 'rb1', textPrompt(`repeat ${passage}`)), passage)
    // rb1's prompt now holds the passage for b too: two holders, and b's own.
    answerWith(sentinel.admit('b', false, 'rb2', textPrompt('again')), passage)
    answerWith(sentinel.admit('a', false, 'ra2', textPrompt('again')), passage)
    assert.deepEqual(events, [])
  })

  it('text sent by two tenants is no evidence for a third', () => {
    const { sentinel, events } = sentinelOf()
    sentinel.admit('a', false, 'ra', textPrompt(passage))
    sentinel.admit('b', false, 'rb', textPrompt(passage))
    answerWith(sentinel.admit('c', false, 'rc', textPrompt('x')), passage)
    assert.deepEqual(events, [])
  })

  it('a prompt older than the window is forgotten', () => {
    let nowMs = 0
    const { sentinel, events } = sentinelOf({ windowSeconds: 1 }, () => nowMs)
    sentinel.admit('a', false, 'ra', textPrompt(passage))
    nowMs = 1001
    answerWith(sentinel.admit('b', false, 'rb', textPrompt('x')), passage)
    assert.deepEqual(events, [])
  })

  it('8 characters of a canary tenant’s canary in another tenant’s answer are confirmed', () => {
    const { sentinel, events } = sentinelOf()
    const canary = 'Qx7vR2mK9pLt4Wz8'
    sentinel.admit('watch', true, 'rw', textPrompt(`remember ${canary} please`))
    // 7 characters: nothing; 8 characters ("R2mK9pLt"): confirmed, and no suspected run (< 16).
    answerWith(sentinel.admit('b', false, 'rb1', textPrompt('x')), 'see R2mK9pL here')
    assert.deepEqual(events, [])
    answerWith(sentinel.admit('b', false, 'rb2', textPrompt('x')), 'see R2mK9pLt here')
    assert.deepEqual(events, [
      {
        kind: 'confirmed',
        rid: 'rb2',
        tenant: 'b',
        sourceTenant: 'watch',
        runTokens: null,
        runCharacters: 8,
      },
    ])
  })

  it('only mixed alphanumeric runs of 12 or more are canaries: words and numbers are not', () => {
    const { sentinel, events } = sentinelOf()
    sentinel.admit(
      'watch',
      true,
      'rw',
      textPrompt('internationalization 123456789012345 Ab3defghijk'),
    )
    answerWith(
      sentinel.admit('b', false, 'rb', textPrompt('x')),
      'internationalization 123456789012345 Ab3defghijk',
    )
    // Words, digits only, and an 11-character mixed run: none learnt; the 48 characters are a
    // run of another tenant's prompt, though.
    assert.deepEqual(
      events.map((e) => e.kind),
      ['suspected'],
    )
  })

  it('block mode releases all but the held units and withholds a suspect run entirely', () => {
    const { sentinel } = sentinelOf({ mode: 'block' })
    sentinel.admit('a', false, 'ra', textPrompt(passage))
    const clean = answerWith(
      sentinel.admit('b', false, 'rb1', textPrompt('x')),
      'a clean answer of thirty chars',
    )
    assert.deepEqual(clean, { released: 'a clean answer of thirty chars', error: null })
    const prefix = 'The answer is: '
    const leak = answerWith(
      sentinel.admit('b', false, 'rb2', textPrompt('x')),
      `${prefix}${passage}`,
    )
    assert.equal(leak.error?.code, 'answer_withheld')
    // The run starts at the passage: every character before it went out, none of it did.
    assert.equal(leak.released, prefix)
  })

  it('block mode holds back only the run: 7 units when no n-gram matches', () => {
    const { sentinel } = sentinelOf({ mode: 'block' })
    sentinel.admit('a', false, 'ra', textPrompt(passage))
    const check = sentinel.admit('b', false, 'rb', textPrompt('x'))
    assert.equal(check.push('0123456789abcdef'), '012345678')
    // 10 characters of the passage: a run of 3 n-grams, its 10 units held; the 7 before go.
    assert.equal(check.push(passage.slice(0, 10)), '9abcdef')
    assert.equal(check.push('!!!!!!!!!!'), `${passage.slice(0, 10)}!!!`)
    assert.equal(check.finish(), '!!!!!!!')
  })

  it('block mode never releases half of a surrogate pair', () => {
    const { sentinel } = sentinelOf({ mode: 'block' })
    const check = sentinel.admit('b', false, 'rb', textPrompt('x'))
    // 10 code units, 7 held: the boundary would fall inside the emoji (units 2 and 3).
    assert.equal(check.push('ab\u{1F600}cdefgh'), 'ab')
    assert.equal(check.finish(), '\u{1F600}cdefgh')
  })

  it('observe mode passes every piece as it comes, suspect or not, and holds nothing back', () => {
    const { sentinel, events } = sentinelOf()
    sentinel.admit('a', false, 'ra', textPrompt(passage))
    assert.deepEqual(answerWith(sentinel.admit('b', false, 'rb', textPrompt('x')), passage), {
      released: passage,
      error: null,
    })
    assert.equal(events.length, 1)
  })

  it('off mode keeps nothing and passes every piece', () => {
    const { sentinel, events } = sentinelOf({ mode: 'off' })
    sentinel.admit('a', false, 'ra', textPrompt(passage))
    assert.deepEqual(answerWith(sentinel.admit('b', false, 'rb', textPrompt('x')), passage), {
      released: passage,
      error: null,
    })
    assert.deepEqual(events, [])
    assert.equal(sentinel.numBytes, 0)
  })

  it('settings: a run shorter than an n-gram is refused', () => {
    assert.throws(
      () => buildSentinelSettings({ ngramTokens: 8, minRunTokens: 7 }),
      (err: Error & { code?: string }) => err.code === 'config_invalid',
    )
  })
})

describe('the matcher in character mode, prompts counted (n = 8, minRunTokens = 16)', () => {
  const counted = (text: string, numTokens: number) => ({
    texts: [text],
    tokenIds: null,
    numTokens,
  })

  it('a run is measured by the characters per token of its tenant’s prompts in the window, not since start', () => {
    let nowMs = 0
    const { sentinel, events } = sentinelOf({ windowSeconds: 1 }, () => nowMs)
    // 4 characters a token, then (at half a window, the generations swap) 2 a token.
    sentinel.admit('a', false, 'ra1', counted('q'.repeat(400), 100))
    nowMs = 500
    sentinel.admit('a', false, 'ra2', counted(passage, 20))
    // Both prompts in the window: c = 440, t = 120, a run needs ⌈16 × 440 ÷ 120⌉ = 59 characters.
    answerWith(sentinel.admit('b', false, 'rb1', textPrompt('x')), passage)
    assert.deepEqual(events, [])
    // The next swap drops the 400-character prompt: c = 40 + 16, t = 20 + 8, 2 characters a
    // token, so 32 characters of the passage are 16 tokens. Counted since start they would be
    // ⌈16 × 456 ÷ 128⌉ = 57 characters, more than the passage has.
    nowMs = 1000
    sentinel.admit('a', false, 'ra3', counted('mnopmnopmnopmnop', 8))
    answerWith(sentinel.admit('b', false, 'rb2', textPrompt('x')), passage)
    assert.deepEqual(events, [
      {
        kind: 'suspected',
        rid: 'rb2',
        tenant: 'b',
        sourceTenant: 'a',
        runTokens: 16,
        runCharacters: 32,
      },
    ])
    // A whole window without a prompt of `a`: everything is forgotten, its counts too.
    nowMs = 2500
    sentinel.admit('a', false, 'ra4', counted('zyxwzyxwzyxwzyxw', 16))
    answerWith(sentinel.admit('b', false, 'rb3', textPrompt('x')), passage)
    assert.equal(events.length, 1)
    sentinel.check()
  })
})
