/** `kvfence router --config` reads the backend's API key from the variable the file names; an unset
 *  variable stops it with one line (sending no key would be a silent substitution). */
import assert from 'node:assert/strict'
import { execFile, fork } from 'node:child_process'
import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { it } from 'node:test'
import { promisify } from 'node:util'
import { stringify } from 'yaml'
import { newApiKey } from '../../src/router/tenants/tenant-keys.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { cliEntry } from '../../src/common/paths.js'
import { startEngine } from '../helpers/engines.js'
import { freePort, startPart, stopAll } from '../reliability/helpers.js'

it('router --config refuses a backend.apiKeyEnv that is not set (exit 2, one line)', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-router-config-'))
  const file = join(dir, 'cluster.yaml')
  writeFileSync(
    file,
    stringify({
      backend: { kind: 'vllm', url: 'http://127.0.0.1:9', apiKeyEnv: 'KVFENCE_TEST_UNSET_KEY' },
      tenants: [{ name: 'alice', keySha256: apiKeyDigest('k') }],
    }),
  )
  const env = { ...process.env }
  delete env.KVFENCE_TEST_UNSET_KEY
  const err = await promisify(execFile)(process.execPath, [cliEntry, 'router', '--config', file], {
    env,
    timeout: 60_000,
  }).then(
    () => null,
    (e: { code: number; stderr: string }) => e,
  )
  assert.ok(err, 'the router started without its backend key')
  assert.equal(err.code, 2)
  assert.equal(err.stderr.trim(), 'kvfence: backend.apiKeyEnv: KVFENCE_TEST_UNSET_KEY is not set')
})

it("router --config: the router flags given override the file (a trial's --port lost to the file's default 8000)", async (t) => {
  const engine = await startEngine('vllm', { poolTokens: 4096, maxModelLen: 2048 })
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-router-flags-'))
  const file = join(dir, 'cluster.yaml')
  const key = newApiKey()
  // No router.port: its default (8000) once won over --port.
  writeFileSync(
    file,
    stringify({
      router: { contextWindow: 2048 },
      backend: { kind: 'vllm', url: engine.url, discoveryIntervalMs: 0 },
      tenants: [{ name: 'alice', keySha256: apiKeyDigest(key) }],
    }),
  )
  const port = await freePort()
  const router = await startPart([
    'router', '--config', file, '--port', String(port), '--context-window', '100',
  ]) // prettier-ignore
  t.after(async () => {
    await stopAll([router])
    await engine.close()
  })
  const info = (await (await fetch(`http://127.0.0.1:${port}/server_info`)).json()) as {
    contextWindow: number
  }
  assert.equal(info.contextWindow, 100)
})

it('router --config refuses the flags that name what the file gives (they were ignored)', async () => {
  for (const [flag, value, instead] of [
    ['--tenants', 't.yaml', "the file's tenants: list is served"],
    ['--prefill', 'http://127.0.0.1:1', 'give the URLs in workers.prefill'],
    ['--decode', 'http://127.0.0.1:2', 'give the URLs in workers.decode'],
    ['--model', 'models/x', 'set model: in the file'],
  ]) {
    const err = await promisify(execFile)(process.execPath, [
      cliEntry, 'router', '--config', 'never-read.yaml', flag, value,
    ]).then(
      () => null,
      (e: { code: number; stderr: string }) => e,
    ) // prettier-ignore
    assert.ok(err, `router --config with ${flag} started`)
    assert.equal(err.code, 2)
    assert.equal(err.stderr, `kvfence: ${flag} is not used with --config (${instead})\n`)
  }
})

it("router --config logs at the file's router.logLevel when --log-level is not given", async (t) => {
  const engine = await startEngine('vllm', { poolTokens: 4096, maxModelLen: 2048 })
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-router-level-'))
  const file = join(dir, 'cluster.yaml')
  const port = await freePort()
  writeFileSync(
    file,
    stringify({
      router: { port, logLevel: 'error' },
      backend: { kind: 'vllm', url: engine.url, discoveryIntervalMs: 0 },
      tenants: [{ name: 'alice', keySha256: apiKeyDigest(newApiKey()) }],
    }),
  )
  const child = fork(cliEntry, ['router', '--config', file], {
    stdio: ['ignore', 'ignore', 'pipe', 'ipc'],
  })
  let stderr = ''
  child.stderr!.on('data', (chunk: Buffer) => (stderr += chunk.toString('utf8')))
  t.after(async () => {
    await stopAll([child])
    await engine.close()
  })
  await new Promise<void>((resolve, reject) => {
    child.once('exit', (code) => reject(new Error(`router exited with ${code}: ${stderr}`)))
    child.on('message', (m: { type: string }) => m.type === 'ready' && resolve())
  })
  // At info it logs "router listening" (level 30) once ready; at error, nothing.
  assert.equal(stderr, '')
})
