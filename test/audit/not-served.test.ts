/** An audit of a target that serves no completion ends early: once its first valid completions
 *  (gate.ts `notServedLimit`, 6) all got 404, 405, 501 or a refused connection, with nothing
 *  answered, it sends nothing more and ends with the usual exit-2 line. It used to run every
 *  probe first (188 POSTs against `python -m http.server`). A target that answers 503 while it
 *  warms up and serves after is never cut short. Real processes and sockets on loopback: the
 *  CLI against `python3 -m http.server`, and in-process audits against small servers. */
import assert from 'node:assert/strict'
import { execFile, spawn, spawnSync } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { createServer } from 'node:http'
import type { AddressInfo } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { describe, test } from 'node:test'
import { AuditError, runAudit } from '../../src/audit/index.js'
import { notServedLimit, servedSignOf } from '../../src/audit/gate.js'
import type { CompletionResult } from '../../src/audit/target.js'
import { cliPath } from '../helpers/paths.js'
import { standInTenants, startStandIn, tenantKeys } from './standins.js'
import { completionResult } from './completion-result.js'

const hasPython = spawnSync('python3', ['--version']).status === 0

/** Runs `kvfence audit` against `url` as alice and bob, seed 1. */
function audit(url: string): Promise<{ code: number | null; stdout: string; stderr: string }> {
  const args = ['audit', '--target', url, '--seed', '1']
  for (const [name, key] of Object.entries(tenantKeys)) args.push('--tenant', `${name}=${key}`)
  return new Promise((resolve) => {
    execFile(process.execPath, [cliPath, ...args], { timeout: 120_000 }, (err, stdout, stderr) => {
      const code = err && typeof err.code === 'number' ? err.code : err ? null : 0
      resolve({ code, stdout, stderr })
    })
  })
}

test('servedSignOf: 404, 405, 501 and a refused connection say "not served"; any other answer says "served"; a timeout or reset says neither', () => {
  const of = (status: number | null, failure: CompletionResult['failure'], detail?: string) =>
    servedSignOf(completionResult({ status, failure, failureDetail: detail ?? null }))
  assert.deepEqual(
    [404, 405, 501].map((s) => of(s, null)),
    ['not-served', 'not-served', 'not-served'],
  )
  // Warming up, overloaded, rate-limited, failing, refusing a body, answering: all served.
  assert.deepEqual(
    [503, 429, 500, 502, 400, 200].map((s) => of(s, null)),
    ['served', 'served', 'served', 'served', 'served', 'served'],
  )
  assert.equal(of(null, 'network', 'ECONNREFUSED'), 'not-served')
  assert.equal(of(null, 'network', 'ECONNRESET'), 'neither')
  assert.equal(of(null, 'timeout'), 'neither')
  assert.equal(of(null, 'aborted'), 'neither')
})

describe('a target that serves no completion: exit 2 after a few requests', () => {
  test(
    'kvfence audit against python3 -m http.server: exit 2, the one line, 6 POSTs',
    { skip: hasPython ? false : 'python3 is not installed' },
    async () => {
      // An empty directory served: nothing of the repository is listed.
      const dir = await mkdtemp(join(tmpdir(), 'kvfence-static-'))
      const server = spawn('python3', ['-u', '-m', 'http.server', '0', '--bind', '127.0.0.1'], {
        cwd: dir,
        stdio: ['ignore', 'pipe', 'pipe'],
      })
      let out = ''
      let log = ''
      server.stdout.on('data', (chunk: Buffer) => (out += chunk.toString()))
      server.stderr.on('data', (chunk: Buffer) => (log += chunk.toString()))
      const logClosed = new Promise((resolve) => server.stderr.on('close', resolve))
      try {
        const port = await new Promise<string>((resolve, reject) => {
          server.on('exit', (code) => reject(new Error(`python3 exited ${code}: ${log}`)))
          const poll = setInterval(() => {
            const m = /Serving HTTP on 127\.0\.0\.1 port (\d+)/.exec(out)
            if (m !== null) {
              clearInterval(poll)
              resolve(m[1])
            }
          }, 20)
        })
        const url = `http://127.0.0.1:${port}`
        const run = await audit(url)
        assert.equal(run.code, 2, run.stderr)
        assert.equal(
          run.stderr,
          `kvfence audit: the target answered none of the 6 valid completions sent to ${url}/v1/completions (HTTP 501 ×6); /health answered 404: ${url} does not serve POST /v1/completions: check that --target is an OpenAI-compatible endpoint, with its path prefix. Nothing was audited\n`,
        )
        server.kill()
        await logClosed
        // The server's own log: canary's six sequential completions, and no other POST.
        const posts = log.split('\n').filter((line) => /"POST /.test(line))
        assert.equal(posts.length, notServedLimit)
        assert.ok(posts.every((line) => line.includes('"POST /v1/completions HTTP/1.1" 501')))
      } finally {
        server.kill()
        await rm(dir, { recursive: true, force: true })
      }
    },
  )

  test('nothing listening once discovery is done (connections refused): the one line, 6 attempts', async () => {
    // Answers discovery and the key checks, each on a connection it closes, then stops listening.
    let numModelReads = 0
    const server = createServer((req, res) => {
      res.setHeader('connection', 'close')
      if (req.method === 'GET' && req.url === '/v1/models') {
        if (++numModelReads === 3) server.close() // discovery's read, then one per tenant
        res.writeHead(200, { 'content-type': 'application/json' })
        return res.end(JSON.stringify({ object: 'list', data: [{ id: 'tiny', object: 'model' }] }))
      }
      res.writeHead(404).end()
    })
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`
    const err = await runAudit({ target: url, tenants: standInTenants, seed: 1 }).then(
      () => assert.fail('the audit returned a report'),
      (e: unknown) => e,
    )
    assert.ok(err instanceof AuditError, String(err))
    assert.equal(err.code, 'no_completion_answered')
    assert.equal(
      err.message,
      `the target answered none of the 6 valid completions sent to ${url}/v1/completions (network ×6); /health answered network: no connection to ${url} could be made or kept: check that the endpoint is still running there. Nothing was audited`,
    )
    const report = err.report!
    assert.deepEqual(
      report.completions.map((c) => [c.probe, c.status, c.failure]),
      Array.from({ length: notServedLimit }, () => ['canary', null, 'network']),
    )
    // Discovery's reads (models, two server infos, metrics, and with no pool said llama.cpp's
    // /props and /slots and TGI's /info), two key checks, six completions and one /health.
    assert.equal(report.requestsSent, 7 + 2 + notServedLimit + 1)
    assert.deepEqual(report.pendingProbes, report.probes)
  })

  test('a wrong path prefix (every path 404): the one line after 6 completions', async () => {
    const standIn = await startStandIn('safe')
    try {
      const err = await runAudit({
        target: `${standIn.url}/api`,
        tenants: standInTenants,
        seed: 1,
      }).then(
        () => assert.fail('the audit returned a report'),
        (e: unknown) => e,
      )
      assert.ok(err instanceof AuditError, String(err))
      assert.equal(
        err.message,
        `the target answered none of the 6 valid completions sent to ${standIn.url}/api/v1/completions (HTTP 404 ×6): check --model and the target's path prefix (${standIn.url}/api/v1/completions was asked). Nothing was audited`,
      )
      const posts = standIn.stats.paths.filter((p) => p.startsWith('POST '))
      assert.deepEqual(posts, Array(notServedLimit).fill('POST /api/v1/completions'))
    } finally {
      await standIn.close()
    }
  })
})

test('a target that answers 503 to its first 10 completions while it warms up, then serves: not cut short', async () => {
  const standIn = await startStandIn('safe', { warmUp: { status: 503, numRefused: 10 } })
  try {
    const report = await runAudit({
      target: standIn.url,
      tenants: standInTenants,
      seed: 1,
      // Canary sends 8 valid completions here, all refused; determinism goes on past the 10th.
      probes: ['canary', 'determinism'],
    })
    assert.equal(report.state, 'finished')
    const fates = report.completions.map((c) => [c.status, c.fate])
    assert.deepEqual(fates.slice(0, 10), Array(10).fill([503, 'refused']))
    // Past the warm-up every completion was answered (or refused as over capacity: 400).
    assert.ok(fates.length > 10 + notServedLimit, `only ${fates.length} completions`)
    assert.ok(fates.slice(10).every(([status]) => status === 200 || status === 400))
    assert.ok(fates.slice(10).some(([status]) => status === 200))
  } finally {
    await standIn.close()
  }
})
