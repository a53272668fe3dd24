/** Installability: `npm pack` makes a tarball that installs into an empty folder and whose
 *  `npx kvfence audit` runs there: `--list-probes`, and a real audit of a stand-in that must find
 *  the leak and write an HTML report (Chart.js resolved from the installed package).
 *  The install uses npm's local cache (`--prefer-offline`); when a dependency is in neither the
 *  cache nor reachable, the test is skipped with npm's reason, never passed. Packs the compiled
 *  `dist/src` as it is (`--ignore-scripts`: building here would wipe dist/ under other tests). */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { after, before, test } from 'node:test'
import { startStandIn, tenantKeys, type StandIn } from './standins.js'

const repoRoot = fileURLToPath(new URL('../../../', import.meta.url))

interface Run {
  code: number
  stdout: string
  stderr: string
}

function run(command: string, args: string[], cwd: string, timeoutMs = 180_000): Promise<Run> {
  return new Promise((resolve) => {
    execFile(
      command,
      args,
      {
        cwd,
        timeout: timeoutMs,
        maxBuffer: 16 * 1024 * 1024,
        env: { ...process.env, npm_config_audit: 'false', npm_config_fund: 'false' },
      },
      (err, stdout, stderr) => {
        const code = err ? (typeof err.code === 'number' ? err.code : 1) : 0
        resolve({ code, stdout, stderr })
      },
    )
  })
}

let dir: string
let standIn: StandIn
before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'kvfence-pack-'))
  standIn = await startStandIn('leaky')
})
after(async () => {
  await standIn?.close()
  await rm(dir, { recursive: true, force: true })
})

test('the npm package installs into an empty folder and `npx kvfence audit` works there', async (t) => {
  const pack = await run(
    'npm',
    ['pack', '--ignore-scripts', '--json', '--pack-destination', dir],
    repoRoot,
  )
  assert.equal(pack.code, 0, pack.stderr)
  const [{ filename, files }] = JSON.parse(pack.stdout) as {
    filename: string
    files: { path: string }[]
  }[]
  const paths = files.map((f) => f.path)
  for (const needed of ['dist/src/cli/main.js', 'dist/src/audit/index.js', 'package.json'])
    assert.ok(paths.includes(needed), `${needed} is in the package`)
  assert.ok(!paths.some((p) => p.startsWith('dist/test/')), 'tests are not shipped')

  const app = join(dir, 'app')
  await run('mkdir', ['-p', app], dir)
  await run('npm', ['init', '-y'], app)
  const install = await run(
    'npm',
    ['install', '--prefer-offline', '--no-audit', '--no-fund', join(dir, filename)],
    app,
  )
  if (install.code !== 0) {
    const reason =
      install.stderr.split('\n').find((l) => /ERR|error/.test(l)) ?? 'npm install failed'
    t.skip(
      `the tarball's dependencies could not be installed from npm's cache or registry: ${reason}`,
    )
    return
  }

  const list = await run('npx', ['--no-install', 'kvfence', 'audit', '--list-probes'], app)
  assert.equal(list.code, 0, list.stderr)
  assert.match(list.stdout, /^canary\s/m)

  const html = join(dir, 'report.html')
  const audit = await run(
    'npx',
    [
      '--no-install',
      'kvfence',
      'audit',
      '--target',
      standIn.url,
      '--tenant',
      `alice=${tenantKeys.alice}`,
      '--tenant',
      `bob=${tenantKeys.bob}`,
      '--probes',
      'capacity,canary',
      '--seed',
      '3',
      '--html',
      html,
    ],
    app,
  )
  assert.equal(audit.code, 1, `a leak exits 1; stderr: ${audit.stderr}`)
  assert.match(audit.stdout, /LEAK/)
  assert.ok(
    (await readFile(html, 'utf8')).includes('Chart.js v4.'),
    'Chart.js came from the installed package',
  )
})
