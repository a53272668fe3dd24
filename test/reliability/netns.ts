/** The two-hosts tests' shared parts: P and D in separate network namespaces, parts started inside
 *  a namespace, and the router reached through a Unix-socket forwarder (the file system is shared
 *  across namespaces, so no address outside them is ever used). */
import { execFileSync, spawn, type ChildProcess } from 'node:child_process'
import http from 'node:http'
import { clusterTokenEnv } from '../../src/control/cluster-token.js'
import { cliPath } from '../helpers/paths.js'

/** One two-hosts setup: the router's namespace, the forwarder's socket, the router's port there
 *  and the control-plane token every part shares. */
export interface TwoHosts {
  readonly nsP: string
  readonly socketPath: string
  readonly routerPort: number
  readonly clusterToken: string
}

export function ip(...args: string[]): void {
  execFileSync('ip', args, { stdio: 'ignore' })
}

/** Why this machine cannot run the two-hosts tests, or null. */
export function netnsUnavailable(): string | null {
  if (process.platform !== 'linux') return 'network namespaces need Linux'
  if (process.getuid?.() !== 0) return 'network namespaces need root'
  try {
    execFileSync('ip', ['netns', 'list'], { stdio: 'ignore' })
    execFileSync('tc', ['-V'], { stdio: 'ignore' })
  } catch {
    return '`ip netns` or `tc` is not available'
  }
  return null
}
/** Run `kvfence <args>` inside namespace `ns` and resolve once it reports ready over IPC. */
export function startIn(h: TwoHosts, ns: string, args: string[]): Promise<ChildProcess> {
  const child = spawn(
    'ip',
    ['netns', 'exec', ns, process.execPath, cliPath, ...args, '--log-level', 'warn'],
    {
      stdio: ['ignore', 'ignore', 'pipe', 'ipc'],
      // Workers bound to a non-loopback address need the control-plane token; all parts share it.
      env: { ...process.env, [clusterTokenEnv]: h.clusterToken },
    },
  )
  let tail = ''
  child.stderr!.on('data', (c: Buffer) => (tail = (tail + c.toString()).slice(-2000)))
  return new Promise((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new Error(`${args[0]} in ${ns} did not start: ${tail}`)),
      30_000,
    )
    child.once('exit', (code) => reject(new Error(`${args[0]} in ${ns} exited ${code}: ${tail}`)))
    child.on('message', (m: { type?: string }) => {
      if (m?.type !== 'ready') return
      clearTimeout(timer)
      child.removeAllListeners('exit')
      resolve(child)
    })
  })
}

/** A Unix-socket forwarder to the router inside nsP (the file system is shared across network
 *  namespaces, so the test reaches the router without any address outside the namespaces). */
export function forwarder(h: TwoHosts): Promise<ChildProcess> {
  const code = `const net=require('net');require('fs').rmSync(${JSON.stringify(h.socketPath)},{force:true});
net.createServer(c=>{const o=net.connect(${h.routerPort},'127.0.0.1');c.pipe(o).pipe(c);c.on('error',()=>o.destroy());o.on('error',()=>c.destroy())})
.listen(${JSON.stringify(h.socketPath)},()=>process.send({type:'ready'}))`
  const child = spawn('ip', ['netns', 'exec', h.nsP, process.execPath, '-e', code], {
    stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
  })
  return new Promise((resolve, reject) => {
    child.once('exit', (c) => reject(new Error(`forwarder exited ${c}`)))
    child.on('message', () => {
      child.removeAllListeners('exit')
      resolve(child)
    })
  })
}

/** One HTTP exchange with the router through the forwarder. */
export function call(
  h: TwoHosts,
  method: string,
  path: string,
  key: string | null,
  body?: unknown,
  timeoutMs = 90_000,
) {
  return new Promise<{ status: number; json: Record<string, unknown> }>((resolve, reject) => {
    const data = body === undefined ? undefined : JSON.stringify(body)
    const req = http.request(
      {
        socketPath: h.socketPath,
        path,
        method,
        timeout: timeoutMs,
        headers: {
          ...(key ? { authorization: `Bearer ${key}` } : {}),
          ...(data
            ? { 'content-type': 'application/json', 'content-length': Buffer.byteLength(data) }
            : {}),
        },
      },
      (res) => {
        let text = ''
        res.setEncoding('utf8')
        res.on('data', (c: string) => (text += c))
        res.on('end', () =>
          resolve({ status: res.statusCode!, json: JSON.parse(text) as Record<string, unknown> }),
        )
      },
    )
    req.on('timeout', () => req.destroy(new Error('hung')))
    req.on('error', reject)
    req.end(data)
  })
}
