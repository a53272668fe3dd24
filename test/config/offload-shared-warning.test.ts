/** A prefill worker whose prefix cache and offload tier are shared by all tenants
 *  (`--prefix-cache-shared`) says so at start, for the host-memory ring and for the disk tier alone
 *  alike (a fresh-user trial once found the disk tier silent); by default each tenant has its
 *  partition's share of either tier and nothing is warned. */
import assert from 'node:assert/strict'
import { fork } from 'node:child_process'
import { mkdtempSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { test } from 'node:test'
import { cliPath, echoModelDir } from '../helpers/paths.js'

const warning = 'prefix cache and its offload tier shared by all tenants (--prefix-cache-shared)'
/** What the worker said before the offload tiers were split per tenant by default. */
const oldWarning = 'offload tier shared by all tenants: set --prefix-cache-pages-per-tenant'

/** Starts `kvfence prefill ARGS` until it is ready, stops it, and returns what it logged. */
function startupLog(args: string[]): Promise<string> {
  const child = fork(
    cliPath,
    ['prefill', '--port', '0', '--model', echoModelDir, ...args, '--log-level', 'warn'],
    { stdio: ['ignore', 'ignore', 'pipe', 'ipc'] },
  )
  let log = ''
  child.stderr!.on('data', (chunk: Buffer) => (log += chunk.toString('utf8')))
  return new Promise((resolve, reject) => {
    child.once('exit', (code) => reject(new Error(`prefill exited with ${code}: ${log}`)))
    child.on('message', (msg: { type?: string }) => {
      if (msg?.type !== 'ready') return
      child.removeAllListeners('exit')
      child.once('exit', () => resolve(log))
      child.kill('SIGTERM')
    })
  })
}

const diskArgs = () => {
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-offload-warn-'))
  return ['--prefix-cache-offload-dir', dir, '--prefix-cache-offload-disk-bytes', '100000']
}

test('a disk tier alone, shared by all tenants, is warned at start', async () => {
  assert.ok((await startupLog([...diskArgs(), '--prefix-cache-shared'])).includes(warning))
})

test('a host-memory ring, shared by all tenants, is warned at start', async () => {
  const log = await startupLog(['--prefix-cache-offload-bytes', '100000', '--prefix-cache-shared'])
  assert.ok(log.includes(warning), log)
})

test('by default (each tenant its share of both tiers) nothing is warned', async () => {
  const log = await startupLog([...diskArgs(), '--prefix-cache-offload-bytes', '100000'])
  assert.ok(!log.includes('shared by all tenants'), log)
  assert.ok(!log.includes(oldWarning), log)
})
