/** The floors of `bench -- router`: what a plain HTTP/1.1 reverse proxy costs to relay the same
 *  streamed request, so that the router's own cost can be held against what any relay costs.
 *  Each floor is a real, widely deployed proxy from the system's packages (Debian's
 *  /usr/sbin/nginx and /usr/sbin/haproxy), started here with a generated configuration in a
 *  temporary directory, listening on 127.0.0.1 at a port the kernel picked, relaying to one
 *  upstream on 127.0.0.1 over keep-alive connections with response buffering off (each SSE chunk
 *  leaves as it arrives, as the router sends it), one process and one thread each so that its CPU
 *  is one process's to read. When the binary is absent the floor is absent, with the reason: never
 *  a made-up figure.
 *  CPU: the process's user + system time from /proc/PID/stat (clock ticks, 10 ms each at Linux's
 *  usual 100 Hz: read over runs of thousands of requests, the granularity is below 0.01 ms a
 *  request). Knows the proxies' configuration languages; knows nothing of kvfence. */
import { type ChildProcess, spawn } from 'node:child_process'
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import net from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

/** The floors this bench knows, by name, with the binary each needs. */
export const floorBinaries = { nginx: '/usr/sbin/nginx', haproxy: '/usr/sbin/haproxy' } as const
export type FloorName = keyof typeof floorBinaries

/** A running floor in front of one upstream. */
export interface RelayFloor {
  readonly name: FloorName
  /** Where clients send requests, `http://127.0.0.1:PORT`. */
  readonly url: string
  /** The proxy's CPU time so far (user + system), ms. */
  cpuMs(): number
  stop(): Promise<void>
}

/** Why a floor could not be started (its binary is absent, or it failed to start). */
export interface AbsentFloor {
  readonly name: FloorName
  readonly absent: string
}

/** Clock ticks per second of /proc/PID/stat's times (Linux's USER_HZ, 100 on every platform
 *  Linux runs on today; `getconf CLK_TCK`). */
const ticksPerSecond = 100
const startTimeoutMs = 10_000

/** Starts the floor `name` relaying to `upstreamPort` on 127.0.0.1; an {@link AbsentFloor} when
 *  its binary is not installed or it did not start (its own message, one line). */
export async function startFloor(
  name: FloorName,
  upstreamPort: number,
): Promise<RelayFloor | AbsentFloor> {
  const binary = floorBinaries[name]
  if (!existsSync(binary)) return { name, absent: `${binary} is not installed` }
  const dir = mkdtempSync(join(tmpdir(), `kvfence-bench-${name}-`))
  try {
    const port = await freePort()
    const configFile = join(dir, `${name}.conf`)
    writeFileSync(configFile, configs[name](dir, port, upstreamPort))
    const args =
      name === 'nginx'
        ? ['-e', join(dir, 'error.log'), '-p', dir, '-c', configFile]
        : ['-db', '-f', configFile]
    const child = spawn(binary, args, { stdio: ['ignore', 'ignore', 'pipe'] })
    let stderr = ''
    child.stderr!.on('data', (d: Buffer) => (stderr += d.toString()))
    await untilListening(port, child, () => stderr || readIfThere(join(dir, 'error.log')))
    return {
      name,
      url: `http://127.0.0.1:${port}`,
      cpuMs: () => processCpuMs(child.pid!),
      stop: async () => {
        await stopChild(child)
        rmSync(dir, { recursive: true, force: true })
      },
    }
  } catch (err) {
    rmSync(dir, { recursive: true, force: true })
    return { name, absent: `${name} did not start: ${(err as Error).message.split('\n')[0]}` }
  }
}

/** Each floor's configuration: listening on 127.0.0.1:`port`, relaying to 127.0.0.1:`upstream`
 *  over HTTP/1.1 keep-alive, not buffering responses, no access log, files only under `dir`. */
const configs: Record<FloorName, (dir: string, port: number, upstream: number) => string> = {
  nginx: (dir, port, upstream) => `
daemon off;
# One process doing the relaying (a master would only watch it), so that its CPU is one process's.
master_process off;
worker_processes 1;
pid ${dir}/nginx.pid;
error_log ${dir}/error.log error;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path ${dir}/body;
  proxy_temp_path ${dir}/proxy;
  fastcgi_temp_path ${dir}/fastcgi;
  uwsgi_temp_path ${dir}/uwsgi;
  scgi_temp_path ${dir}/scgi;
  keepalive_requests 1000000;
  upstream kvfence { server 127.0.0.1:${upstream}; keepalive 256; keepalive_requests 1000000; }
  server {
    listen 127.0.0.1:${port};
    location / {
      proxy_pass http://kvfence;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }
  }
}
`,
  haproxy: (_dir, port, upstream) => `
global
  nbthread 1
  maxconn 4096
defaults
  mode http
  option http-keep-alive
  http-reuse always
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend relay
  bind 127.0.0.1:${port}
  default_backend kvfence
backend kvfence
  server upstream 127.0.0.1:${upstream}
`,
}

/** A port free on 127.0.0.1 now (the kernel's pick for a listener at port 0, then closed): the
 *  proxies take a port in their configuration, not 0. */
function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = net.createServer()
    server.once('error', reject)
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as net.AddressInfo
      server.close(() => resolve(port))
    })
  })
}

/** Resolves once 127.0.0.1:`port` accepts a connection; rejects if `child` exits first or after
 *  {@link startTimeoutMs}, with what `why()` read of the proxy's errors. */
async function untilListening(port: number, child: ChildProcess, why: () => string): Promise<void> {
  const deadline = Date.now() + startTimeoutMs
  for (;;) {
    if (child.exitCode !== null) throw new Error(`exited with ${child.exitCode}: ${why().trim()}`)
    const isOpen = await new Promise<boolean>((resolve) => {
      const socket = net.connect(port, '127.0.0.1')
      socket.once('connect', () => (socket.destroy(), resolve(true)))
      socket.once('error', () => resolve(false))
    })
    if (isOpen) return
    if (Date.now() > deadline) {
      child.kill('SIGKILL')
      throw new Error(`not listening after ${startTimeoutMs} ms: ${why().trim()}`)
    }
    await new Promise((resolve) => setTimeout(resolve, 50))
  }
}

function readIfThere(file: string): string {
  return existsSync(file) ? readFileSync(file, 'utf8') : ''
}

/** User + system CPU of process `pid` so far, ms (/proc/PID/stat fields 14 and 15). */
export function processCpuMs(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8')
  // The command name (field 2) is in parentheses and may hold spaces: count from after it.
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ')
  const ticks = Number(fields[11]) + Number(fields[12])
  return (ticks * 1000) / ticksPerSecond
}

/** Stops `child` (SIGTERM; SIGKILL after 5 s) and waits for its exit. */
async function stopChild(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  child.kill('SIGTERM')
  const timer = setTimeout(() => child.kill('SIGKILL'), 5_000)
  await exited
  clearTimeout(timer)
}
