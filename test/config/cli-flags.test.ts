/** Bad flag values are refused by the CLI before any part starts: one line naming the flag and
 *  the value, exit 2 (they used to surface from Node or pino after workers started, or not at
 *  all). Also what the CLI says at start that fresh-user trials misread: serve's queue flags,
 *  generate's blank completions, the gateway's failed /v1/models.
 *  Refusals and the in-process generate run the CLI in this process (test/helpers/cli.ts: the same
 *  parsing, actions and lines); a process is spawned where only one shows the behaviour: one
 *  refusal (exit status and stderr of `kvfence` itself), generate's whitespace completion on a real
 *  stdout, and serve's queue flags reaching the router it forks. */
import assert from 'node:assert/strict'
import { execFile, fork } from 'node:child_process'
import { once } from 'node:events'
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { createServer as createHttpServer } from 'node:http'
import { tmpdir } from 'node:os'
import { createServer } from 'node:net'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { stringify } from 'yaml'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { openaiClient, twoTenants } from '../helpers/cluster.js'
import { kvfence } from '../helpers/cli.js'
import { cliPath } from '../helpers/paths.js'

function run(args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) =>
    execFile(process.execPath, [cliPath, ...args], { timeout: 60_000 }, (err, stdout, stderr) =>
      resolve({ code: err ? ((err as { code?: number }).code ?? null) : 0, stdout, stderr }),
    ),
  )
}

const levels = 'Allowed choices are fatal, error, warn, info, debug, trace, silent.'
const cases: [string[], string][] = [
  [['serve', '--port', '70000'], `error: option '--port <port>' argument '70000' is invalid. expected a port from 0 to 65535, got "70000"`],
  [['decode', '--transfer-port', '99999'], `error: option '--transfer-port <port>' argument '99999' is invalid. expected a port from 0 to 65535, got "99999"`],
  [['prefill', '--port', '-1'], `error: option '--port <port>' argument '-1' is invalid. expected a port from 0 to 65535, got "-1"`],
  [['router', '--port', '65536'], `error: option '--port <port>' argument '65536' is invalid. expected a port from 0 to 65535, got "65536"`],
  [['serve', '--log-level', 'chatty'], `error: option '--log-level <level>' argument 'chatty' is invalid. ${levels}`],
  [['decode', '--log-level', 'chatty'], `error: option '--log-level <level>' argument 'chatty' is invalid. ${levels}`],
  [['serve', '--page-size', '0'], `error: option '--page-size <n>' argument '0' is invalid. expected a positive integer, got "0"`],
  [['serve', '--prefill-pages', '0'], `error: option '--prefill-pages <n>' argument '0' is invalid. expected a positive integer, got "0"`],
  [['serve', '--prefix-cache-pages', '-1'], `error: option '--prefix-cache-pages <n>' argument '-1' is invalid. expected a non-negative integer, got "-1"`],
  // Every numeric flag: one line naming the flag and the value (a fresh-user trial's
  // `serve --max-concurrent -1` got "unknown option", `keys add --max-concurrent -1` a line
  // without the flag, and digits past 2^53 or timers past 2^31 ms were taken as other numbers).
  [['serve', '--max-concurrent', '-1'], `error: option '--max-concurrent <n>' argument '-1' is invalid. expected a positive integer, got "-1"`],
  [['serve', '--max-queued', 'x'], `error: option '--max-queued <n>' argument 'x' is invalid. expected a non-negative integer, got "x"`],
  [['serve', '--page-size', '99999999999999999999'], `error: option '--page-size <n>' argument '99999999999999999999' is invalid. expected a positive integer, got "99999999999999999999"`],
  [['serve', '--drain-seconds', '2147484'], `error: option '--drain-seconds <n>' argument '2147484' is invalid. expected an integer from 0 to 2147483, got "2147484"`],
  [['serve', '--reserved-slots', '-1'], `error: option '--reserved-slots <n>' argument '-1' is invalid. expected a non-negative integer, got "-1"`],
  [['router', '--reserved-slots', '1.5'], `error: option '--reserved-slots <n>' argument '1.5' is invalid. expected a non-negative integer, got "1.5"`],
  [['router', '--max-concurrent', '0'], `error: option '--max-concurrent <n>' argument '0' is invalid. expected a positive integer, got "0"`],
  [['router', '--context-window', '0'], `error: option '--context-window <n>' argument '0' is invalid. expected a positive integer, got "0"`],
  [['router', '--sentinel-window-seconds', '86401'], `error: option '--sentinel-window-seconds <n>' argument '86401' is invalid. expected an integer from 1 to 86400, got "86401"`],
  [['prefill', '--pages', '0'], `error: option '--pages <n>' argument '0' is invalid. expected a positive integer, got "0"`],
  [['decode', '--page-size', '1e3'], `error: option '--page-size <n>' argument '1e3' is invalid. expected a positive integer, got "1e3"`],
  [['prefill', '--transfer-timeout-ms', '2147483648'], `error: option '--transfer-timeout-ms <ms>' argument '2147483648' is invalid. expected an integer from 1 to 2147483647, got "2147483648"`],
  [['prefill', '--prefix-cache-pages-per-tenant', '0'], `error: option '--prefix-cache-pages-per-tenant <n>' argument '0' is invalid. expected a positive integer, got "0"`],
  [['keys', 'add', 'carol', '--max-concurrent', '-1'], `error: option '--max-concurrent <n>' argument '-1' is invalid. expected a positive integer, got "-1"`],
  [['keys', 'add', 'carol', '--tokens-per-minute', '1.5'], `error: option '--tokens-per-minute <n>' argument '1.5' is invalid. expected a positive integer, got "1.5"`],
  [['keys', 'add', 'carol', '--weight', '0'], `error: option '--weight <w>' argument '0' is invalid. expected a number from 0.001 to 1000, got "0"`],
  [['keys', 'add', 'carol', '--weight', '1e-300'], `error: option '--weight <w>' argument '1e-300' is invalid. expected a number from 0.001 to 1000, got "1e-300"`],
  [['generate', '--prompt', 'hi', '--max-tokens', '99999999999999999999'], `error: option '--max-tokens <n>' argument '99999999999999999999' is invalid. expected a positive integer, got "99999999999999999999"`],
  [['generate', '--prompt', 'hi', '--top-k', '99999999999999999999'], `error: option '--top-k <k>' argument '99999999999999999999' is invalid. expected an integer ≥ -1 (-1 or 0: off), got "99999999999999999999"`],
  [['soak', '--tenants', '99999999999999999999'], `error: option '--tenants <k>' argument '99999999999999999999' is invalid. expected a non-negative integer, got "99999999999999999999"`],
  [['soak', '--watch-cycle-seconds', '2147484'], `error: option '--watch-cycle-seconds <s>' argument '2147484' is invalid. expected an integer from 0 to 2147483, got "2147484"`],
  [['demo', '--seed', '-1'], `error: option '--seed <n>' argument '-1' is invalid. expected a non-negative integer, got "-1"`],
  // A worker URL that is not one was refused as a host "dialed without TLS" (a fresh-user trial).
  [['router', '--prefill', 'notaurl', '--decode', 'http://127.0.0.1:2'], `error: option '--prefill <url>' argument 'notaurl' is invalid. expected an http:// or https:// URL, got "notaurl"`],
  [['router', '--prefill', 'http://127.0.0.1:1', '--decode', 'ftp://127.0.0.1:2'], `error: option '--decode <url>' argument 'ftp://127.0.0.1:2' is invalid. expected an http:// or https:// URL, got "ftp://127.0.0.1:2"`],
  [['router', '--prefill', 'http://127.0.0.1:1/some/path?x=1', '--decode', 'http://127.0.0.1:2'], `error: option '--prefill <url>' argument 'http://127.0.0.1:1/some/path?x=1' is invalid. expected a worker's base URL (scheme, host and port only), got "http://127.0.0.1:1/some/path?x=1"`],
  [['keys', 'add', 'carol', '--weight', '2e3'], `error: option '--weight <w>' argument '2e3' is invalid. expected a number from 0.001 to 1000, got "2e3"`],
  // The audit's numbers are checked before what else is missing (here: the tenants).
  [['audit', '--target', 'http://127.0.0.1:9', '--max-requests', '-1'], 'kvfence audit: --max-requests must be an integer from 1 to 1000000, got "-1"'],
  // Checked before any part starts: one line, and no part's log lines before it.
  [['serve', '--tenants', '/nonexistent-kvfence/tenants.yaml'], `kvfence: cannot read tenants file /nonexistent-kvfence/tenants.yaml: ENOENT: no such file or directory, open '/nonexistent-kvfence/tenants.yaml'`],
  // A policy for a store that is not configured would be silently ignored.
  [['router', '--prefill', 'http://127.0.0.1:1', '--decode', 'http://127.0.0.1:2', '--tenants', 't.yaml', '--salt-secret-file', 's'], "kvfence: --salt-secret-file applies to gateway mode (backend:) only: native prefill workers derive each tenant's cache salt themselves"],
  [['router', '--limits-on-unavailable', 'local'], 'kvfence: --limits-on-unavailable needs --limits-redis (it is the policy while Redis is unreachable)'],
  // serve --config once ignored the flags only serve --tenants uses, without a word (a fresh-user
  // trial's --context-window 100 served the file's window, --tenants the file's tenants). Refused
  // before the file is read, so it need not exist here.
  [['serve', '--config', 'c.yaml', '--tenants', 't.yaml'], "kvfence: --tenants is not used with --config (the file's tenants: list is served)"],
  [['serve', '--config', 'c.yaml', '--context-window', '100'], 'kvfence: --context-window is not used with --config (set router.contextWindow)'],
  [['serve', '--config', 'c.yaml', '--clamp-context'], 'kvfence: --clamp-context is not used with --config (set router.clampContext)'],
  [['serve', '--config', 'c.yaml', '--model', 'models/x'], 'kvfence: --model is not used with --config (set model: in the file)'],
  [['serve', '--config', 'c.yaml', '--page-size', '8'], 'kvfence: --page-size is not used with --config (set workers.pageSize)'],
  [['serve', '--config', 'c.yaml', '--prefill-pages', '8'], 'kvfence: --prefill-pages is not used with --config (set pages in workers.prefill)'],
  [['serve', '--config', 'c.yaml', '--decode-pages', '8'], 'kvfence: --decode-pages is not used with --config (set pages in workers.decode)'],
  [['serve', '--config', 'c.yaml', '--inject-fault', 'placeholder-forward'], 'kvfence: --inject-fault is not used with --config (faults are injected only without --config)'],
  [['serve', '--config', 'c.yaml', '--unsafe-disable-guards'], 'kvfence: --unsafe-disable-guards is not used with --config (guards are off only without --config)'],
  [['serve', '--config', 'c.yaml', '--threads', '1'], 'kvfence: --threads is not used with --config (workers started from a file use the default)'],
  [['serve', '--config', 'c.yaml', '--prefix-cache-pages', '4'], 'kvfence: --prefix-cache-pages is not used with --config (set prefixCachePages in workers.prefill)'],
] // prettier-ignore

describe('CLI flag ranges', () => {
  for (const [args, message] of cases) {
    it(`kvfence ${args.join(' ')}`, async () => {
      const res = await kvfence(...args)
      assert.equal(res.code, 2)
      assert.equal(res.stderr.trim(), message)
      assert.equal(res.stdout, '')
    })
  }

  it('as a process: the refusal is its stderr line and exit status 2', async () => {
    const [args, message] = cases[0]
    const res = await run(args)
    assert.equal(res.code, 2)
    assert.equal(res.stderr.trim(), message)
    assert.equal(res.stdout, '')
  })
})

describe('serve checks the model folder and its port before any part starts', () => {
  const { dir, tenantsFile } = twoTenants('kvfence-cli-flags-')
  after(() => rmSync(dir, { recursive: true, force: true }))

  it('a model folder without config.json: one line, exit 2 (was the worker line plus "exited")', async () => {
    const empty = join(dir, 'empty-model')
    mkdirSync(empty)
    const res = await kvfence('serve', '--tenants', tenantsFile, '--model', empty)
    assert.equal(res.code, 2)
    assert.equal(res.stderr.trim(), `kvfence: no config.json in model directory ${empty}`)
  })

  it('--prefix-cache-pages over --prefill-pages: one line, exit 2', async () => {
    const res = await kvfence('serve', '--tenants', tenantsFile, '--prefix-cache-pages', '65')
    assert.equal(res.code, 2)
    assert.equal(res.stderr.trim(), 'kvfence: --prefix-cache-pages 65 exceeds --prefill-pages 64')
  })

  it('a port in use: one line naming it, exit 2, before any worker logs', async () => {
    const taken = createServer()
    await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve))
    const { port } = taken.address() as { port: number }
    try {
      const res = await kvfence('serve', '--tenants', tenantsFile, '--port', String(port))
      assert.equal(res.code, 2)
      assert.equal(
        res.stderr.trim(),
        `kvfence: 127.0.0.1:${port} is already in use: give another --port`,
      )
    } finally {
      taken.close()
    }
  })
})

describe('serve --max-concurrent, --max-queued and --reserved-slots reach its router', () => {
  const { dir, tenants, tenantsFile } = twoTenants('kvfence-cli-queue-')
  after(() => rmSync(dir, { recursive: true, force: true }))

  /** Runs `kvfence serve` on the two tenants with `queueFlags`, and `body` against its URL. */
  async function withServe(queueFlags: string[], body: (url: string) => Promise<void>) {
    const child = fork(cliPath, ['serve', '--tenants', tenantsFile, '--port', '0', ...queueFlags], {
      stdio: ['ignore', 'ignore', 'pipe', 'ipc'],
    })
    let stderr = ''
    child.stderr!.on('data', (chunk: Buffer) => (stderr += chunk.toString('utf8')))
    try {
      const port = await new Promise<number>((resolve, reject) => {
        child.once('exit', (code) => reject(new Error(`serve exited with ${code}: ${stderr}`)))
        child.on('message', (m: { type: string; port: number }) => {
          if (m.type === 'ready') resolve(m.port)
        })
      })
      await body(`http://127.0.0.1:${port}`)
    } finally {
      const exited = once(child, 'exit')
      child.kill('SIGTERM')
      await exited
    }
  }

  /** Starts a stream of ~900 tokens of the echo model as `client`: it holds a slot until read
   *  to its end (the iterator returned). */
  async function holdSlot(client: ReturnType<typeof openaiClient>) {
    const stream = await client.completions.create({
      model: 'echo-tiny',
      prompt: 'hold the slot',
      max_tokens: 900,
      stream: true,
    })
    const chunks = stream[Symbol.asyncIterator]()
    await chunks.next()
    return chunks
  }

  const small = { model: 'echo-tiny', prompt: 'hi', max_tokens: 1 }

  // One cluster for both: 3 slots, 2 reserved, none queued. With any of the three flags lost on
  // the way (the defaults queue, allow more and reserve 1), a case below answers otherwise.
  const flags = ['--max-concurrent', '3', '--max-queued', '0', '--reserved-slots', '2']

  it('none queued: a second request from a tenant while its first streams gets 503; it runs once the first ended', async () => {
    await withServe(flags, async (url) => {
      const first = openaiClient(url, tenants[0].key)
      const chunks = await holdSlot(first)
      await assert.rejects(first.completions.create(small), {
        status: 503,
        message: '503 The server is busy: 1 requests running and 0 queued; retry later.',
      })
      // 3 slots, 2 reserved, tenant-a holding the one open to all: another tenant runs (the
      // default reserves 1, which would have run tenant-a's second request above).
      const other = await openaiClient(url, tenants[1].key).completions.create(small)
      assert.equal(other.choices.length, 1)
      while (!(await chunks.next()).done);
      // The slot is free again once the first has ended.
      const answer = await first.completions.create(small)
      assert.equal(answer.choices.length, 1)
    })
  })
})

describe('generate says on stderr when its completion prints as nothing', () => {
  it('the echo model answers "hello there" with newlines: stdout has them, stderr says so in one line', async () => {
    const res = await run(['generate', '--prompt', 'hello there', '--max-tokens', '5'])
    assert.equal(res.code, 0, res.stderr)
    assert.equal(res.stdout, '\n'.repeat(5) + '\n')
    assert.equal(
      res.stderr,
      'kvfence generate: the completion is whitespace only (5 tokens, 5 × "\\n"): the bundled echo model copies from its prompt (try --prompt "the code is 8Vc1XzQ7. Repeat: the code is") and gives newlines where it finds nothing to copy\n',
    )
  })

  it('a prompt it can copy from: the copy on stdout, nothing on stderr', async () => {
    const prompt = 'the code is 8Vc1XzQ7. Repeat: the code is'
    const res = await kvfence('generate', '--prompt', prompt, '--max-tokens', '10')
    assert.equal(res.code, 0, res.stderr)
    assert.equal(res.stdout, ' 8Vc1XzQ7.\n')
    assert.equal(res.stderr, '')
  })
})

describe('the gateway says how /v1/models answered when it found no model there', () => {
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-cli-gateway-'))
  after(() => rmSync(dir, { recursive: true, force: true }))

  const cases: [number, string, string, string?][] = [
    [404, '{"detail":"Not Found"}', 'GET /v1/models answered HTTP 404: is backend.url the engine’s base URL (http://host:port, without /v1)?'],
    [401, '{"error":"unauthorized"}', 'GET /v1/models answered HTTP 401: the engine wants an API key: set backend.apiKeyEnv to the variable holding it (or check that key)'],
    [200, '{"object":"list","data":[]}', 'no model listed at /v1/models (its data list is empty or not a list)'],
    // With backend.model set the list is not needed, but a refused key still is the cause (it said
    // "cannot read its KV capacity").
    [401, '{"error":"unauthorized"}', 'GET /v1/models answered HTTP 401: the engine wants an API key: set backend.apiKeyEnv to the variable holding it (or check that key)', 'm'],
  ] // prettier-ignore
  for (const [status, body, reason, model] of cases) {
    it(`an engine answering ${status} ${body}${model === undefined ? '' : ', backend.model set'}`, async () => {
      const engine = createHttpServer((_req, res) => {
        res.writeHead(status, { 'content-type': 'application/json' })
        res.end(body)
      })
      await new Promise<void>((resolve) => engine.listen(0, '127.0.0.1', resolve))
      const base = `http://127.0.0.1:${(engine.address() as { port: number }).port}`
      const file = join(dir, `gateway-${status}${model ?? ''}.yaml`)
      writeFileSync(
        file,
        stringify({
          backend: { kind: 'vllm', url: base, ...(model === undefined ? {} : { model }) },
          tenants: [{ name: 'alice', keySha256: apiKeyDigest('k') }],
        }),
      )
      try {
        const res = await kvfence('router', '--config', file, '--port', '0')
        assert.equal(res.code, 2, res.stderr)
        assert.equal(res.stderr, `kvfence: vllm backend ${base}: ${reason}\n`)
      } finally {
        engine.close()
      }
    })
  }
})

describe('a salt secret file for native workers is refused, not ignored', () => {
  const dir = mkdtempSync(join(tmpdir(), 'kvfence-cli-salt-'))
  after(() => rmSync(dir, { recursive: true, force: true }))
  // The router's salts go to gateway engines only; a native prefill worker salts its own cache.
  const file = join(dir, 'native.yaml')
  writeFileSync(
    file,
    stringify({
      router: { saltSecretFile: 'missing.secret' },
      workers: {
        prefill: [{ url: 'http://127.0.0.1:1' }],
        decode: [{ url: 'http://127.0.0.1:2' }],
      },
      tenants: [{ name: 'alice', keySha256: apiKeyDigest('k') }],
    }),
  )
  for (const command of ['serve', 'router']) {
    it(`kvfence ${command} --config with router.saltSecretFile`, async () => {
      const res = await kvfence(command, '--config', file)
      assert.equal(res.code, 2, res.stderr)
      assert.equal(
        res.stderr,
        "kvfence: router.saltSecretFile applies to gateway mode (backend:) only: native prefill workers derive each tenant's cache salt themselves\n",
      )
    })
  }
})
