/** A silent worker (SIGSTOPped: its connections stay open, it answers nothing): once the router's
 *  probe finds it unreachable, a new request is not sent there — it gets 503 `worker_unavailable`
 *  with Retry-After within a second rather than after the 120 s idle timeout, or goes to another
 *  worker of the role — and the router serves again as soon as the worker answers. Real worker and
 *  router processes; `/health` probes the workers (2 s deadline) as the periodic check does. */
import assert from 'node:assert/strict'
import type { ChildProcess } from 'node:child_process'
import { after, test } from 'node:test'
import { echoModelDir } from '../helpers/paths.js'
import {
  allocatePorts,
  eventually,
  makeTenants,
  startDecode,
  startPart,
  startPrefill,
  startRouterPart,
  stopAll,
} from '../reliability/helpers.js'

const children: ChildProcess[] = []
after(async () => {
  // A test that timed out may leave a worker stopped: a stopped process never handles SIGTERM.
  for (const child of children) if (child.exitCode === null) child.kill('SIGCONT')
  await stopAll(children)
})

/** Bound of each test: far below the 120 s a request waited for a silent worker before. */
const testTimeoutMs = 60_000

/** One short completion; its status, Retry-After and error code. */
async function complete(url: string, key: string) {
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'echo-tiny', prompt: 'hello', max_tokens: 8 }),
  })
  const body = (await res.json()) as { error?: { code: string } }
  return { status: res.status, retryAfter: res.headers.get('retry-after'), code: body.error?.code }
}

/** Whether the router's `/health` says a worker is unreachable (its probe found it so). */
async function isUnreachableReported(url: string): Promise<boolean> {
  const res = await fetch(`${url}/health`)
  const body = (await res.json()) as { reason?: string }
  return res.status === 503 && body.reason === 'a worker is unreachable'
}

for (const role of ['decode', 'prefill'] as const) {
  test(
    `a SIGSTOPped ${role} worker: once /health finds it unreachable a new request gets 503 worker_unavailable with Retry-After, and after SIGCONT the next one is served`,
    { timeout: testTimeoutMs },
    async () => {
      const ports = await allocatePorts()
      const tenants = makeTenants()
      const prefill = await startPrefill(ports)
      const decode = await startDecode(ports)
      children.push(prefill, decode, await startRouterPart(ports, tenants.file))
      const url = `http://127.0.0.1:${ports.router}`
      assert.equal((await complete(url, tenants.a.key)).status, 200)
      const silent = role === 'decode' ? decode : prefill
      silent.kill('SIGSTOP')
      try {
        assert.ok(await eventually(() => isUnreachableReported(url)), '/health never said so')
        assert.deepEqual(await complete(url, tenants.a.key), {
          status: 503,
          retryAfter: '1',
          code: 'worker_unavailable',
        })
      } finally {
        silent.kill('SIGCONT')
      }
      // Still unreachable by the last probe: the request probes it again and is served.
      assert.equal((await complete(url, tenants.a.key)).status, 200)
    },
  )
}

test(
  'two decode workers, one SIGSTOPped: once /health finds it unreachable, every new request is served by the other',
  { timeout: testTimeoutMs },
  async () => {
    const ports = await allocatePorts()
    const other = await allocatePorts()
    const tenants = makeTenants()
    children.push(await startPrefill(ports))
    const decode = await startDecode(ports)
    children.push(decode, await startDecode(other))
    children.push(
      await startPart([
        'router', '--model', echoModelDir, '--host', '127.0.0.1', '--port', String(ports.router),
        '--prefill', `http://127.0.0.1:${ports.prefill}`,
        '--decode', `http://127.0.0.1:${ports.decode}`,
        '--decode', `http://127.0.0.1:${other.decode}`,
        '--tenants', tenants.file,
      ]), // prettier-ignore
    )
    const url = `http://127.0.0.1:${ports.router}`
    decode.kill('SIGSTOP')
    try {
      assert.ok(await eventually(() => isUnreachableReported(url)), '/health never said so')
      // Round-robin would send every other request to the stopped worker.
      for (let i = 0; i < 4; i++) {
        assert.deepEqual(await complete(url, tenants.a.key), {
          status: 200,
          retryAfter: null,
          code: undefined,
        })
      }
    } finally {
      decode.kill('SIGCONT')
    }
  },
)
