/** A worker killed (SIGKILL) under load: every waiting client gets 503 `worker_unavailable`
 *  with Retry-After — none a reset connection. Real worker and router processes. */
import assert from 'node:assert/strict'
import type { ChildProcess } from 'node:child_process'
import { after, test } from 'node:test'
import {
  allocatePorts,
  childPid,
  freePort,
  kill9,
  makeTenants,
  startDecode,
  startPart,
  startPrefill,
  startRouterPart,
  stopAll,
} from '../reliability/helpers.js'

const children: ChildProcess[] = []
after(() => stopAll(children))

/** One plain completion; its status, Retry-After and error code, or the fetch failure. */
async function complete(url: string, key: string) {
  try {
    const res = await fetch(`${url}/v1/completions`, {
      method: 'POST',
      headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'echo-tiny', prompt: 'x'.repeat(300), max_tokens: 150 }),
    })
    const body = (await res.json()) as { error?: { code: string } }
    return {
      status: res.status,
      retryAfter: res.headers.get('retry-after'),
      code: body.error?.code,
    }
  } catch (err) {
    return { status: 0, retryAfter: null, code: String((err as Error).cause ?? err) }
  }
}

test('SIGKILL of the prefill worker under 20 requests: each client gets 200 or 503 worker_unavailable with Retry-After', async () => {
  const ports = await allocatePorts()
  const tenants = makeTenants()
  const prefill = await startPrefill(ports)
  children.push(prefill, await startDecode(ports))
  children.push(await startRouterPart(ports, tenants.file))
  const url = `http://127.0.0.1:${ports.router}`
  const results = Array.from({ length: 20 }, () => complete(url, tenants.a.key))
  await new Promise((resolve) => setTimeout(resolve, 150))
  await kill9(prefill)
  const settled = await Promise.all(results)
  const failed = settled.filter((r) => r.status !== 200)
  assert.ok(failed.length > 0, 'the kill came after every request had finished')
  for (const r of failed)
    assert.deepEqual(r, { status: 503, retryAfter: '1', code: 'worker_unavailable' })
})

test('kvfence serve, SIGKILL of its prefill worker under 20 requests: no client sees a reset connection', async () => {
  const port = await freePort()
  const tenants = makeTenants()
  const serve = await startPart(['serve', '--tenants', tenants.file, '--port', String(port)])
  children.push(serve)
  const exited = new Promise((resolve) => serve.once('exit', resolve))
  const url = `http://127.0.0.1:${port}`
  const results = Array.from({ length: 20 }, () => complete(url, tenants.a.key))
  await new Promise((resolve) => setTimeout(resolve, 150))
  process.kill(childPid(serve.pid!, 'prefill'), 'SIGKILL')
  const settled = await Promise.all(results)
  const failed = settled.filter((r) => r.status !== 200)
  assert.ok(failed.length > 0, 'the kill came after every request had finished')
  for (const r of failed) {
    assert.equal(r.status, 503, `a client got ${r.status} (${r.code})`)
    assert.equal(r.retryAfter, '1')
    assert.ok(r.code === 'worker_unavailable' || r.code === 'shutting_down', r.code)
  }
  await exited
})
