/** The two-hosts setup of two-hosts.test.ts (P and D in separate network namespaces joined by a
 *  veth pair; the router beside P), with every part over mutual TLS 1.3: certificates from the real
 *  `kvfence certs init --hosts`, the workers started with `--tls-*`, the router with
 *  `--config` naming them by https: URL and `tls: { dir }`. Requests cross the link with the
 *  oracle's tokens; a plaintext peer on P's host that dials D's transfer port is dropped with no
 *  frame answered and nothing reserved. Needs root and `ip netns`; skipped, with the reason,
 *  elsewhere. */
import { newClusterToken } from '../../src/control/cluster-token.js'
import assert from 'node:assert/strict'
import { execFileSync, type ChildProcess } from 'node:child_process'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, it } from 'node:test'
import { stringify } from 'yaml'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { Oracle } from '../../src/soak/oracle.js'
import { cliPath, echoModelDir } from '../helpers/paths.js'
import { makeTenants, shape, stopAll } from './helpers.js'
import {
  call as callRouter,
  forwarder as startForwarder,
  ip,
  netnsUnavailable,
  startIn as startInNs,
} from './netns.js'
import { tlsFlags as clusterTlsFlags } from '../helpers/cluster.js'

const id = (process.pid % 90_000) + 10_000
const nsP = `kvtP${id}`
const nsD = `kvtD${id}`
const vethP = `ktp${id}`
const vethD = `ktd${id}`
const addrP = '10.213.8.1'
const addrD = '10.213.8.2'
const ports = { prefill: 18201, decode: 18202, transfer: 18203, router: 18200 }
const socketPath = join(tmpdir(), `kvfence-two-hosts-tls-${id}.sock`)

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

const certs = mkdtempSync(join(tmpdir(), 'kvfence-two-hosts-tls-'))
const tlsFlags = (part: string) => clusterTlsFlags(certs, part)

/** Inside namespace `ns`: connect to host:port in plaintext, send a HELLO-sized burst, and report
 *  how many bytes came back before the peer closed (or 'open' if it did not within 5 s). */
function plaintextProbe(ns: string, host: string, port: number): string {
  const code = `const s=require('net').connect(${port},${JSON.stringify(host)});let n=0;
s.on('connect',()=>s.write(Buffer.from('4b564600000000000000000000000000','hex')));
s.on('data',(d)=>n+=d.length);s.on('error',()=>{});
s.on('close',()=>{console.log('closed '+n);process.exit(0)});setTimeout(()=>{console.log('open');process.exit(0)},5000)`
  return execFileSync('ip', ['netns', 'exec', ns, process.execPath, '-e', code]).toString().trim()
}

describe('P and D on two hosts over mutual TLS', { skip: skipReason ?? false }, () => {
  const tenants = makeTenants()
  const children: ChildProcess[] = []
  const oracle = new Oracle(echoModelDir, shape.decodePages, shape.pageSize)

  before(async () => {
    execFileSync(process.execPath, [
      cliPath,
      'certs',
      'init',
      certs,
      '--force',
      '--hosts',
      `${addrP},${addrD}`,
    ])
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
    const config = join(certs, 'cluster.yaml')
    writeFileSync(
      config,
      stringify({
        model: echoModelDir,
        router: { host: '127.0.0.1', port: ports.router, logLevel: 'warn' },
        workers: {
          prefill: [{ url: `https://127.0.0.1:${ports.prefill}` }],
          decode: [{ url: `https://${addrD}:${ports.decode}` }],
        },
        tls: { dir: certs },
        tenants: [tenants.a, tenants.b].map((t) => ({
          name: t.name,
          keySha256: apiKeyDigest(t.key),
        })),
      }),
    )
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
        ...tlsFlags('decode'),
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
        ...tlsFlags('prefill'),
      ]),
    )
    children.push(await startIn(nsP, ['router', '--config', config]), await forwarder())
  })

  after(async () => {
    await stopAll(children)
    rmSync(socketPath, { force: true })
    rmSync(certs, { recursive: true, force: true })
    for (const ns of [nsP, nsD]) {
      try {
        ip('netns', 'del', ns)
      } catch {
        // already gone
      }
    }
  })

  it('serves requests across the link over TLS with the oracle’s tokens', async () => {
    const prompt = 'the river walks near the stone garden and Kd8Fz2QwX5pLr7Ty holds the light'
    const res = await call('POST', '/v1/completions', tenants.a.key, {
      model: 'echo-tiny',
      prompt,
      max_tokens: 24,
      temperature: 0,
    })
    assert.equal(res.status, 200)
    const text = (res.json.choices as { text: string }[])[0].text
    assert.equal(text, oracle.expected({ endpoint: 'completion', prompt, maxTokens: 24 }).text)
  })

  it('drops a plaintext peer on the transfer port: no frame answered, nothing reserved', async () => {
    assert.equal(plaintextProbe(nsP, addrD, ports.transfer), 'closed 0')
    const info = await call('GET', '/server_info', null, undefined, 10_000)
    assert.deepEqual(
      (info.json.workers as { numPagesUsed: number }[]).map((w) => w.numPagesUsed),
      [0, 0],
    )
  })
})
