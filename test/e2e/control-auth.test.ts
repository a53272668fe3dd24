/** The workers' control plane names tenants and issues transfer secrets, so only the router may use
 *  it: a process that reaches a worker's port without the cluster token is refused, and cannot
 *  act as a tenant (e.g. probe that tenant's prefix cache). */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { promisify } from 'node:util'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { clusterTokenHeader } from '../../src/engine/cluster-token.js'
import { startCluster, type Cluster } from '../../src/engine/cluster.js'
import { cliPath, echoModelDir } from '../helpers/paths.js'
import { openaiClient, twoTenants } from '../helpers/cluster.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-control-auth-')

function generateBody(tenant: string) {
  return {
    requestId: randomBytes(16).toString('hex'),
    tenant,
    promptTokenIds: [1, 72, 73],
    maxTokens: 2,
    sampling: { temperature: 0, topP: 1, seed: null },
    stopTokenIds: [],
    transferSecret: randomBytes(32).toString('hex'),
  }
}

describe('control-plane authentication', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster({
      modelDir: echoModelDir,
      pageSize: 16,
      prefillPages: 24,
      decodePages: 64,
      tenantsFile,
      logDir: join(dir, 'logs'),
    })
  })
  after(async () => cluster?.stop())

  it('refuses a control request without the cluster token, or with a wrong one (401)', async () => {
    const cases: Record<string, string>[] = [{}, { [clusterTokenHeader]: 'not-the-token' }]
    for (const headers of cases) {
      for (const [url, body] of [
        [`${cluster.decodeUrl}/internal/generate`, generateBody('tenant-a')],
        [
          `${cluster.prefillUrl}/internal/prefill`,
          { ...generateBody('tenant-a'), decode: { host: '127.0.0.1', port: 1 } },
        ],
      ] as const) {
        const res = await fetch(url, {
          method: 'POST',
          headers: { 'content-type': 'application/json', ...headers },
          body: JSON.stringify(body),
        })
        assert.equal(res.status, 401)
        assert.equal(
          ((await res.json()) as { error: { code: string } }).error.code,
          'invalid_api_key',
        )
      }
    }
    const info = (await (await fetch(`${cluster.decodeUrl}/server_info`)).json()) as {
      numPagesUsed: number
    }
    assert.equal(info.numPagesUsed, 0, 'nothing was reserved for the refused request')
  })

  it('still serves tenants through the router, which holds the token', async () => {
    const res = await openaiClient(cluster.routerUrl, tenants[0].key).completions.create({
      model: 'echo-tiny',
      prompt: 'abc abc abc',
      max_tokens: 4,
      temperature: 0,
    })
    assert.equal(res.usage?.completion_tokens, 4)
  })

  it('a worker bound beyond loopback refuses to start without a token (one line, exit 2)', async () => {
    const env = { ...process.env, KVFENCE_CLUSTER_TOKEN: '' }
    const run = await promisify(execFile)(
      process.execPath,
      [cliPath, 'decode', '--host', '0.0.0.0', '--port', '0', '--transfer-port', '0'],
      { env },
    ).then(
      () => ({ code: 0, stderr: '' }),
      (err: { code: number; stderr: string }) => err,
    )
    assert.equal(run.code, 2)
    assert.match(
      run.stderr,
      /^kvfence: KVFENCE_CLUSTER_TOKEN is not set: a decode worker bound to 0\.0\.0\.0/m,
    )
  })
})
