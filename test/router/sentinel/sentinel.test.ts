/** The response sentinel on real traffic: a real kvfence cluster (router, prefill and decode
 *  processes, real TCP) with the incident's fault injected and guards off, the official `openai`
 *  client as the tenants. Tenant B's over-capacity prompt is answered over tenant A's stale KV:
 *  the sentinel counts exactly the answers that carry a 16-character run of A's prompt
 *  (suspected) and those carrying 8 characters of A's canary (confirmed, A being a canary
 *  tenant); in block mode B never receives the run. Ordinary traffic — the same licence from two
 *  tenants, a shared system prompt, a tenant's own text coming back — raises nothing. */
import assert from 'node:assert/strict'
import { createHash } from 'node:crypto'
import { readFileSync, mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import OpenAI from 'openai'
import { startCluster, type Cluster, type ClusterOptions } from '../../../src/config/launch.js'
import { loadTokenizer } from '../../../src/model/tokenizer.js'
import { newApiKey } from '../../../src/router/tenants/tenant-keys.js'
import { openaiClient as client, incidentShape } from '../../helpers/cluster.js'
import { echoModelDir } from '../../helpers/paths.js'
import { pollUntil } from '../../helpers/poll.js'

const apiKeyDigest = (key: string) => createHash('sha256').update(key, 'utf8').digest('hex')
const dir = mkdtempSync(join(tmpdir(), 'kvfence-sentinel-'))
const keys = { a: newApiKey(), b: newApiKey(), c: newApiKey() }
const tenantsFile = join(dir, 'tenants.yaml')
writeFileSync(
  tenantsFile,
  [
    'tenants:',
    `  - { name: tenant-a, keySha256: ${apiKeyDigest(keys.a)}, canary: true }`,
    `  - { name: tenant-b, keySha256: ${apiKeyDigest(keys.b)} }`,
    `  - { name: tenant-c, keySha256: ${apiKeyDigest(keys.c)} }`,
    '',
  ].join('\n'),
)

const canary = 'Qx7vR2mK9pLt4Wz8'
const plantPrompt = `the river walks near the stone garden and ${canary} holds the quiet light over the green field after the summer rain, the small market opens before the morning bread`
/** Sent as token ids. */
/** 451 tokens (char-level vocabulary + BOS): over the prefill pool (384), under the window. */
const overCapacityPrompt = 'b '.repeat(225)
const licence =
  'Permission is hereby granted, free of charge, to any person obtaining a copy of this software'
const systemPrompt =
  'You are a careful assistant of the example company. Answer briefly and politely, in English.'

/** The longest run of `answer` whose every 8-character piece occurs in `source`: the sentinel's
 *  run length, computed the plain way (0 when no piece occurs). */
function runLength(answer: string, source: string): number {
  let best = 0
  let run = 0
  for (let i = 0; i + 8 <= answer.length; i++) {
    run = source.includes(answer.slice(i, i + 8)) ? run + 1 : 0
    best = Math.max(best, run === 0 ? 0 : run + 7)
  }
  return best
}

/** Whether `text` holds 8 consecutive characters of `secret`. */
function hasFragment(text: string, secret: string): boolean {
  for (let i = 0; i + 8 <= secret.length; i++)
    if (text.includes(secret.slice(i, i + 8))) return true
  return false
}

/** The sentinel's counters, read from the router's `/metrics`. */
async function sentinelCounts(cluster: Cluster): Promise<{ suspected: number; confirmed: number }> {
  const text = await (await fetch(`${cluster.routerUrl}/metrics`)).text()
  const sum = (name: string) =>
    text
      .split('\n')
      .filter((l) => l.startsWith(`${name}{`) || l.startsWith(`${name} `))
      .reduce((n, l) => n + Number(l.slice(l.lastIndexOf(' ') + 1)), 0)
  return {
    suspected: sum('kvfence_sentinel_suspected_total'),
    confirmed: sum('kvfence_sentinel_confirmed_total'),
  }
}

function faultyShape(name: string, routerArgs: string[]): ClusterOptions {
  return {
    modelDir: echoModelDir,
    ...incidentShape,
    tenantsFile,
    logDir: join(dir, name),
    contextWindow: 1024,
    prefillFaults: ['placeholder-forward'],
    disableGuards: true,
    routerArgs,
    env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
  }
}

const complete = (cluster: Cluster, key: string, prompt: string, maxTokens: number) =>
  client(cluster.routerUrl, key).completions.create({
    model: 'echo-tiny',
    prompt,
    max_tokens: maxTokens,
    temperature: 0,
  })

describe('observe mode (the default), over the incident', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster(faultyShape('observe', []))
  })
  after(async () => cluster?.stop())

  it("counts exactly B's answers carrying a 16-character run of A's prompt, and A's canary", async () => {
    const start = await sentinelCounts(cluster)
    let numRuns = 0
    let numFragments = 0
    for (let attempt = 0; attempt < 6 && numRuns === 0; attempt++) {
      await complete(cluster, keys.a, plantPrompt, 16)
      const res = await complete(cluster, keys.b, overCapacityPrompt, 64)
      const text = res.choices[0].text
      if (runLength(text, plantPrompt) >= 16) numRuns++
      if (hasFragment(text, canary)) numFragments++
    }
    assert.ok(numRuns > 0, "no answer to tenant B carried a run of tenant A's prompt")
    const end = await sentinelCounts(cluster)
    assert.equal(end.suspected - start.suspected, numRuns)
    assert.equal(end.confirmed - start.confirmed, numFragments)
    // The log names the request, tenants and the run's length; it quotes nothing of the text.
    // The router's log reaches its file through a pipe: wait for the lines (the counters above
    // were already final), then count them exactly.
    const logLines = () =>
      readFileSync(join(dir, 'observe', 'router.log'), 'utf8')
        .split('\n')
        .filter((l) => l.includes('"msg":"sentinel:'))
    await pollUntil(() => logLines().length >= numRuns + numFragments, {
      timeoutMs: 5_000,
      intervalMs: 50,
    })
    const lines = logLines()
    assert.equal(lines.length, numRuns + numFragments)
    for (const line of lines) {
      const entry = JSON.parse(line) as Record<string, unknown>
      assert.equal(entry.tenant, 'tenant-b')
      assert.equal(entry.sourceTenant, 'tenant-a')
      assert.match(String(entry.rid), /^[0-9a-f]{32}$/)
      // Native mode counts tokens (here one a character); a canary fragment is 8 characters.
      const isSuspected = entry.level === 40
      assert.deepEqual(
        [entry.runTokens, entry.runCharacters],
        isSuspected ? [16, null] : [null, 8],
        line,
      )
      assert.ok(!hasFragment(line, canary) && runLength(line, plantPrompt) < 16, line)
    }
  })

  it('raises nothing for a licence two tenants send, a shared system prompt, or a tenant’s own text', async () => {
    const start = await sentinelCounts(cluster)
    // Tenant A's own earlier prompt (and canary) comes back in its over-capacity answer (its
    // own stale KV): no evidence against anyone.
    let numOwnEchoes = 0
    for (let attempt = 0; attempt < 6 && numOwnEchoes === 0; attempt++) {
      await complete(cluster, keys.a, plantPrompt, 16)
      const res = await complete(cluster, keys.a, overCapacityPrompt, 64)
      if (runLength(res.choices[0].text, plantPrompt) >= 16) numOwnEchoes++
    }
    for (const key of [keys.b, keys.c]) {
      await complete(cluster, key, licence, 48)
      await client(cluster.routerUrl, key).chat.completions.create({
        model: 'echo-tiny',
        messages: [
          { role: 'system', content: systemPrompt },
          { role: 'user', content: 'hello there' },
        ],
        max_tokens: 48,
        temperature: 0,
      })
    }
    assert.ok(numOwnEchoes > 0, 'no answer to tenant C carried its own earlier prompt')
    assert.deepEqual(await sentinelCounts(cluster), start)
  })
})

describe('block mode, over the incident', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster(faultyShape('block', ['--sentinel', 'block']))
  })
  after(async () => cluster?.stop())

  it("ends B's stream with an error event before any of the run reaches B", async () => {
    let numWithheld = 0
    for (let attempt = 0; attempt < 6 && numWithheld === 0; attempt++) {
      await complete(cluster, keys.a, plantPrompt, 16)
      const stream = await client(cluster.routerUrl, keys.b).completions.create({
        model: 'echo-tiny',
        prompt: overCapacityPrompt,
        max_tokens: 64,
        temperature: 0,
        stream: true,
      })
      let received = ''
      try {
        for await (const chunk of stream) received += chunk.choices[0]?.text ?? ''
      } catch (err) {
        assert.ok(err instanceof OpenAI.APIError, String(err))
        assert.match(String(err.message), /sentinel withheld/)
        numWithheld++
      }
      assert.ok(runLength(received, plantPrompt) < 16, `B received a run: ${received}`)
      assert.ok(!hasFragment(received, canary), `B received the canary: ${received}`)
    }
    assert.ok(numWithheld > 0, 'no stream to tenant B was withheld')
    const counts = await sentinelCounts(cluster)
    assert.ok(counts.suspected + counts.confirmed >= numWithheld)
  })

  it("answers B's whole (non-streamed) request with HTTP 500 answer_withheld, no text", async () => {
    let numWithheld = 0
    for (let attempt = 0; attempt < 6 && numWithheld === 0; attempt++) {
      await complete(cluster, keys.a, plantPrompt, 16)
      const outcome = await complete(cluster, keys.b, overCapacityPrompt, 64).then(
        (res) => res.choices[0].text,
        (err: unknown) => err,
      )
      if (typeof outcome === 'string') {
        assert.ok(runLength(outcome, plantPrompt) < 16, `B received a run: ${outcome}`)
        continue
      }
      assert.ok(outcome instanceof OpenAI.InternalServerError, String(outcome))
      assert.equal(outcome.code, 'answer_withheld')
      numWithheld++
    }
    assert.ok(numWithheld > 0, 'no answer to tenant B was withheld')
  })

  it('lets a clean answer through whole, its held-back tail released at the end', async () => {
    const stream = await client(cluster.routerUrl, keys.c).completions.create({
      model: 'echo-tiny',
      prompt: licence,
      max_tokens: 40,
      temperature: 0,
      stream: true,
    })
    let streamed = ''
    for await (const chunk of stream) streamed += chunk.choices[0]?.text ?? ''
    const whole = await complete(cluster, keys.c, licence, 40)
    assert.equal(streamed, whole.choices[0].text)
    assert.equal(whole.usage?.completion_tokens, 40)
    assert.equal(streamed.length, 40) // one character per token
  })
})

describe('a prompt given as token ids, over the incident', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster(faultyShape('ids', []))
  })
  after(async () => cluster?.stop())

  it("is fingerprinted, its canary learnt: B's answers carrying its text are counted", async () => {
    // Tenant A sends its passage as the char-level vocabulary's ids, BOS first: the router
    // fingerprints the ids and learns the canary from their decoded text.
    const ids = loadTokenizer(echoModelDir).encode(plantPrompt)
    assert.equal(ids.length, plantPrompt.length + 1)
    let numRuns = 0
    let numFragments = 0
    for (let attempt = 0; attempt < 6 && numRuns === 0; attempt++) {
      await client(cluster.routerUrl, keys.a).completions.create({
        model: 'echo-tiny',
        prompt: ids,
        max_tokens: 16,
        temperature: 0,
      })
      const text = (await complete(cluster, keys.b, overCapacityPrompt, 64)).choices[0].text
      if (runLength(text, plantPrompt) >= 16) numRuns++
      if (hasFragment(text, canary)) numFragments++
    }
    assert.ok(numRuns > 0, "no answer to tenant B carried a run of tenant A's prompt")
    assert.deepEqual(await sentinelCounts(cluster), {
      suspected: numRuns,
      confirmed: numFragments,
    })
  })
})
