/** Shared by the reliability tests: start P, D and the router as separate processes of
 *  `dist/src/cli/main.js` on fixed ports (so one part can be killed and restarted in place), read a
 *  worker's pool, and wait for conditions with bounded polling. */
import { fork, type ChildProcess } from 'node:child_process'
import { readFileSync, readdirSync, writeFileSync } from 'node:fs'
import net from 'node:net'
import { join } from 'node:path'
import OpenAI from 'openai'
import { newApiKey, tenantsYaml } from '../../src/router/tenants/tenant-keys.js'
import { ServerInfo } from '../../src/control/messages.js'
import { cliPath, echoModelDir } from '../helpers/paths.js'
import { pollUntil } from '../helpers/poll.js'
import { tempDir } from '../helpers/temp-dir.js'

/** Pool shape of these tests: prefill 32 × 16 = 512 tokens (the context), decode 64 × 16. */
export const shape = { pageSize: 16, prefillPages: 32, decodePages: 64 }

/** Lowest port of the kernel's ephemeral range (Linux `ip_local_port_range`; 32768 elsewhere). */
function ephemeralLow(): number {
  try {
    const low = Number(
      readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').split(/\s+/)[0],
    )
    return Number.isInteger(low) && low > 2048 ? low : 32768
  } catch {
    return 32768
  }
}

const taken = new Set<number>()

/** Whether `port` can be bound on 127.0.0.1 right now (bound, then released). */
function canBind(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const server = net.createServer()
    server.once('error', () => resolve(false))
    server.listen(port, '127.0.0.1', () => server.close(() => resolve(true)))
  })
}

/** A free TCP port on 127.0.0.1 *below the kernel's ephemeral range*. A part killed and restarted
 *  in place must find its port again: a port from the ephemeral range (what `listen(0)` gives) can
 *  be taken meanwhile as the local port of any outgoing connection on the machine, and the restart
 *  then fails with EADDRINUSE (seen in CI). */
export async function freePort(): Promise<number> {
  const high = ephemeralLow()
  const low = Math.max(1025, high - 12_000)
  for (let tries = 0; tries < 200; tries++) {
    const port = low + Math.floor(Math.random() * (high - low))
    if (taken.has(port) || !(await canBind(port))) continue
    taken.add(port)
    return port
  }
  throw new Error(`no free port found in ${low}..${high - 1}`)
}

/** Two tenants with fresh keys in a temporary tenants file (removed at exit). */
export function makeTenants(): { file: string; a: Tenant; b: Tenant } {
  const dir = tempDir('kvfence-rel-')
  const a = { name: 'tenant-a', key: newApiKey() }
  const b = { name: 'tenant-b', key: newApiKey() }
  const file = join(dir, 'tenants.yaml')
  writeFileSync(file, tenantsYaml([a, b]))
  return { file, a, b }
}

export interface Tenant {
  name: string
  key: string
}

/** Fork `kvfence <args>` (with `env` added to this process's environment) and resolve once it
 *  reports ready over IPC; rejects with the part's
 *  last stderr when it exits or is not ready within `timeoutMs`. */
export function startPart(
  args: string[],
  timeoutMs = 30_000,
  env: NodeJS.ProcessEnv = {},
): Promise<ChildProcess> {
  const child = fork(cliPath, [...args, '--log-level', 'warn'], {
    stdio: ['ignore', 'ignore', 'pipe', 'ipc'],
    env: { ...process.env, ...env },
  })
  let tail = ''
  child.stderr!.on('data', (chunk: Buffer) => {
    tail = (tail + chunk.toString('utf8')).slice(-2000)
  })
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL')
      reject(new Error(`kvfence ${args[0]} did not start: ${tail}`))
    }, timeoutMs)
    child.once('exit', (code) => {
      clearTimeout(timer)
      reject(new Error(`kvfence ${args[0]} exited with ${code}: ${tail}`))
    })
    child.on('message', (msg: { type?: string }) => {
      if (msg?.type !== 'ready') return
      clearTimeout(timer)
      child.removeAllListeners('exit')
      resolve(child)
    })
  })
}

/** Ports of a cluster started part by part. */
export interface Ports {
  prefill: number
  decode: number
  transfer: number
  router: number
}

export async function allocatePorts(): Promise<Ports> {
  return {
    prefill: await freePort(),
    decode: await freePort(),
    transfer: await freePort(),
    router: await freePort(),
  }
}

const common = [
  '--model',
  echoModelDir,
  '--page-size',
  String(shape.pageSize),
  '--host',
  '127.0.0.1',
]

export function startPrefill(ports: Ports): Promise<ChildProcess> {
  return startPart([
    'prefill',
    ...common,
    '--port',
    String(ports.prefill),
    '--pages',
    String(shape.prefillPages),
  ])
}

export function startDecode(ports: Ports, transferPort = ports.transfer): Promise<ChildProcess> {
  return startPart([
    'decode', ...common, '--port', String(ports.decode), '--pages', String(shape.decodePages),
    '--transfer-host', '127.0.0.1', '--transfer-port', String(transferPort),
  ]) // prettier-ignore
}

export function startRouterPart(ports: Ports, tenantsFile: string): Promise<ChildProcess> {
  return startPart([
    'router', '--model', echoModelDir, '--host', '127.0.0.1', '--port', String(ports.router),
    '--prefill', `http://127.0.0.1:${ports.prefill}`, '--decode', `http://127.0.0.1:${ports.decode}`,
    '--tenants', tenantsFile,
  ]) // prettier-ignore
}

/** SIGKILL `child` and wait until it has exited. */
export async function kill9(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return
  const exited = new Promise((resolve) => child.once('exit', resolve))
  child.kill('SIGKILL')
  await exited
}

/** SIGTERM, then SIGKILL after 3 s; resolves once every child exited. */
export async function stopAll(children: (ChildProcess | undefined)[]): Promise<void> {
  await Promise.all(
    children.map(async (child) => {
      if (!child || child.exitCode !== null || child.signalCode !== null) return
      const exited = new Promise((resolve) => child.once('exit', resolve))
      const timer = setTimeout(() => child.kill('SIGKILL'), 3_000)
      child.kill('SIGTERM')
      await exited
      clearTimeout(timer)
    }),
  )
}

/** Pages in use on the worker at `url`. */
export async function pagesUsed(url: string): Promise<number> {
  const res = await fetch(`${url}/server_info`, { signal: AbortSignal.timeout(5_000) })
  return ServerInfo.parse(await res.json()).numPagesUsed
}

/** Poll `probe` every 200 ms until it returns true or `tries` polls passed; returns the last result. */
export async function eventually(probe: () => Promise<boolean>, tries = 100): Promise<boolean> {
  return pollUntil(probe, { timeoutMs: tries * 200, intervalMs: 200 })
}

/** An `openai` client for `baseUrl` (router root) with no retries and a bounded timeout. */
export function client(baseUrl: string, key: string, timeoutMs = 30_000): OpenAI {
  return new OpenAI({ baseURL: `${baseUrl}/v1`, apiKey: key, maxRetries: 0, timeout: timeoutMs })
}

/** The pid of the child of `parent` whose command line names `part` (Linux /proc). */
export function childPid(parent: number, part: string): number {
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue
    try {
      const ppid = Number(readFileSync(`/proc/${entry}/stat`, 'utf8').split(') ')[1].split(' ')[1])
      const argv = readFileSync(`/proc/${entry}/cmdline`, 'utf8').split('\0')
      if (ppid === parent && argv.includes(part)) return Number(entry)
    } catch {
      // the process ended meanwhile
    }
  }
  throw new Error(`no ${part} child of ${parent}`)
}
