/** `kvfence serve --tenants FILE` (the embedded cluster, no config file): its router flags reach
 *  the router process. */
import assert from 'node:assert/strict'
import { fork } from 'node:child_process'
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { once } from 'node:events'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, it } from 'node:test'
import OpenAI from 'openai'
import { newApiKey, tenantsYaml } from '../../src/router/tenants/tenant-keys.js'
import { cliEntry } from '../../src/common/paths.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-serve-'))
after(() => rmSync(dir, { recursive: true, force: true }))

/** Starts `serve --tenants` with `extra` flags; resolves with its port and its stderr so far. */
async function serve(extra: string[]) {
  const key = newApiKey()
  const tenantsFile = join(dir, `tenants-${extra.length}.yaml`)
  writeFileSync(tenantsFile, tenantsYaml([{ name: 'alpha', key }]))
  const child = fork(
    cliEntry,
    ['serve', '--tenants', tenantsFile, '--port', '0', '--prefill-pages', '16', ...extra],
    { stdio: ['ignore', 'ignore', 'pipe', 'ipc'] },
  )
  let stderr = ''
  child.stderr!.on('data', (chunk: Buffer) => (stderr += chunk.toString('utf8')))
  const port = await new Promise<number>((resolve, reject) => {
    child.once('exit', (code) => reject(new Error(`serve exited with ${code}: ${stderr}`)))
    child.on(
      'message',
      (m: { type: string; port: number }) => m.type === 'ready' && resolve(m.port),
    )
  })
  const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: key, maxRetries: 0 })
  return { child, client, stderr: () => stderr }
}

it('serve --tenants --log-content logs prompts; without the flag it does not', async () => {
  for (const logContent of [true, false]) {
    const marker = `zq${logContent ? 'on' : 'off'}marker`
    const { child, client, stderr } = await serve(logContent ? ['--log-content'] : [])
    try {
      await client.completions.create({ model: 'echo-tiny', prompt: marker, max_tokens: 2 })
      await new Promise((resolve) => setTimeout(resolve, 300)) // the router's log line
      assert.equal(stderr().includes(marker), logContent, stderr())
    } finally {
      const exited = once(child, 'exit')
      child.kill('SIGTERM')
      await exited
    }
  }
})

/** PIDs of the live processes whose parent is `pid` (from /proc). */
function childrenOf(pid: number): number[] {
  return readdirSync('/proc')
    .filter((name) => /^\d+$/.test(name))
    .filter((name) => {
      try {
        return (
          /^PPid:\s+(\d+)$/m.exec(readFileSync(`/proc/${name}/status`, 'utf8'))?.[1] === String(pid)
        )
      } catch {
        return false // ended while we looked
      }
    })
    .map(Number)
}

const isAlive = (pid: number) => {
  try {
    process.kill(pid, 0)
    return true
  } catch {
    return false
  }
}

it('serve killed with SIGKILL leaves no part running (each part stops when its parent is gone)', async () => {
  const { child } = await serve(['--threads', '1'])
  const parts = childrenOf(child.pid!)
  assert.equal(parts.length, 3, 'router, prefill and decode')
  child.kill('SIGKILL')
  await once(child, 'exit')
  const deadline = Date.now() + 15_000
  while (parts.some(isAlive) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50))
  const left = parts.filter(isAlive)
  for (const pid of left) process.kill(pid, 'SIGKILL') // do not leave them to the next test
  assert.deepEqual(left, [], 'parts still running after serve was killed')
})

it('a part whose parent goes away while it is still starting exits at once (not when its start-up gives up)', async () => {
  // A router pointed at workers that do not answer keeps trying them for ~10 s before it fails.
  const key = newApiKey()
  const tenantsFile = join(dir, 'tenants-start.yaml')
  writeFileSync(tenantsFile, tenantsYaml([{ name: 'alpha', key }]))
  const child = fork(
    cliEntry,
    [
      'router',
      ...['--prefill', 'http://127.0.0.1:9', '--decode', 'http://127.0.0.1:9'],
      ...['--tenants', tenantsFile, '--port', '0'],
    ],
    { stdio: ['ignore', 'ignore', 'pipe', 'ipc'] },
  )
  let stderr = ''
  child.stderr!.on('data', (chunk: Buffer) => (stderr += chunk.toString('utf8')))
  // Its exit and the end of its stderr ('close' never comes once the parent disconnected).
  const ended = Promise.all([once(child, 'exit'), once(child.stderr!, 'end')])
  await new Promise((r) => setTimeout(r, 1_000))
  child.disconnect() // as when serve is killed
  const [[code]] = (await ended) as [[number | null], unknown]
  assert.equal(code, 1)
  // A router whose start-up gave up says why ("kvfence: worker …: connect ECONNREFUSED …"); one
  // that left with its parent says nothing. (A bound on the time taken would fail on a loaded
  // machine, where the router's own start can take longer than the bound.)
  assert.equal(stderr, '')
})
