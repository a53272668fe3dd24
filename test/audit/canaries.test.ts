/** The canary detector and redaction: what counts as a leak, and what a report may show. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import fc from 'fast-check'
import {
  findCanaries,
  findFragment,
  makeCanaries,
  makeCanary,
  minFragmentLength,
  plantingPrompt,
  redact,
  redactionMark,
} from '../../src/audit/canaries.js'
import { createRng } from '../../src/audit/rng.js'

const canary = 'Q7mZr2kWx9PbT4vNcH8d'

describe('canary detector', () => {
  test('finds a fragment of 8 characters and ignores one of 7', () => {
    assert.equal(minFragmentLength, 8)
    const eight = canary.slice(5, 13)
    const seven = canary.slice(5, 12)
    const hit = findFragment(`the river ${eight} stone`, canary)
    assert.deepEqual(hit, { canary, fragment: eight, index: 10 })
    assert.equal(findFragment(`the river ${seven} stone`, canary), null)
  })

  test('reports the longest fragment and every canary present', () => {
    const other = 'Lp3XbV0qYt6sUe1RwA'
    const text = `a ${canary.slice(2)} b ${other} c`
    const matches = findCanaries(text, [canary, other, 'Zz9Yy8Xx7Ww6Vv5Uu4'])
    assert.deepEqual(
      matches.map((m) => m.fragment),
      [canary.slice(2), other],
    )
  })

  test('any fragment of at least 8 characters is found wherever it sits (property)', () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 0, max: 2 ** 32 - 1 }),
        fc.string({ maxLength: 60 }),
        fc.string({ maxLength: 60 }),
        fc.nat(),
        fc.nat(),
        (seed, before, after, a, b) => {
          const c = makeCanary(createRng(seed, 'property'))
          const length = minFragmentLength + (a % (c.length - minFragmentLength + 1))
          const start = b % (c.length - length + 1)
          const fragment = c.slice(start, start + length)
          const hit = findFragment(`${before}${fragment}${after}`, c)
          assert.ok(hit !== null && hit.fragment.length >= length)
          // 7 characters between separators never match.
          assert.equal(
            findFragment(`${before} ${fragment.slice(0, 7)} `.replace(/[A-Za-z0-9]{8,}/g, ''), c),
            null,
          )
        },
      ),
    )
  })
})

describe('redaction', () => {
  test('keeps canary characters and replaces everything else with ·', () => {
    const text = `secret customer data ${canary} more private words`
    const excerpt = redact(text, [canary], text.indexOf(canary))
    assert.equal(excerpt.length, text.length)
    assert.ok(excerpt.includes(canary))
    assert.equal(excerpt.replace(canary, ''), redactionMark.repeat(text.length - canary.length))
  })

  test('an excerpt is at most maxLength characters and shows only canary fragments (property)', () => {
    fc.assert(
      fc.property(
        fc.string({ maxLength: 400 }),
        fc.string({ maxLength: 400 }),
        fc.nat(),
        (pre, post, cut) => {
          const fragment = canary.slice(cut % 8, (cut % 8) + 8 + (cut % 5))
          const text = `${pre}${fragment}${post}`
          const excerpt = redact(text, [canary], pre.length, 120)
          assert.ok(excerpt.length <= 120)
          assert.ok(excerpt.includes(fragment), 'the matched fragment is shown')
          for (const run of excerpt.split(redactionMark).filter((r) => r !== '')) {
            assert.ok(
              run.length >= minFragmentLength && canary.includes(run),
              `only canary text: ${run}`,
            )
          }
        },
      ),
    )
  })
})

describe('redaction of planted material', () => {
  const planted = 'the river walks near Q7mZr2kWx9PbT4vNcH8d and the stone garden'

  test("keeps runs of ≥ 8 characters of the victim's planted prompt, and nothing else", () => {
    // " walks near " is in the planted prompt; "customax" and "private" are not; "the " is too short.
    const text = 'customax walks near the private the '
    const excerpt = redact(text, [canary], 0, 160, [planted])
    assert.equal(excerpt, '·'.repeat(8) + ' walks near ' + '·'.repeat(16))
  })

  test('a 7-character run of planted text stays hidden; the whole leaked sentence shows', () => {
    assert.equal(redact('xx walks yy', [], 0, 160, [planted]), '·'.repeat(11))
    const leaked = `B got:${planted.slice(4, 40)} end`
    assert.equal(
      redact(leaked, [canary], 0, 160, [planted]),
      `${'·'.repeat(6)}${planted.slice(4, 40)}${'·'.repeat(4)}`,
    )
  })

  test('without planted texts only canaries survive (property: every kept run is planted)', () => {
    fc.assert(
      fc.property(fc.string({ maxLength: 200 }), fc.nat(), (noise, cut) => {
        const piece = planted.slice(cut % 20, (cut % 20) + 8 + (cut % 9))
        const excerpt = redact(`${noise}${piece}${noise}`, [], noise.length, 160, [planted])
        for (const run of excerpt.split(redactionMark).filter((r) => r !== ''))
          assert.ok(planted.includes(run), `kept ${JSON.stringify(run)} is not planted text`)
      }),
    )
  })
})

describe('canaries', () => {
  test('are 16–24 alphanumerics with digits, capitals and lowercase; prompts are 200–350 characters', () => {
    const rng = createRng(1, 'shape')
    for (let i = 0; i < 200; i++) {
      const c = makeCanary(rng)
      assert.match(c, /^[A-Za-z0-9]{16,24}$/)
      assert.match(c, /[0-9].*[0-9]/)
      assert.match(c, /[A-Z]/)
      assert.match(c, /[a-z]/)
    }
    for (let i = 0; i < 50; i++) {
      const canaries = makeCanaries(rng, 3)
      const prompt = plantingPrompt(rng, canaries)
      assert.ok(prompt.length >= 200 && prompt.length <= 350, `length ${prompt.length}`)
      for (const c of canaries) assert.ok(prompt.includes(c))
      assert.deepEqual(
        findCanaries(
          prompt
            .split(' ')
            .filter((w) => !canaries.includes(w))
            .join(' '),
          canaries,
        ),
        [],
        'filler alone never matches a canary',
      )
    }
  })

  test('the same seed gives the same canaries; another seed gives others', () => {
    const a = makeCanaries(createRng(42, 'canary'), 5)
    const b = makeCanaries(createRng(42, 'canary'), 5)
    const c = makeCanaries(createRng(43, 'canary'), 5)
    assert.deepEqual(a, b)
    assert.notDeepEqual(a, c)
  })
})
