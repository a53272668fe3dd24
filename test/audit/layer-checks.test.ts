/** The checks under the layer probes, on values written by hand: secrets.ts (what counts as a
 *  served credential, and that a hit never holds it), streams.ts (crossed events and foreign
 *  ids), the near-duplicates (none holds the victim's canary: a property over seeds) and the
 *  judges' verdicts without a positive control. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import fc from 'fast-check'
import { findCanaries, makeCanaries } from '../../src/audit/canaries.js'
import {
  judgeNearDuplicates,
  nearDuplicates,
  swapCase,
  victimPrompt,
} from '../../src/audit/probes/near-duplicates.js'
import { createRng } from '../../src/audit/rng.js'
import { findSecrets } from '../../src/audit/secrets.js'
import { checkStreams, streamId } from '../../src/audit/streams.js'
import { completionResult } from './completion-result.js'

const tenants = [
  { name: 'alice', key: 'sk-alice-0123456789secret' },
  { name: 'bob', key: 'sk-bob-9876543210secret' },
]

test('findSecrets: credential fields with a value, tenant keys, bearer tokens and private keys; never the value', () => {
  const body = JSON.stringify({
    server_args: { api_key: 'abc123def456', admin_api_key: null, ssl_keyfile_password: 'hunter22' },
    eos_token: '<|im_end|>',
    bos_token: '<s>',
    tokenizer_path: '/models/tok',
    max_tokens: 512,
    hf_token: '',
    secret: '***',
    note: `called with Bearer ${tenants[1].key}`,
    certs: [
      { private_key: '-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----' },
    ],
  })
  const hits = findSecrets(body, tenants)
  assert.deepEqual(hits, [
    { kind: 'tenant-key', field: 'anywhere in the body', tenant: 'bob', length: 23 },
    { kind: 'credential-field', field: 'server_args.api_key', length: 12 },
    { kind: 'credential-field', field: 'server_args.ssl_keyfile_password', length: 8 },
    { kind: 'credential-field', field: 'certs[0].private_key', length: 66 },
    { kind: 'bearer-token', field: 'Bearer token', length: 23 },
    { kind: 'private-key', field: 'RSA PRIVATE KEY', length: 31 },
  ])
  assert.ok(
    !JSON.stringify(hits).includes('abc123def456') && !JSON.stringify(hits).includes('hunter22'),
  )
})

test('findSecrets: key=value pairs in text (Prometheus labels), nothing in a plain llama.cpp /props or metrics body', () => {
  assert.deepEqual(findSecrets('engine_info{api_key="k-77aa88bb",model="m"} 1\n', tenants), [
    { kind: 'credential-field', field: 'api_key', length: 10 },
  ])
  const props = JSON.stringify({
    default_generation_settings: { n_ctx: 4096, params: { max_tokens: -1 } },
    total_slots: 4,
    eos_token: '<|im_end|>',
    chat_template: '{{ bos_token }}',
  })
  assert.deepEqual(findSecrets(props, tenants), [])
  assert.deepEqual(
    findSecrets('llamacpp:prompt_tokens_total 12\nllamacpp:tokens_predicted_total 9\n', tenants),
    [],
  )
})

test("checkStreams: a canary cut across two events and an event with the other stream's id are crossings; own events are not", () => {
  const alice = {
    label: 'a',
    tenant: 'alice',
    canaries: ['Xq7Lm2Pw9Rt4Zk8N'],
    chunks: [
      { id: 'cmpl-1', text: ' Xq7Lm2Pw9Rt4Zk8N' },
      { id: 'cmpl-1', text: ' more' },
      { id: 'cmpl-2', text: ' Hj3' },
      { id: 'cmpl-1', text: ' end' },
    ],
  }
  const bob = {
    label: 'b',
    tenant: 'bob',
    canaries: ['Hj3Vb6Nc1Qs5Wd0E'],
    chunks: [
      { id: 'cmpl-2', text: ' Hj3Vb6' },
      { id: 'cmpl-2', text: 'Nc1Q Xq7Lm2' },
      { id: 'cmpl-2', text: 'Pw9R' },
    ],
  }
  assert.equal(streamId(alice.chunks), 'cmpl-1')
  const crossings = checkStreams([alice, bob]).map((c) => [
    c.stream.label,
    c.source.label,
    c.kind,
    c.chunkIndex,
    c.match?.fragment ?? null,
  ])
  assert.deepEqual(crossings, [
    ['a', 'b', 'foreign-id', 2, null],
    ['b', 'a', 'canary', 1, 'Xq7Lm2Pw9R'],
  ])
  assert.deepEqual(
    checkStreams([alice, { ...bob, chunks: bob.chunks.slice(0, 1) }]).map((c) => c.kind),
    ['foreign-id'],
  )
})

test("near-duplicates never hold a fragment of the victim's canary, and differ from its prompt (any seed)", () => {
  fc.assert(
    fc.property(fc.integer({ min: 0, max: 2 ** 32 - 1 }), (seed) => {
      const rng = createRng(seed, 'near-duplicates')
      const [canary, own] = makeCanaries(rng, 2)
      const prompt = victimPrompt(rng, canary)
      assert.ok(prompt.includes(canary))
      const duplicates = nearDuplicates(prompt, canary, own)
      assert.ok(duplicates.length >= 4)
      for (const d of duplicates) {
        assert.deepEqual(findCanaries(d.prompt, [canary]), [], d.label)
        assert.notEqual(d.prompt, prompt)
      }
    }),
    { numRuns: 200 },
  )
  assert.equal(swapCase('aB3c'), 'Ab3C')
})

test("judgeNearDuplicates: equal answers with the victim's id are a leak; equal text alone with new ids is not", () => {
  const victim = tenants[0]
  const observer = tenants[1]
  const first = completionResult({
    status: 200,
    text: ' the river stone light water',
    responseId: 'cmpl-1',
  })
  const repeat = completionResult({ status: 200, text: first.text, responseId: 'cmpl-1' })
  const duplicate = { label: 'recased', prompt: 'x' }
  const same = judgeNearDuplicates({
    victim,
    observer,
    canary: 'Zz9Yy8Xx7Ww6Vv5U',
    first,
    repeat,
    answers: [
      {
        duplicate,
        result: completionResult({ status: 200, text: first.text, responseId: 'cmpl-1' }),
      },
    ],
  })
  assert.deepEqual(
    same.map((f) => f.verdict),
    ['leak'],
  )
  const fresh = judgeNearDuplicates({
    victim,
    observer,
    canary: 'Zz9Yy8Xx7Ww6Vv5U',
    first,
    repeat,
    answers: [
      {
        duplicate,
        result: completionResult({ status: 200, text: first.text, responseId: 'cmpl-9' }),
      },
    ],
  })
  assert.deepEqual(
    fresh.map((f) => f.verdict),
    ['clean'],
  )
})
