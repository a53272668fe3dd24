/** A fault switched on at a known moment: `redeployCluster` restarts a cluster serving as shipped
 *  with the incident's fault (guards off), the router keeping its URL. Refused, with the shipped
 *  cluster still serving, without KVFENCE_ALLOW_FAULTS=1; with it, the same URL now answers the
 *  over-capacity prompt the shipped cluster refused, and the prefill worker reports the fault. */
import assert from 'node:assert/strict'
import { rmSync } from 'node:fs'
import { join } from 'node:path'
import { test } from 'node:test'
import { startCluster, type ClusterOptions } from '../../src/config/launch.js'
import { redeployCluster } from '../../src/config/redeploy.js'
import { incidentShape, serverInfo, twoTenants } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

/** 451 tokens: over the 384-token prefill pool of {@link incidentShape}. */
const overCapacityPrompt = 'b '.repeat(225)

async function complete(url: string, key: string): Promise<{ status: number; code?: string }> {
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${key}` },
    body: JSON.stringify({
      model: 'echo-tiny',
      prompt: overCapacityPrompt,
      max_tokens: 8,
      temperature: 0,
    }),
  })
  const body = (await res.json()) as { error?: { code?: string } }
  return { status: res.status, code: body.error?.code }
}

test('redeploy with placeholder-forward: refused without the opt-in, on at a known moment with it', async () => {
  const { dir, tenants, tenantsFile } = twoTenants('kvfence-redeploy-')
  const shipped: ClusterOptions = {
    modelDir: echoModelDir,
    ...incidentShape,
    tenantsFile,
    logDir: join(dir, 'logs-shipped'),
    env: { ...process.env, KVFENCE_ALLOW_FAULTS: '' },
  }
  const incident: ClusterOptions = {
    ...shipped,
    contextWindow: 1024,
    prefillFaults: ['placeholder-forward'],
    disableGuards: true,
    logDir: join(dir, 'logs-incident'),
  }
  let cluster = await startCluster(shipped)
  try {
    const url = cluster.routerUrl
    assert.deepEqual(await complete(url, tenants[1].key), {
      status: 400,
      code: 'context_length_exceeded',
    })

    await assert.rejects(
      redeployCluster(cluster, incident),
      /refused unless KVFENCE_ALLOW_FAULTS=1 is set/,
    )
    assert.equal(cluster.processes.router.exitCode, null, 'the shipped router was stopped')
    assert.equal((await complete(url, tenants[1].key)).status, 400, 'the shipped cluster serves')

    const before = Date.now()
    const redeployed = await redeployCluster(cluster, {
      ...incident,
      env: { ...process.env, KVFENCE_ALLOW_FAULTS: '1' },
    })
    cluster = redeployed.cluster
    assert.equal(cluster.routerUrl, url)
    assert.ok(before <= redeployed.stoppedAtMs && redeployed.stoppedAtMs <= redeployed.servingAtMs)
    assert.deepEqual((await serverInfo(cluster.prefillUrl)).faults, ['placeholder-forward'])
    assert.equal((await complete(url, tenants[1].key)).status, 200)
  } finally {
    await cluster.stop()
    rmSync(dir, { recursive: true, force: true })
  }
})
