/** A tenants file's errors never quote its content (it holds key digests, and by mistake perhaps a
 *  plain key; the errors go to logs): a reload of a broken file logs the position and kind of
 *  fault, never the digest. And a tenants file is read only if it is a regular file of at most
 *  16 MiB: a directory, `/dev/zero`, a FIFO or a huge file is one line, read no further. */
import assert from 'node:assert/strict'
import { execFileSync } from 'node:child_process'
import { mkdirSync, mkdtempSync, rmSync, truncateSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { loadClusterConfig } from '../../../src/config/cluster.js'
import { apiKeyDigest, loadTenants, watchTenants } from '../../../src/router/tenants/tenants.js'
import { captureLogs } from '../../helpers/logs.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-tenants-files-'))
const plainKey = 'sk-kvf-0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0'
const digest = apiKeyDigest(plainKey)

const good = `tenants:\n  - name: alpha\n    keySha256: ${digest}\n`
// What a user's trial logged the digest for: a key line indented by 3 spaces instead of 4.
const badIndent = `tenants:\n  - name: alpha\n   keySha256: ${digest}\n`
// A plain key pasted where the digest goes, on a line that breaks the YAML.
const badPlainKey = `tenants:\n  - name: alpha\n    keySha256: ${digest}\n    "${plainKey}\n`
// Valid YAML, but the plain key pasted as a field name.
const keyAsField = `tenants:\n  - name: alpha\n    keySha256: ${digest}\n    ${plainKey}: true\n`

after(() => rmSync(dir, { recursive: true, force: true }))

describe('tenants file errors quote no file content', () => {
  it('a failed reload logs position and kind of fault, never the digest or a pasted key', () => {
    const path = join(dir, 'tenants.yaml')
    writeFileSync(path, good)
    const { log, text } = captureLogs('info')
    const watcher = watchTenants(path, { log, intervalMs: 60_000 })
    try {
      const details: string[] = []
      for (const bad of [badIndent, badPlainKey, keyAsField]) {
        writeFileSync(path, bad)
        assert.equal(watcher.reload(), false)
        const last = JSON.parse(text().trim().split('\n').at(-1)!) as { detail: string }
        details.push(last.detail)
      }
      assert.deepEqual(details, [
        `tenants file ${path} is not valid YAML: line 3, column 1: Sequence item without - indicator`,
        `tenants file ${path} is not valid YAML: line 4, column 5: Implicit keys need to be on a single line`,
        `tenants file ${path}: tenants.0: Unrecognized key (not shown: it does not look like a field name)`,
      ])
      assert.ok(!text().includes(digest.slice(0, 16)), 'no digest in the log')
      assert.ok(!text().includes(plainKey.slice(0, 16)), 'no key in the log')
      assert.deepEqual(watcher.registry.authenticate(plainKey), {
        name: 'alpha',
        limits: {},
        prefixCachePartition: { reservedPages: 0, numDefaultTenants: 1 },
      })
    } finally {
      watcher.close()
    }
  })

  it('a cluster config reread for its tenants (serve --config) logs no digest either', () => {
    const path = join(dir, 'cluster.yaml')
    const head = 'backend: { kind: vllm, url: "http://127.0.0.1:9" }\n'
    writeFileSync(path, head + good)
    const { log, text } = captureLogs('info')
    const watcher = watchTenants(path, {
      log,
      intervalMs: 60_000,
      read: (file) => loadClusterConfig(file).tenants,
    })
    try {
      writeFileSync(path, head + badIndent)
      assert.equal(watcher.reload(), false)
      const last = JSON.parse(text().trim().split('\n').at(-1)!) as { detail: string }
      assert.equal(
        last.detail,
        `config file ${path} is not valid YAML: line 4, column 1: Sequence item without - indicator`,
      )
      assert.ok(!text().includes(digest.slice(0, 16)))
    } finally {
      watcher.close()
    }
  })

  it('a message the YAML library would quote content in is replaced by the kind of fault', () => {
    const laughsLines = ['a: &a [x, x, x, x, x, x, x, x, x]']
    for (const [name, prev] of ['ba', 'cb', 'dc', 'ed', 'fe', 'gf'])
      laughsLines.push(`${name}: &${name} [${Array(9).fill(`*${prev}`).join(', ')}]`)
    laughsLines.push(`tenants: [${Array(9).fill('*g').join(', ')}]\n`)
    const laughs = laughsLines.join('\n')
    // The library says "Invalid escape sequence \q…" and "Unresolved alias …: sk-…".
    const cases: [string, string][] = [
      [`tenants:\n  - name: "a\\q${plainKey}"\n`, 'line 2, column 13: a bad escape in a double-quoted string'],
      [`tenants: *${plainKey}\n`, 'an alias (*name) with no anchor (&name) before it'],
      // A "billion laughs" file, every alias anchored: once called an alias with no anchor.
      [laughs, 'too many alias expansions'],
    ] // prettier-ignore
    for (const [text, fault] of cases) {
      const path = join(dir, 'quoted.yaml')
      writeFileSync(path, text)
      assert.throws(() => loadTenants(path), {
        message: `tenants file ${path} is not valid YAML: ${fault}`,
      })
    }
  })

  it('prints no YAML warning (the library would print a code frame of the line on stderr)', async () => {
    const warnings: Error[] = []
    const onWarning = (w: Error) => warnings.push(w)
    process.on('warning', onWarning)
    try {
      // An unknown tag is a warning, not an error: the file loads.
      const path = join(dir, 'tagged.yaml')
      writeFileSync(path, `tenants: !${plainKey}\n  - name: alpha\n    keySha256: ${digest}\n`)
      assert.deepEqual(loadTenants(path).names, ['alpha'])
      // process.emitWarning emits on a later tick.
      await new Promise((resolve) => setImmediate(resolve))
      await new Promise((resolve) => setImmediate(resolve))
      assert.deepEqual(
        warnings.map((w) => w.message),
        [],
      )
    } finally {
      process.off('warning', onWarning)
    }
  })
})

describe('tenants file reads are bounded', () => {
  it('refuses a directory, a device, a FIFO and a file over 16 MiB, naming the file', () => {
    const folder = join(dir, 'a-folder')
    mkdirSync(folder, { recursive: true })
    const huge = join(dir, 'huge.yaml')
    writeFileSync(huge, '')
    truncateSync(huge, 16 * 1024 * 1024 + 1) // sparse: no 16 MiB written
    const cases: [string, string][] = [
      [folder, `tenants file ${folder} is a directory, not a file`],
      ['/dev/zero', 'tenants file /dev/zero is not a regular file'],
      [huge, `tenants file ${huge} is larger than 16 MiB`],
    ]
    let fifo: string | undefined = join(dir, 'fifo')
    try {
      execFileSync('mkfifo', [fifo])
      // Opened without blocking: no writer is ever attached, so a blocking open would hang here.
      cases.push([fifo, `tenants file ${fifo} is not a regular file`])
    } catch {
      fifo = undefined // no mkfifo here: the other cases still run
    }
    for (const [path, message] of cases) {
      assert.throws(() => loadTenants(path), { name: 'KvfenceError', message })
    }
  })
})
