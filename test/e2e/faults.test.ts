/** The fault tests kept on real OS processes: `drop-abort` in the prefill worker, guards on and
 *  off. They need the prefill to be still running while the client's abort travels through the
 *  router to the decode worker, which holds when P computes on its own process; in one process
 *  the prefill's steps and the abort's hops share one event loop, and the prefill finished first
 *  (P's transfer completed and was ACKed). Every other fault test of DESIGN.md §5 runs on whole
 *  clusters in the test's own process (test/engine/faults-cluster.test.ts). Router, prefill and
 *  decode workers as OS processes, KV over loopback TCP, two tenants through the official
 *  `openai` client; both clusters started together before the tests. See docs/faults.md. */
import assert from 'node:assert/strict'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import OpenAI from 'openai'
import { startCluster, type Cluster, type ClusterOptions } from '../../src/config/launch.js'
import { openaiClient, pagesUsed, twoTenants } from '../helpers/cluster.js'
import { assertIdle, ask, metric, oracleText } from '../helpers/fault-answers.js'
import { echoModelDir } from '../helpers/paths.js'

const {
  dir,
  tenants: [tenantA, tenantB],
  tenantsFile,
} = twoTenants('kvfence-faults-')
const unsafeEnv = { ...process.env, KVFENCE_ALLOW_FAULTS: '1' }

/** Both pools 24 × 16 = 384 tokens: the advertised context is 384. */
const shape: ClusterOptions = {
  modelDir: echoModelDir,
  pageSize: 16,
  prefillPages: 24,
  decodePages: 24,
  tenantsFile,
  logLevel: 'warn',
}

const otherPrompt = 'count with me: 1 2 3 4 5 6 7 8 9 10 11 12 13 14'

/** The configurations under test, started together in `before`. Prefill-side drop-abort needs a
 *  prefill long enough to be abandoned while it runs: 64-page pools. */
const configs = {
  prefillDropAbortOn: { prefillFaults: ['drop-abort'], prefillPages: 64, decodePages: 64 },
  prefillDropAbortOff: {
    prefillFaults: ['drop-abort'],
    prefillPages: 64,
    decodePages: 64,
    disableGuards: true,
  },
} satisfies Record<string, Partial<ClusterOptions>>
type ConfigName = keyof typeof configs

const clusters = new Map<ConfigName, Cluster>()
/** Clusters starting at once. Start-up is CPU-bound (module loading, model, wasm): more clusters
 *  started together took no less CPU and, on a loaded 2-core machine, left some parts past their
 *  30 s start timeout (and starved the test file running beside this one). */
const numStartingAtOnce = 2
before(async () => {
  const queue = Object.entries(configs)
  const starter = async () => {
    for (let next = queue.shift(); next !== undefined; next = queue.shift()) {
      const [name, extra] = next
      const cluster = await startCluster({
        ...shape,
        ...extra,
        logDir: join(dir, name),
        env: unsafeEnv, // every configuration injects a fault
      })
      clusters.set(name as ConfigName, cluster)
    }
  }
  const started = await Promise.allSettled(Array.from({ length: numStartingAtOnce }, starter))
  const failed = started.find((s) => s.status === 'rejected')
  if (failed) throw (failed as PromiseRejectedResult).reason
})
after(async () => {
  await Promise.all([...clusters.values()].map((c) => c.stop()))
})

function get(name: ConfigName): Cluster {
  const cluster = clusters.get(name)
  assert.ok(cluster, `cluster ${name} did not start`)
  return cluster
}

function client(cluster: Cluster, key: string): OpenAI {
  return openaiClient(cluster.routerUrl, key, 30_000)
}

/** No part's process has exited. */
function assertUp(cluster: Cluster): void {
  for (const [part, child] of Object.entries(cluster.processes))
    assert.equal(child.exitCode, null, `${part} exited`)
}

describe('drop-abort in the prefill worker (prefill ignores the router’s abort)', () => {
  /** 960 characters + BOS = 961 tokens: four prefill chunks of at most 256 tokens, long enough for
   *  the client to leave while the prompt is still being prefilled. */
  const longPrompt = 'b '.repeat(480)

  /** Send `longPrompt` and walk away as soon as the prefill worker holds pages for it (its prefill
   *  has started; D has reserved its pages and waits for the transfer). */
  async function abandonDuringPrefill(cluster: Cluster): Promise<void> {
    const abort = new AbortController()
    const pending = client(cluster, tenantA.key).completions.create(
      { model: 'echo-tiny', prompt: longPrompt, max_tokens: 8, temperature: 0 },
      { signal: abort.signal },
    )
    const deadline = Date.now() + 10_000
    while ((await pagesUsed(cluster))[0] === 0) {
      assert.ok(Date.now() < deadline, 'the prefill worker never took pages for the prompt')
      await new Promise((r) => setTimeout(r, 1))
    }
    abort.abort()
    await assert.rejects(pending, OpenAI.APIUserAbortError)
  }

  /** The outcomes the workers counted, as `{prefill: {outcome: n}, decode: {...}}` (n > 0 only). */
  async function outcomes(cluster: Cluster): Promise<Record<string, Record<string, number>>> {
    const out: Record<string, Record<string, number>> = {}
    for (const [part, url] of [
      ['prefill', cluster.prefillUrl],
      ['decode', cluster.decodeUrl],
    ]) {
      const text = await (await fetch(`${url}/metrics`)).text()
      out[part] = {}
      for (const m of text.matchAll(
        /^kvfence_worker_requests_total\{outcome="(\w+)"[^}]*\} (\d+)$/gm,
      ))
        if (Number(m[2]) > 0) out[part][m[1]] = Number(m[2])
    }
    return out
  }

  it('guards on: D let the request go (G8), so the prefill finished for nobody is refused at BEGIN (G10); pools idle', async () => {
    const cluster = get('prefillDropAbortOn')
    await abandonDuringPrefill(cluster)
    await assertIdle(cluster)
    // P ran the prompt to its end and tried to send it; D no longer knew the request's secret.
    assert.deepEqual(await outcomes(cluster), {
      prefill: { transfer_failed: 1 },
      decode: { request_aborted: 1 },
    })
    assert.equal(
      await metric(
        cluster.prefillUrl,
        'kvfence_transfer_failures_total',
        'reason="unknown_request"',
      ),
      1,
    )
    assert.equal(
      await metric(cluster.decodeUrl, 'kvfence_transfers_total', 'outcome="completed"'),
      0,
    )
    // The other tenant is served as if nothing happened.
    const b = await ask(client(cluster, tenantB.key), otherPrompt, { maxTokens: 24, stream: true })
    assert.equal(b.error, null)
    assert.equal(b.text, oracleText(otherPrompt, 24))
    await assertIdle(cluster)
    assertUp(cluster)
  })

  it('guards off: prefill runs the abandoned prompt to its end and sends it; only the missing reservation on D refuses it', async () => {
    const cluster = get('prefillDropAbortOff')
    await abandonDuringPrefill(cluster)
    await assertIdle(cluster)
    // Without the fault P counts `request_aborted` and sends nothing. Here it finished the prefill,
    // held its pages meanwhile and sent the transfer; D (which did see the abort) had already freed
    // the reservation, so its BEGIN finds none ("no reservation waiting": code transfer_failed).
    assert.deepEqual(await outcomes(cluster), {
      prefill: { transfer_failed: 1 },
      decode: { request_aborted: 1 },
    })
    assert.equal(await metric(cluster.prefillUrl, 'kvfence_transfers_total', 'outcome="failed"'), 1)
    assert.equal(
      await metric(
        cluster.decodeUrl,
        'kvfence_transfer_failures_total',
        'reason="transfer_failed"',
      ),
      1,
    )
  })
})
