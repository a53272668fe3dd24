/** `kvfence watch` as an operator runs it, for the watch's tests: the real CLI in a child process
 *  (JSON log lines on stdout collected as they come), its `/metrics` read over HTTP, and a real
 *  HTTP server that records the webhook bodies it receives. */
import { spawn, type ChildProcess } from 'node:child_process'
import { createServer } from 'node:http'
import type { AddressInfo } from 'node:net'
import { cliPath } from '../helpers/paths.js'

/** One pino line of the watch's log. */
export type LogLine = Record<string, unknown> & { readonly msg: string; readonly level: number }

export interface WatchProcess {
  readonly child: ChildProcess
  readonly lines: LogLine[]
  /** Everything written to stderr. */
  stderr(): string
  /** The first line (already seen or still to come) for which `isWanted` holds. */
  waitFor(isWanted: (line: LogLine) => boolean, timeoutMs: number, what: string): Promise<LogLine>
  /** The `/metrics` URL printed in the start-up line. */
  metricsUrl(): Promise<string>
  /** Resolves with the exit code and signal once the process has ended. */
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>
}

/** Starts `kvfence watch ARGS` with `env` added to this process's environment. */
export function startWatch(
  args: readonly string[],
  env: Record<string, string> = {},
): WatchProcess {
  const child = spawn(process.execPath, [cliPath, 'watch', ...args], {
    env: { ...process.env, ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  const lines: LogLine[] = []
  const waiters: (() => void)[] = []
  let buffered = ''
  let stderr = ''
  child.stdout!.setEncoding('utf8').on('data', (chunk: string) => {
    buffered += chunk
    const parts = buffered.split('\n')
    buffered = parts.pop() ?? ''
    for (const part of parts) if (part.trim() !== '') lines.push(JSON.parse(part) as LogLine)
    for (const wake of waiters.splice(0)) wake()
  })
  child.stderr!.setEncoding('utf8').on('data', (chunk: string) => (stderr += chunk))
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
    child.on('exit', (code, signal) => {
      resolve({ code, signal })
      for (const wake of waiters.splice(0)) wake()
    }),
  )
  const waitFor = async (
    isWanted: (line: LogLine) => boolean,
    timeoutMs: number,
    what: string,
  ): Promise<LogLine> => {
    const until = Date.now() + timeoutMs
    for (;;) {
      const found = lines.find(isWanted)
      if (found) return found
      if (child.exitCode !== null || child.signalCode !== null || Date.now() > until) {
        throw new Error(
          `no log line ${what} within ${timeoutMs} ms; stderr: ${stderr.slice(0, 500)}; last lines: ${JSON.stringify(lines.slice(-3)).slice(0, 1500)}`,
        )
      }
      await new Promise<void>((resolve) => {
        waiters.push(resolve)
        setTimeout(resolve, 200)
      })
    }
  }
  return {
    child,
    lines,
    stderr: () => stderr,
    waitFor,
    metricsUrl: async () =>
      String((await waitFor((l) => typeof l.metrics === 'string', 30_000, 'with metrics')).metrics),
    exited,
  }
}

/** The value of metric `name` with exactly these `labels` (a subset match on the label set)
 *  in Prometheus text, or null when no such sample exists. */
export function metricValue(
  text: string,
  name: string,
  labels: Record<string, string> = {},
): number | null {
  for (const line of text.split('\n')) {
    const m = /^([\w:]+)(?:\{([^}]*)\})?\s+(\S+)$/.exec(line)
    if (!m || m[1] !== name) continue
    const got = new Map([...(m[2] ?? '').matchAll(/(\w+)="([^"]*)"/g)].map((x) => [x[1], x[2]]))
    if (Object.entries(labels).every(([k, v]) => got.get(k) === v)) return Number(m[3])
  }
  return null
}

/** `GET url` as text. */
export async function scrape(url: string): Promise<string> {
  const res = await fetch(url)
  if (res.status !== 200) throw new Error(`GET ${url}: HTTP ${res.status}`)
  return res.text()
}

/** A webhook receiver on 127.0.0.1: every POST body, parsed, in arrival order. */
export async function startReceiver(): Promise<{
  readonly url: string
  readonly bodies: unknown[]
  close(): Promise<void>
}> {
  const bodies: unknown[] = []
  const server = createServer((req, res) => {
    let body = ''
    req.setEncoding('utf8').on('data', (c: string) => (body += c))
    req.on('end', () => {
      bodies.push(JSON.parse(body))
      res.writeHead(200, { 'content-type': 'application/json' }).end('{"ok":true}')
    })
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as AddressInfo
  return {
    url: `http://127.0.0.1:${port}/hook`,
    bodies,
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections()
        server.close(() => resolve())
      }),
  }
}
