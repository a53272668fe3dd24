/** `kvfence serve --config FILE` with workers given as `{ pages: N }`: the real CLI, as a child
 *  process, starts one prefill and one decode worker itself, serves the official `openai` client
 *  exactly what the single-process engine answers, reports the configured pages × page size as
 *  its effective capacity, and on SIGTERM stops with every process it started gone. A bad file
 *  (unknown key, negative pages) or a window the configured pools cannot hold (G1, found only
 *  once the workers run) is one line on stderr and a non-zero exit, with no process left behind.
 *  Processes are found by a marker variable in their environment (which the workers inherit), so
 *  an orphan would be found too: Linux only (/proc). */
import assert from 'node:assert/strict'
import { type ChildProcess, fork } from 'node:child_process'
import { randomUUID } from 'node:crypto'
import { mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { stringify } from 'yaml'
import { newApiKey } from '../../src/router/tenants/tenant-keys.js'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { generateLocal } from '../../src/engine/local-engine.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { loadModel } from '../../src/model/weights.js'
import { cliEntry } from '../../src/common/paths.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'
import { openaiClient } from '../helpers/cluster.js'
import { echoModelDir } from '../helpers/paths.js'
import { isRunning } from '../helpers/processes.js'

const skip = process.platform === 'linux' ? false : 'finds processes through /proc (Linux only)'
const markerName = 'KVFENCE_TEST_PROCESS_MARK'
const dir = mkdtempSync(join(tmpdir(), 'kvfence-serve-workers-'))
const key = newApiKey()
const tenants = [{ name: 'alice', keySha256: apiKeyDigest(key) }]
// 48 prefill pages and 80 decode pages of 8 tokens: 384 and 640 tokens; the smaller one counts.
const pageSize = 8
const workers = { pageSize, prefill: [{ pages: 48 }], decode: [{ pages: 80 }] }

/** Writes `value` as YAML to `name` in the test folder. */
function writeConfig(name: string, value: unknown): string {
  const path = join(dir, name)
  writeFileSync(path, stringify(value))
  return path
}

/** Pids of the live processes whose environment holds `marker` (zombies have none). */
function markedPids(marker: string): number[] {
  const needle = `${markerName}=${marker}\0`
  const pids: number[] = []
  for (const name of readdirSync('/proc')) {
    if (!/^\d+$/.test(name)) continue
    try {
      if (readFileSync(`/proc/${name}/environ`, 'latin1').includes(needle)) pids.push(Number(name))
    } catch {
      // gone meanwhile, or not ours
    }
  }
  return pids
}

/** Forks `kvfence serve --config path` with a fresh marker; stderr is collected. */
function serve(path: string): { child: ChildProcess; marker: string; stderr: () => string } {
  const marker = randomUUID()
  const child = fork(cliEntry, ['serve', '--config', path], {
    env: { ...process.env, [markerName]: marker },
    stdio: ['ignore', 'ignore', 'pipe', 'ipc'],
  })
  let stderr = ''
  child.stderr!.setEncoding('utf8').on('data', (s: string) => (stderr += s))
  return { child, marker, stderr: () => stderr }
}

function exited(child: ChildProcess): Promise<number | null> {
  if (child.exitCode !== null) return Promise.resolve(child.exitCode)
  return new Promise((resolve) => child.once('exit', (code) => resolve(code)))
}

describe('kvfence serve --config with workers started from { pages }', () => {
  after(() => rmSync(dir, { recursive: true, force: true }))

  it(
    'starts both workers, serves a tenant, reports pages × page size, and stops every process on SIGTERM',
    { skip },
    async () => {
      const path = writeConfig('serve.yaml', {
        router: { port: 0, logLevel: 'warn' },
        workers,
        tenants,
      })
      const { child, marker, stderr } = serve(path)
      let workerPids: number[] = []
      try {
        const port = await new Promise<number>((resolve, reject) => {
          child.once('exit', (code) => reject(new Error(`serve exited with ${code}: ${stderr()}`)))
          child.on('message', (m: { type?: string; port?: number }) => {
            if (m.type === 'ready' && m.port !== undefined) resolve(m.port)
          })
        })
        const url = `http://127.0.0.1:${port}`
        workerPids = markedPids(marker).filter((pid) => pid !== child.pid)
        const roles = workerPids.map((pid) =>
          roleOf(readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0')),
        )
        assert.deepEqual(
          roles.sort(),
          ['decode', 'prefill', 'tokenizer'],
          "two workers and the router's tokenizer process, started by serve",
        )

        // The answer is exactly the single-process engine's (temperature 0).
        const prompt = 'the stone garden Qx7vR2 and the stone garden'
        const tokenizer = loadTokenizer(echoModelDir)
        const core = createWorkerCore({
          model: loadModel(echoModelDir),
          numPages: 64,
          pageSize: 16,
          faults: buildFaultConfig([], false, {}),
        })
        const local = generateLocal(core, tokenizer.encode(prompt), {
          maxTokens: 12,
          sampling: { temperature: 0, topP: 1, seed: null },
          stopTokenIds: tokenizer.eosTokenId === null ? [] : [tokenizer.eosTokenId],
        })
        const completion = await openaiClient(url, key).completions.create({
          model: 'echo-tiny',
          prompt,
          max_tokens: 12,
          temperature: 0,
        })
        assert.equal(completion.choices[0].text, tokenizer.decode(local.tokenIds))
        assert.equal(completion.choices[0].finish_reason, local.finishReason)
        assert.equal(completion.usage?.prompt_tokens, tokenizer.encode(prompt).length)

        const info = (await (await fetch(`${url}/server_info`)).json()) as {
          effectiveCapacityTokens: number
          contextWindow: number
          pageSize: number
          workers: { role: string; numPages: number; pageSize: number; capacityTokens: number }[]
        }
        assert.equal(info.effectiveCapacityTokens, 48 * pageSize)
        assert.equal(info.contextWindow, 48 * pageSize)
        assert.equal(info.pageSize, pageSize)
        assert.deepEqual(
          info.workers.map((w) => [w.role, w.numPages, w.pageSize, w.capacityTokens]),
          [
            ['prefill', 48, pageSize, 48 * pageSize],
            ['decode', 80, pageSize, 80 * pageSize],
          ],
        )

        // Key changes in the config file reach the running router: alice's key is revoked and
        // bob's admitted, without a restart (bounded polling, no timing assertion).
        const bobKey = newApiKey()
        writeConfig('serve.yaml', {
          router: { port: 0, logLevel: 'warn' },
          workers,
          tenants: [{ name: 'bob', keySha256: apiKeyDigest(bobKey) }],
        })
        const status = async (k: string) =>
          (await fetch(`${url}/v1/models`, { headers: { authorization: `Bearer ${k}` } })).status
        let statuses: number[] = []
        for (let i = 0; i < 100; i++) {
          statuses = [await status(key), await status(bobKey)]
          if (statuses[0] === 401 && statuses[1] === 200) break
          await new Promise((r) => setTimeout(r, 200))
        }
        assert.deepEqual(
          statuses,
          [401, 200],
          'alice revoked and bob admitted from the config file',
        )
      } finally {
        child.kill('SIGTERM')
      }
      assert.equal(await exited(child), 0, stderr())
      for (const pid of workerPids) assert.equal(isRunning(pid), false, `process ${pid} still runs`)
      assert.deepEqual(markedPids(marker), [], 'no process of this run is left')
    },
  )

  const badConfigs: [string, unknown, RegExp][] = [
    [
      'an unknown key',
      { router: { port: 0 }, workers: { ...workers, pagesize: 16 }, tenants },
      /^kvfence: .*unknown-key\.yaml: workers: Unrecognized key: "pagesize"\n$/,
    ],
    [
      'negative pages',
      { router: { port: 0 }, workers: { ...workers, decode: [{ pages: -4 }] }, tenants },
      /^kvfence: .*negative-pages\.yaml: workers\.decode\.0\.pages: Too small: expected number to be >=1\n$/,
    ],
    [
      // Valid YAML that G1 refuses once the started workers report their pools.
      'a window larger than the pools',
      { router: { port: 0, contextWindow: 512, logLevel: 'warn' }, workers, tenants },
      /^kvfence: G1: context window 512 exceeds the effective KV capacity 384 tokens \(limited by prefill worker .* \(48 pages × 8 tokens\)\); lower the context window to 384, or clamp it: --clamp-context \(router\.clampContext: true in a cluster file\)\n$/,
    ],
  ]
  for (const [what, value, pattern] of badConfigs) {
    it(`${what}: one line, non-zero exit, no process left behind`, { skip }, async () => {
      const name = `${what.split(' ').slice(-2).join('-')}.yaml`
      const { child, marker, stderr } = serve(writeConfig(name, value))
      const code = await exited(child)
      assert.equal(code, 2)
      assert.match(stderr(), pattern)
      assert.deepEqual(markedPids(marker), [], 'no process of this run is left')
    })
  }
})

/** The subcommand of a `node [node flags] …/main.js <role> …` command line (node flags such as the
 *  test runner's `--test-timeout` come before the script and vary), or `tokenizer` for a router's
 *  tokenizer process. */
function roleOf(argv: string[]): string {
  if (argv.some((a) => a.endsWith('tokenizer-process.js'))) return 'tokenizer'
  const script = argv.findIndex((a) => a.endsWith('main.js'))
  return script >= 0 ? (argv[script + 1] ?? '') : ''
}
