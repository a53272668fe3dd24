/** P and D on two "hosts", in plaintext (every part given `--allow-plaintext`: without it each
 *  refuses to start, see test/config/plaintext.test.ts): separate network namespaces joined by a veth pair (10.213.7.1 ↔
 *  10.213.7.2, addresses that exist only inside these namespaces). The router and P share the
 *  first namespace, D is alone in the second. Requests are served across the link; then the link
 *  is slowed and cut during a large prompt's transfer: the request ends in a clean error, both
 *  pools return to 0 pages, and once the link is back the next request is served with the oracle's
 *  tokens. Needs root and `ip netns` (CI runs as root); skipped, with the reason, elsewhere. */
import { newClusterToken } from '../../src/control/cluster-token.js'
import assert from 'node:assert/strict'
import { type ChildProcess } from 'node:child_process'
import { rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { after, before, describe, it } from 'node:test'
import { Oracle } from '../../src/soak/oracle.js'
import { echoModelDir } from '../helpers/paths.js'
import { makeTenants, shape, stopAll } from './helpers.js'
import {
  call as callRouter,
  forwarder as startForwarder,
  ip,
  netnsUnavailable,
  startIn as startInNs,
} from './netns.js'

const id = process.pid % 100_000
const nsP = `kvfP${id}`
const nsD = `kvfD${id}`
const vethP = `kvp${id}`
const vethD = `kvd${id}`
const addrP = '10.213.7.1'
const addrD = '10.213.7.2'
const ports = { prefill: 18101, decode: 18102, transfer: 18103, router: 18100 }
const socketPath = join(tmpdir(), `kvfence-two-hosts-${id}.sock`)

const hosts = { nsP, socketPath, routerPort: ports.router, clusterToken: newClusterToken() }
const skipReason = netnsUnavailable()
const startIn = (ns: string, args: string[]) => startInNs(hosts, ns, args)
const forwarder = () => startForwarder(hosts)
const call = (
  method: string,
  path: string,
  key: string | null,
  body?: unknown,
  timeoutMs?: number,
) => callRouter(hosts, method, path, key, body, timeoutMs)

async function poolsUsed(): Promise<number[] | null> {
  const info = await call('GET', '/server_info', null, undefined, 10_000).catch(() => null)
  if (info?.status !== 200) return null
  return (info.json.workers as { numPagesUsed: number }[]).map((w) => w.numPagesUsed)
}

describe('P and D on two hosts (network namespaces)', { skip: skipReason ?? false }, () => {
  const tenants = makeTenants()
  const children: ChildProcess[] = []
  const oracle = new Oracle(echoModelDir, shape.decodePages, shape.pageSize)

  before(async () => {
    ip('netns', 'add', nsP)
    ip('netns', 'add', nsD)
    ip('link', 'add', vethP, 'type', 'veth', 'peer', 'name', vethD)
    ip('link', 'set', vethP, 'netns', nsP)
    ip('link', 'set', vethD, 'netns', nsD)
    for (const [ns, dev, addr] of [
      [nsP, vethP, addrP],
      [nsD, vethD, addrD],
    ]) {
      ip('-n', ns, 'link', 'set', 'lo', 'up')
      ip('-n', ns, 'addr', 'add', `${addr}/30`, 'dev', dev)
      ip('-n', ns, 'link', 'set', dev, 'up')
    }
    const common = ['--model', echoModelDir, '--page-size', String(shape.pageSize)]
    children.push(
      await startIn(nsD, [
        'decode',
        ...common,
        '--host',
        addrD,
        '--port',
        String(ports.decode),
        '--pages',
        String(shape.decodePages),
        '--transfer-host',
        addrD,
        '--transfer-port',
        String(ports.transfer),
        // Plaintext across hosts is refused unless said (two-hosts-tls.test.ts runs it over TLS).
        '--allow-plaintext',
      ]),
      await startIn(nsP, [
        'prefill',
        ...common,
        '--host',
        '127.0.0.1',
        '--port',
        String(ports.prefill),
        '--pages',
        String(shape.prefillPages),
        '--allow-plaintext', // it sends KV pages to D at addrD
      ]),
    )
    children.push(
      await startIn(nsP, [
        'router',
        '--model',
        echoModelDir,
        '--host',
        '127.0.0.1',
        '--port',
        String(ports.router),
        '--prefill',
        `http://127.0.0.1:${ports.prefill}`,
        '--decode',
        `http://${addrD}:${ports.decode}`,
        '--tenants',
        tenants.file,
        '--allow-plaintext', // it dials D at addrD
      ]),
      await forwarder(),
    )
  })

  after(async () => {
    await stopAll(children)
    rmSync(socketPath, { force: true })
    for (const ns of [nsP, nsD]) {
      try {
        ip('netns', 'del', ns) // deleting the namespace deletes its end of the veth pair, and so the pair
      } catch {
        // already gone
      }
    }
  })

  const complete = (prompt: string, maxTokens: number) =>
    call('POST', '/v1/completions', tenants.a.key, {
      model: 'echo-tiny',
      prompt,
      max_tokens: maxTokens,
      temperature: 0,
    })

  it('serves requests across the link with the oracle’s tokens', async () => {
    const prompt = 'the river walks near the stone garden and Kd8Fz2QwX5pLr7Ty holds the light'
    const res = await complete(prompt, 24)
    assert.equal(res.status, 200)
    const text = (res.json.choices as { text: string }[])[0].text
    assert.equal(text, oracle.expected({ endpoint: 'completion', prompt, maxTokens: 24 }).text)
  })

  it('the link cut during a large transfer: a clean error, pools back to 0, served again once the link is back', async () => {
    // ~480 prompt tokens ≈ 480 KiB of KV: at 256 kbit/s the transfer takes ~15 s; cut it after 2 s.
    ip(
      'netns',
      'exec',
      nsP,
      'tc',
      'qdisc',
      'add',
      'dev',
      vethP,
      'root',
      'tbf',
      'rate',
      '256kbit',
      'burst',
      '16kb',
      'latency',
      '400ms',
    )
    const prompt = 'the stone garden and the river walks '.repeat(13).slice(0, 470)
    const pending = complete(prompt, 8)
    await sleep(2_000)
    ip('-n', nsP, 'link', 'set', vethP, 'down')
    const res = await pending
    assert.ok(res.status >= 500 && res.status < 600, `status ${res.status}`)
    const error = res.json.error as { code: string; message: string }
    assert.match(error.code, /^(transfer_failed|worker_unavailable)$/)
    ip('-n', nsP, 'link', 'set', vethP, 'up')
    ip('netns', 'exec', nsP, 'tc', 'qdisc', 'del', 'dev', vethP, 'root')
    let pools: number[] | null = null
    for (let i = 0; i < 100 && !(pools && pools.every((n) => n === 0)); i++) {
      pools = await poolsUsed()
      await sleep(200)
    }
    assert.deepEqual(pools, [0, 0], 'a pool did not return to 0 pages')
    const small = 'the river walks near the stone garden'
    const again = await complete(small, 16)
    assert.equal(again.status, 200)
    assert.equal(
      (again.json.choices as { text: string }[])[0].text,
      oracle.expected({ endpoint: 'completion', prompt: small, maxTokens: 16 }).text,
    )
  })
})
