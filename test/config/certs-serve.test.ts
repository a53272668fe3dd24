/** A cluster config with `tls: { dir }` (certificates from the real `kvfence certs init`): the
 *  workers it starts serve their control plane over HTTPS and take transfers over TLS, the router
 *  reaches them with its own certificate, and a request is answered as in plaintext. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { promisify } from 'node:util'
import { pino } from 'pino'
import { newApiKey } from '../../src/router/tenants/tenant-keys.js'
import { parseClusterConfig } from '../../src/config/cluster.js'
import { clusterConfigPlan, launchCluster, type LaunchedCluster } from '../../src/config/launch.js'
import { cliEntry } from '../../src/common/paths.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { openaiClient } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-certs-serve-'))
const key = newApiKey()

describe('cluster config tls:', () => {
  let cluster: LaunchedCluster | undefined
  after(async () => {
    await cluster?.stop()
    rmSync(dir, { recursive: true, force: true })
  })

  it('starts workers over mutual TLS and answers through them', async () => {
    await promisify(execFile)(process.execPath, [cliEntry, 'certs', 'init', join(dir, 'certs')])
    const config = parseClusterConfig(
      {
        model: echoModelDir,
        router: { port: 0, logLevel: 'silent' },
        workers: { pageSize: 16, prefill: [{ pages: 32 }], decode: [{ pages: 32 }] },
        tls: { dir: 'certs' },
        tenants: [{ name: 'alice', keySha256: apiKeyDigest(key) }],
      },
      'test config',
      dir,
    )
    assert.equal(config.tls?.dir, join(dir, 'certs'))
    cluster = await launchCluster(clusterConfigPlan(config, pino({ level: 'silent' })))
    const res = await openaiClient(cluster.router!.url, key).completions.create({
      model: 'echo-tiny',
      prompt: 'the code is Qx7vR2mK. again: the code is ',
      max_tokens: 8,
      temperature: 0,
    })
    assert.equal(res.choices[0].text, 'Qx7vR2mK')
  })
})
