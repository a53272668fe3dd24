/** The cluster config file: parsed once with defaults; a bad file is one line naming the field
 *  (exit 2 from the CLI); `kvfence serve --config` serves what it describes. */
import assert from 'node:assert/strict'
import { execFile, fork } from 'node:child_process'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { promisify } from 'node:util'
import OpenAI from 'openai'
import { stringify } from 'yaml'
import { loadClusterConfig } from '../../src/config/cluster.js'
import { cliEntry } from '../../src/common/paths.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { keys, startStandIns, writeTestTokenizer } from '../router/helpers.js'

const dir = mkdtempSync(join(tmpdir(), 'kvfence-config-'))
const write = (name: string, value: unknown) => {
  const path = join(dir, name)
  writeFileSync(path, typeof value === 'string' ? value : stringify(value))
  return path
}
const tenants = [
  { name: 'alpha', keySha256: apiKeyDigest(keys.alpha), limits: { tokensPerMinute: 1000 } },
]
const run = promisify(execFile)

describe('cluster config', () => {
  after(() => rmSync(dir, { recursive: true, force: true }))

  it('fills defaults and resolves paths against the file', () => {
    const config = loadClusterConfig(
      write('ok.yaml', {
        model: 'model-dir',
        router: { port: 9000 },
        workers: { prefill: [{ pages: 32 }], decode: [{ url: 'http://10.0.0.7:8102' }] },
        tenants,
      }),
    )
    assert.equal(config.model, join(dir, 'model-dir'))
    assert.deepEqual(config.router, {
      host: '127.0.0.1',
      port: 9000,
      clampContext: false,
      maxBodyBytes: 1048576,
      maxConcurrentRequests: 64,
      maxQueuedRequests: 256,
      reservedSlots: 1,
      maxQueueWaitMs: 30000,
      logContent: false,
      logLevel: 'info',
    })
    assert.deepEqual(config.workers, {
      pageSize: 16,
      prefill: [{ pages: 32 }],
      decode: [{ url: 'http://10.0.0.7:8102' }],
    })
    assert.deepEqual(config.tenants[0].limits, { tokensPerMinute: 1000 })
    assert.ok(Object.isFrozen(config.router))
  })

  it('a bad file is one line naming the file and the field', () => {
    const cases: [unknown, RegExp][] = [
      [
        {
          router: { port: 70000 },
          workers: { prefill: [{ pages: 1 }], decode: [{ pages: 1 }] },
          tenants,
        },
        /bad\.yaml: router\.port: /,
      ],
      [
        { workers: { prefill: [{ pages: 0 }], decode: [{ pages: 1 }] }, tenants },
        /bad\.yaml: workers\.prefill\.0\.pages: Too small/,
      ],
      [
        {
          workers: { prefill: [{ pages: 1 }], decode: [{ pages: 1 }] },
          tenants: [{ name: 'a', keySha256: 'x' }],
        },
        /bad\.yaml: tenants\.0\.keySha256: keySha256 must be/,
      ],
      [
        { workers: { prefill: [{ pages: 1 }], decode: [{ pages: 1 }] }, tenants, extra: 1 },
        /bad\.yaml: Unrecognized key: "extra"/,
      ],
      [{ tenants }, /bad\.yaml: workers: give either workers .* or backend/],
      // Past what a Node.js timer holds (2^31 − 1 ms) a wait fired after 1 ms: drained at once.
      [
        {
          router: { drainSeconds: 2_147_484 },
          workers: { prefill: [{ pages: 1 }], decode: [{ pages: 1 }] },
          tenants,
        },
        /bad\.yaml: router\.drainSeconds: Too big: expected number to be <=2147483/,
      ],
      [
        {
          router: { maxQueueWaitMs: 2 ** 31 },
          workers: { prefill: [{ pages: 1 }], decode: [{ pages: 1 }] },
          tenants,
        },
        /bad\.yaml: router\.maxQueueWaitMs: Too big: expected number to be <=2147483647/,
      ],
      [
        {
          router: { reservedSlots: -1 },
          workers: { prefill: [{ pages: 1 }], decode: [{ pages: 1 }] },
          tenants,
        },
        /bad\.yaml: router\.reservedSlots: Too small: expected number to be >=0/,
      ],
      [
        {
          router: { reservedSlots: 1.5 },
          workers: { prefill: [{ pages: 1 }], decode: [{ pages: 1 }] },
          tenants,
        },
        /bad\.yaml: router\.reservedSlots: Invalid input: expected int, received number/,
      ],
      ['router: [', /bad\.yaml is not valid YAML/],
    ]
    for (const [value, pattern] of cases) {
      const path = write('bad.yaml', value)
      assert.throws(
        () => loadClusterConfig(path),
        (err: Error) => {
          assert.match(err.message, pattern)
          assert.ok(!err.message.includes('\n'), `one line: ${err.message}`)
          return true
        },
      )
    }
  })

  it('kvfence serve --config with a bad file exits 2 with one line', async () => {
    const path = write('bad-cli.yaml', { router: { port: 'eighty' }, tenants })
    await assert.rejects(
      run(process.execPath, [cliEntry, 'serve', '--config', path]),
      (err: { code: number; stderr: string }) => {
        assert.equal(err.code, 2)
        assert.match(err.stderr, /^kvfence: .*bad-cli\.yaml: router\.port: .*\n$/)
        return true
      },
    )
  })

  it('kvfence serve --config serves the workers and tenants of the file', async () => {
    const workers = await startStandIns()
    const tokenizerDir = writeTestTokenizer()
    const path = write('serve.yaml', {
      model: tokenizerDir,
      router: { port: 0, maxConcurrentRequests: 4 },
      workers: { prefill: [{ url: workers.prefillUrl }], decode: [{ url: workers.decodeUrl }] },
      tenants,
    })
    const child = fork(cliEntry, ['serve', '--config', path, '--log-level', 'warn'], {
      stdio: ['ignore', 'ignore', 'ignore', 'ipc'],
    })
    try {
      const port = await new Promise<number>((resolve, reject) => {
        child.once('exit', (code) => reject(new Error(`serve exited with ${code}`)))
        child.on(
          'message',
          (m: { type: string; port: number }) => m.type === 'ready' && resolve(m.port),
        )
      })
      const client = new OpenAI({
        baseURL: `http://127.0.0.1:${port}/v1`,
        apiKey: keys.alpha,
        maxRetries: 0,
      })
      const completion = await client.completions.create({
        model: 'echo-test',
        prompt: 'Hi',
        max_tokens: 20,
      })
      assert.equal(completion.choices[0].text, 'Hello, tenant!')
      await assert.rejects(
        client.completions.create({ model: 'echo-test', prompt: 'Hi', max_tokens: 990 }),
        (err: unknown) =>
          err instanceof OpenAI.RateLimitError && err.headers?.get('retry-after') !== null,
      )
    } finally {
      child.kill('SIGTERM')
      await new Promise((r) => child.once('exit', r))
      await workers.close()
      rmSync(tokenizerDir, { recursive: true, force: true })
    }
  })
})
