/** The incident end to end, with real processes, real TCP between prefill and decode, and the
 *  official `openai` client as the tenants: with the fault injected and guards off, tenant B's
 *  HTTP 200 answer carries tenant A's canary; as shipped, B gets 400 context_length_exceeded. */
import assert from 'node:assert/strict'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import OpenAI from 'openai'
import { startCluster, type Cluster, type ClusterOptions } from '../../src/config/launch.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import { generateLocal } from '../../src/engine/local-engine.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { loadModel } from '../../src/model/weights.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { openaiClient as client, incidentShape, pagesUsed, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const {
  dir,
  tenants: [tenantA, tenantB],
  tenantsFile,
} = twoTenants('kvfence-e2e-')

/** The demo's shape: prefill pool 24 × 16 = 384 tokens, decode pool 64 × 16 = 1,024 tokens. */
const shape: ClusterOptions = {
  modelDir: echoModelDir,
  ...incidentShape,
  tenantsFile,
  logDir: join(dir, 'logs'),
}
const canary = 'Qx7vR2mK9pLt4Wz8'
const plantPrompt = `the river walks near the stone garden and ${canary} holds the quiet light over the green field after the summer rain, the small market opens before the morning bread`
/** 450 characters + BOS = 451 tokens: over the prefill pool (384), under the advertised 1,024. */
const overCapacityPrompt = 'b '.repeat(225)

/** Longest run (≥ 8 characters) of `secret` found in `text`, or ''. */
function fragmentOf(text: string, secret: string): string {
  for (let len = secret.length; len >= 8; len--) {
    for (let i = 0; i + len <= secret.length; i++)
      if (text.includes(secret.slice(i, i + len))) return secret.slice(i, i + len)
  }
  return ''
}

describe('as shipped (guards on)', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster({ ...shape, contextWindow: 1024, clampContext: true })
  })
  after(async () => cluster?.stop())

  it('refuses to start when the advertised context exceeds the prefill pool (G1)', async () => {
    await assert.rejects(
      startCluster({ ...shape, contextWindow: 1024 }),
      /G1: context window 1024 exceeds the effective KV capacity 384/,
    )
  })

  it("advertises the prefill pool's 384 tokens, not 1,024", async () => {
    const models = await client(cluster.routerUrl, tenantA.key).models.list()
    assert.equal((models.data[0] as unknown as { max_model_len: number }).max_model_len, 384)
  })

  it('answers tenant A with exactly the single-process engine’s tokens at temperature 0', async () => {
    const res = await client(cluster.routerUrl, tenantA.key).completions.create({
      model: 'echo-tiny',
      prompt: plantPrompt,
      max_tokens: 24,
      temperature: 0,
    })
    assert.equal(res.usage?.prompt_tokens, plantPrompt.length + 1) // char-level vocabulary + BOS
    assert.equal(res.usage?.completion_tokens, 24)
    const tokenizer = loadTokenizer(echoModelDir)
    const core = createWorkerCore({
      model: loadModel(echoModelDir),
      numPages: 64,
      pageSize: 16,
      faults: buildFaultConfig([], false, {}),
    })
    const local = generateLocal(core, tokenizer.encode(plantPrompt), {
      maxTokens: 24,
      sampling: { temperature: 0, topP: 1, seed: null },
      stopTokenIds: [],
    })
    assert.equal(res.choices[0].text, tokenizer.decode(local.tokenIds))
  })

  it("rejects tenant B's over-capacity prompt with 400 context_length_exceeded and never decodes it", async () => {
    await client(cluster.routerUrl, tenantA.key).completions.create({
      model: 'echo-tiny',
      prompt: plantPrompt,
      max_tokens: 8,
      temperature: 0,
    })
    for (const stream of [false, true]) {
      const err = await client(cluster.routerUrl, tenantB.key)
        .completions.create({
          model: 'echo-tiny',
          prompt: overCapacityPrompt,
          max_tokens: 64,
          temperature: 0,
          stream,
        })
        .then(
          () => null,
          (e: unknown) => e,
        )
      assert.ok(err instanceof OpenAI.BadRequestError, `expected a 400, got ${String(err)}`)
      assert.equal(err.code, 'context_length_exceeded')
    }
    assert.deepEqual(await pagesUsed(cluster), [0, 0])
  })
})

describe('the incident (placeholder-forward injected, guards off)', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster({
      ...shape,
      contextWindow: 1024,
      prefillFaults: ['placeholder-forward'],
      disableGuards: true,
      env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
    })
  })
  after(async () => cluster?.stop())

  it("answers tenant B's over-capacity prompt with HTTP 200 carrying tenant A's canary", async () => {
    const a = client(cluster.routerUrl, tenantA.key)
    const b = client(cluster.routerUrl, tenantB.key)
    const leaks: string[] = []
    for (let attempt = 0; attempt < 6 && leaks.length === 0; attempt++) {
      await a.completions.create({
        model: 'echo-tiny',
        prompt: plantPrompt,
        max_tokens: 16,
        temperature: 0,
      })
      const res = await b.completions.create({
        model: 'echo-tiny',
        prompt: overCapacityPrompt,
        max_tokens: 64,
        temperature: 0,
      })
      assert.equal(res.usage?.prompt_tokens, 451)
      const fragment = fragmentOf(res.choices[0].text, canary)
      if (fragment) leaks.push(fragment)
    }
    assert.ok(leaks.length > 0, "no answer to tenant B carried tenant A's canary")
  })
})
