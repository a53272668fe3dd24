/** A prefill worker whose prefix-cache offload tier is shared by all tenants (no
 *  `--prefix-cache-pages-per-tenant`) says so at start, for the host-memory ring and for the disk
 *  tier alone alike (a fresh-user trial found the disk tier silent), and not once each tenant has
 *  its own share. */
import assert from 'node:assert/strict'
import { fork } from 'node:child_process'
import { mkdtempSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { test } from 'node:test'
import { cliPath, echoModelDir } from '../helpers/paths.js'

const warning = 'prefix cache offload tier shared by all tenants'

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
  assert.ok((await startupLog(diskArgs())).includes(warning))
})

test('a host-memory ring, shared by all tenants, is warned at start', async () => {
  assert.ok((await startupLog(['--prefix-cache-offload-bytes', '100000'])).includes(warning))
})

test('with a per-tenant share of the cache (and so of its tiers) nothing is warned', async () => {
  const log = await startupLog([...diskArgs(), '--prefix-cache-pages-per-tenant', '2'])
  assert.ok(!log.includes(warning), log)
})
