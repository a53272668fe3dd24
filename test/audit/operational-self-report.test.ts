/** `operational-endpoints` reads a gateway's published isolation self-check: a path the layer
 *  itself found not isolated (the engine refuses or ignores the tenant's salt) and serves anyway
 *  is a side-channel warning naming the path, not a clean verdict (a trial audited kvfence's
 *  gateway in front of `transformers serve` and heard nothing of it). Real gateway routers over
 *  TCP in front of stand-in engines. */
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { runAudit } from '../../src/audit/index.js'
import { startEngine, type Engine } from '../helpers/engines.js'
import { keys, writeTestTokenizer } from '../router/helpers.js'
import { startGatewayRouter } from '../router/gateway/engines.js'

const tenants = [
  { name: 'alpha', key: keys.alpha },
  { name: 'beta', key: keys.beta },
]

async function audit(engine: Engine, extra: Parameters<typeof startGatewayRouter>[1]) {
  const router = await startGatewayRouter(engine, extra)
  try {
    return await runAudit({
      target: router.url,
      tenants,
      seed: 1,
      probes: ['operational-endpoints'],
    })
  } finally {
    await router.close()
    await engine.close()
  }
}

test('a gateway serving paths its self-check found salt-refused: one side-channel warning per path', async () => {
  const report = await audit(await startEngine('openai', { poolTokens: 512, maxModelLen: 512 }), {
    backendModel: 'tiny-engine',
    kvPoolTokens: 512,
    tokenizerDir: writeTestTokenizer(),
    allowUnsalted: ['chat', 'completion'],
  })
  assert.deepEqual(
    report.findings.map((f) => [
      f.verdict,
      f.class,
      f.severity,
      f.evidence.path,
      f.evidence.result,
    ]),
    [
      ['warning', 'side-channel', 'high', 'chat', 'salt-refused'],
      ['warning', 'side-channel', 'high', 'completion', 'salt-refused'],
    ],
  )
  assert.match(
    report.findings[0].title,
    /^GET \/server_info reports that the engine behind it does not keep tenants' prefix caches apart on the chat path \(salt-refused: the engine refuses cache_salt .*\), and the path is served$/,
  )
})

test('the twin: an engine that keys its cache by the salt on both paths: clean', async () => {
  const report = await audit(
    await startEngine('vllm', { poolTokens: 1024, maxModelLen: 1024, prefixCache: 'salted' }),
    {},
  )
  assert.deepEqual(
    report.findings.map((f) => [f.probe, f.verdict]),
    [['operational-endpoints', 'clean']],
  )
})
