/** `kvfence demo` writes the HTML report of both runs beside their JSON reports (with the bundled
 *  echo model, to keep it short): the incident run's tenant matrix counts the leaking answers its
 *  JSON report lists. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { test } from 'node:test'
import { promisify } from 'node:util'
import { cliPath, echoModelDir } from '../helpers/paths.js'

test('kvfence demo writes unsafe.html and safe.html; the incident matrix counts its leaks', async () => {
  const out = mkdtempSync(join(tmpdir(), 'kvfence-demo-html-'))
  try {
    const { stdout } = await promisify(execFile)(
      process.execPath,
      [cliPath, 'demo', '--out', out, '--model', echoModelDir],
      { timeout: 240_000, env: { ...process.env, KVFENCE_ALLOW_FAULTS: '' } },
    )
    assert.match(stdout, /^ {2}\S*unsafe\.html\n {2}\S*safe\.json\n {2}\S*safe\.html$/m)
    const unsafe = JSON.parse(readFileSync(join(out, 'unsafe.json'), 'utf8')) as {
      findings: { probe: string; verdict: string; evidence: Record<string, unknown> }[]
    }
    const leak = unsafe.findings.find((f) => f.probe === 'canary' && f.verdict === 'leak')
    assert.ok(leak, 'the incident run leaked')
    const { observerTenant, victimTenant, numLeakingRequests } = leak.evidence as {
      observerTenant: string
      victimTenant: string
      numLeakingRequests: number
    }
    for (const name of ['unsafe.html', 'safe.html']) {
      const html = readFileSync(join(out, name), 'utf8')
      assert.match(html, /^<!doctype html>/, name)
      assert.ok(html.includes('id="tenant-matrix"'), `${name} has the tenant matrix`)
      assert.ok(html.includes('<canvas id="timeline-chart"'), `${name} has the timeline`)
    }
    const cell = new RegExp(
      `data-observer="${observerTenant}" data-source="${victimTenant}">(\\d+)</td>`,
    ).exec(readFileSync(join(out, 'unsafe.html'), 'utf8'))
    assert.equal(Number(cell?.[1]), numLeakingRequests)
  } finally {
    rmSync(out, { recursive: true, force: true })
  }
})
