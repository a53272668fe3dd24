/** The workers' control plane names tenants and issues transfer secrets, so only the router may use
 *  it: a process that reaches a worker's port without the cluster token is refused, and cannot
 *  act as a tenant (e.g. probe that tenant's prefix cache). */
import assert from 'node:assert/strict'
import { type ChildProcess, execFile } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import http from 'node:http'
import { promisify } from 'node:util'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { clusterTokenHeader, newClusterToken } from '../../src/control/cluster-token.js'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import { forkPart, stopAll } from '../../src/engine/processes.js'
import { ClusterTokenRefusedError, createWorkerClient } from '../../src/control/worker-client.js'
import OpenAI from 'openai'
import { cliPath, echoModelDir } from '../helpers/paths.js'
import { incidentShape, openaiClient, twoTenants } from '../helpers/cluster.js'
import { stoppedPartLog } from '../helpers/processes.js'

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

const clusterToken = newClusterToken()

/** Asks the worker at `url` for its control channel (`GET /internal/channel` upgraded) with
 *  `headers`: the answer's status (101 when it switched; the connection is then closed at once)
 *  and body. */
function channelUpgrade(
  url: string,
  headers: Record<string, string>,
): Promise<{ status: number; body: string }> {
  return new Promise((resolve, reject) => {
    const req = http.request(`${url}/internal/channel`, {
      headers: { connection: 'Upgrade', upgrade: 'kvfence-control/1', ...headers },
      agent: false,
    })
    req.on('upgrade', (res, socket) => {
      socket.destroy()
      resolve({ status: res.statusCode ?? 0, body: '' })
    })
    req.on('response', (res) => {
      let body = ''
      res.setEncoding('utf8')
      res.on('data', (chunk: string) => (body += chunk))
      res.on('end', () => resolve({ status: res.statusCode ?? 0, body }))
    })
    req.on('error', reject)
    req.end()
  })
}

describe('control-plane authentication', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster({
      modelDir: echoModelDir,
      ...incidentShape,
      tenantsFile,
      logDir: join(dir, 'logs'),
      env: { ...process.env, KVFENCE_CLUSTER_TOKEN: clusterToken },
    })
  })
  after(async () => cluster?.stop())

  it('answers the token probe 200 with the token and 401 without it, on both workers', async () => {
    for (const url of [cluster.prefillUrl, cluster.decodeUrl]) {
      const probe = (headers: Record<string, string>) =>
        fetch(`${url}/internal/cluster_token_check`, { method: 'POST', headers, body: '{}' })
      const ok = await probe({ [clusterTokenHeader]: clusterToken })
      assert.equal(ok.status, 200)
      assert.deepEqual(await ok.json(), { ok: true })
      assert.equal((await probe({ [clusterTokenHeader]: 'not-the-token' })).status, 401)
      const workers = createWorkerClient({
        prefillUrls: [cluster.prefillUrl],
        decodeUrls: [cluster.decodeUrl],
        clusterToken,
      })
      try {
        assert.equal(await workers.acceptsClusterToken(url), true)
      } finally {
        workers.close()
      }
    }
  })

  it('refuses a control channel without the cluster token, or with a wrong one (401)', async () => {
    const cases: Record<string, string>[] = [{}, { [clusterTokenHeader]: 'not-the-token' }]
    for (const headers of cases) {
      for (const url of [cluster.decodeUrl, cluster.prefillUrl]) {
        const refused = await channelUpgrade(url, headers)
        assert.equal(refused.status, 401)
        assert.equal(
          (JSON.parse(refused.body) as { error: { code: string } }).error.code,
          'invalid_api_key',
        )
      }
    }
    // The token itself opens it: the refusals above were the token's doing.
    assert.equal(
      (await channelUpgrade(cluster.decodeUrl, { [clusterTokenHeader]: clusterToken })).status,
      101,
    )
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

  it('blames a wrong router token on the operator: 503 worker_unavailable, /health 503, an error log', async () => {
    const wrongToken = randomBytes(32).toString('hex')
    const logFile = join(dir, 'logs', 'wrong-token-router.log')
    const started: ChildProcess[] = []
    try {
      const { ready } = await forkPart(
        [
          'router',
          '--model',
          echoModelDir,
          '--prefill',
          cluster.prefillUrl,
          '--decode',
          cluster.decodeUrl,
          '--tenants',
          tenantsFile,
          '--port',
          '0',
        ],
        {
          env: { ...process.env, KVFENCE_CLUSTER_TOKEN: wrongToken },
          logFile,
          timeoutMs: 30_000,
          failure: (why, last) => new Error(`router did not start (${why.kind}): ${last}`),
        },
        started,
      )
      const routerUrl = `http://127.0.0.1:${ready.port}`

      const health = await fetch(`${routerUrl}/health`)
      assert.equal(health.status, 503)
      assert.deepEqual(await health.json(), { status: 'unavailable', reason: 'cluster_token' })

      const err = await openaiClient(routerUrl, tenants[0].key)
        .completions.create({ model: 'echo-tiny', prompt: 'abc', max_tokens: 2 })
        .then(
          () => assert.fail('a request was served by workers that refuse the router'),
          (e: unknown) => e,
        )
      assert.ok(err instanceof OpenAI.APIError)
      assert.equal(err.status, 503)
      assert.equal(err.code, 'worker_unavailable')
      assert.equal(err.type, 'server_error')

      const log = await stoppedPartLog(started, logFile)
      const lines = log
        .split('\n')
        .filter((l) => l.startsWith('{'))
        .map((l) => JSON.parse(l) as { level: number; msg: string })
      const errors = lines.filter(
        (l) => l.level === 50 && l.msg.includes("refused the router's cluster token"),
      )
      assert.ok(errors.length >= 1, 'the cause is logged at error')
      assert.match(errors[0].msg, /KVFENCE_CLUSTER_TOKEN differs from the workers'/)
      assert.ok(!log.includes(wrongToken), 'the token is never logged')
      assert.ok(!log.includes(tenants[0].key), 'nor the tenant key')
    } finally {
      await stopAll(started)
    }
  })

  it("maps a worker's 401 on a control request to worker_unavailable, naming the cause", async () => {
    const workers = createWorkerClient({
      prefillUrls: [cluster.prefillUrl],
      decodeUrls: [cluster.decodeUrl],
      clusterToken: 'not-the-token',
    })
    try {
      assert.equal(await workers.acceptsClusterToken(cluster.decodeUrl), false)
      const run = async () => {
        for await (const _ of workers.generate(
          generateBody('tenant-a'),
          AbortSignal.timeout(30_000),
        ))
          assert.fail('a token came back without the cluster token')
      }
      await assert.rejects(run(), (err: unknown) => {
        assert.ok(err instanceof ClusterTokenRefusedError)
        assert.equal(err.code, 'worker_unavailable')
        assert.equal(
          err.message,
          `decode worker ${cluster.decodeUrl} refused the router's cluster token (HTTP 401): the router's KVFENCE_CLUSTER_TOKEN differs from the workers'`,
        )
        return true
      })
    } finally {
      workers.close()
    }
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
