/** A running router follows its tenants file: `kvfence keys remove` revokes a key and
 *  `kvfence keys add` admits a new one without a restart, and a file that no longer validates
 *  leaves the previous tenants in force. Real CLI, real router process, real `openai` client. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { readFileSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { promisify } from 'node:util'
import { after, before, describe, it } from 'node:test'
import OpenAI from 'openai'
import { startCluster, type Cluster } from '../../src/config/launch.js'
import { cliPath, echoModelDir } from '../helpers/paths.js'
import { pollUntil } from '../helpers/poll.js'
import { incidentShape, openaiClient, twoTenants } from '../helpers/cluster.js'

const { dir, tenants, tenantsFile } = twoTenants('kvfence-tenants-reload-')
const [tenantA, tenantB] = tenants
const routerLog = join(dir, 'logs', 'router.log')

/** Runs `kvfence keys ARGS --tenants tenantsFile`; resolves with its stdout. */
async function keys(...args: string[]): Promise<string> {
  const { stdout } = await promisify(execFile)(process.execPath, [
    cliPath,
    'keys',
    ...args,
    '--tenants',
    tenantsFile,
  ])
  return stdout
}

/** Polls `probe` every 100 ms until it returns true; false after `limitMs` (a bound for a hung
 *  reload, far above the 1 s poll: never a timing claim). */
async function eventually(probe: () => Promise<boolean>, limitMs = 30_000): Promise<boolean> {
  return pollUntil(probe, { timeoutMs: limitMs, intervalMs: 100 })
}

/** One completion with `key`: its completion token count, or the error's status and code. */
async function complete(
  url: string,
  key: string,
): Promise<{ completionTokens: number } | { status: number | undefined; code: unknown }> {
  try {
    const res = await openaiClient(url, key).completions.create({
      model: 'echo-tiny',
      prompt: 'abc abc abc',
      max_tokens: 3,
      temperature: 0,
    })
    return { completionTokens: res.usage!.completion_tokens }
  } catch (err) {
    if (!(err instanceof OpenAI.APIError)) throw err
    return { status: err.status, code: err.code }
  }
}

const served = { completionTokens: 3 }
const revoked = { status: 401, code: 'invalid_api_key' }

describe('tenants file reload', () => {
  let cluster: Cluster
  before(async () => {
    cluster = await startCluster({
      modelDir: echoModelDir,
      ...incidentShape,
      tenantsFile,
      logDir: join(dir, 'logs'),
    })
  })
  after(async () => cluster?.stop())

  it('revokes a removed key and admits an added one without a restart', async () => {
    assert.deepEqual(await complete(cluster.routerUrl, tenantB.key), served)

    await keys('remove', tenantB.name)
    const isRevoked = await eventually(async () => {
      const r = await complete(cluster.routerUrl, tenantB.key)
      return 'status' in r && r.status === 401
    })
    assert.ok(isRevoked, 'the removed key was still served')
    assert.deepEqual(await complete(cluster.routerUrl, tenantB.key), revoked)
    assert.deepEqual(await complete(cluster.routerUrl, tenantA.key), served)

    const carolKey = (await keys('add', 'carol')).trim()
    assert.match(carolKey, /^\S{20,}$/)
    const isAdmitted = await eventually(async () => {
      const r = await complete(cluster.routerUrl, carolKey)
      return 'completionTokens' in r
    })
    assert.ok(isAdmitted, 'the added key was never served')
    assert.deepEqual(await complete(cluster.routerUrl, carolKey), served)

    // The router logs who came and went, never a key.
    const log = readFileSync(routerLog, 'utf8')
    assert.ok(log.includes('"removed":["tenant-b"]'), 'the reload logs the removed tenant')
    assert.ok(log.includes('"added":["carol"]'), 'the reload logs the added tenant')
    for (const key of [tenantA.key, tenantB.key, carolKey]) assert.ok(!log.includes(key))
  })

  it('keeps the previous tenants when the file becomes invalid, and logs an error', async () => {
    const good = readFileSync(tenantsFile, 'utf8')
    const numErrorsBefore = reloadErrors().length
    writeFileSync(tenantsFile, 'tenants: [this is: not, {a tenants file\n')
    const isNoticed = await eventually(async () => reloadErrors().length > numErrorsBefore)
    assert.ok(isNoticed, 'the invalid file was never reported')
    assert.deepEqual(await complete(cluster.routerUrl, tenantA.key), served)
    assert.deepEqual(await complete(cluster.routerUrl, tenantB.key), revoked)

    // An empty tenants list is refused the same way: it would lock every tenant out.
    writeFileSync(tenantsFile, 'tenants: []\n')
    const isEmptyNoticed = await eventually(async () => reloadErrors().length > numErrorsBefore + 1)
    assert.ok(isEmptyNoticed, 'the empty tenants list was never reported')
    assert.deepEqual(await complete(cluster.routerUrl, tenantA.key), served)

    writeFileSync(tenantsFile, good)
  })
})

/** The router's log lines (pino JSON) that report a failed reload, at level error (50). */
function reloadErrors(): { level: number; msg: string; detail: string }[] {
  return readFileSync(routerLog, 'utf8')
    .split('\n')
    .filter((line) => line.includes('tenants file reload failed'))
    .map((line) => JSON.parse(line) as { level: number; msg: string; detail: string })
    .filter((entry) => entry.level === 50)
}
