/** Tokenization off the event loop: while one tenant's long prompt is tokenized (in a process of
 *  the router's tokenizer pool), another tenant's small request is admitted, generated and
 *  answered; queued prompts are taken tenant by tenant. Ordering only, no timing: without the
 *  pool the long prompt held the event loop, so the small request was answered after it. */
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { readFileSync, rmSync } from 'node:fs'
import { getPriority } from 'node:os'
import { test } from 'node:test'
import { childPids } from '../../../src/cli/stop-children.js'
import type { KvfenceError } from '../../../src/common/errors.js'
import { loadTokenizer } from '../../../src/model/tokenizer.js'
import { requestParsers } from '../../../src/router/api/schemas.js'
import {
  createTokenizerPool,
  tokenizerNiceness,
} from '../../../src/router/tokenize/tokenizer-pool.js'
import { pollUntil } from '../../helpers/poll.js'
import { forkTokenizer } from '../../../src/router/tokenize/tokenizer-fork.js'
import {
  charIds,
  keys,
  startHarness,
  tokenizerWithLongToken,
  writeTestTokenizer,
} from '../helpers.js'
import { isRunning } from '../../helpers/processes.js'

test("a tenant's small request is answered while another tenant's long prompt is still being tokenized", async () => {
  // A process, as the router runs it: the point is that the long prompt is tokenized off the
  // router's event loop.
  const h = await startHarness(
    {},
    { modelDir: tokenizerWithLongToken(), startTokenizer: forkTokenizer },
  )
  try {
    const order: string[] = []
    // 900,000 characters: over the window (a 400 once counted), under the length bound.
    const long = h
      .post('/v1/completions', { model: 'echo-test', prompt: 'ab '.repeat(300_000) })
      .then(async (res) => {
        order.push(`long ${res.status}`)
        return (await res.json()) as { error: { code: string } }
      })
    await new Promise((resolve) => setTimeout(resolve, 50)) // the long body is on its way
    const small = await h
      .client(keys.beta)
      .completions.create({ model: 'echo-test', prompt: 'Hi', max_tokens: 3 })
    order.push('small 200')
    assert.equal(small.choices.length, 1)
    assert.equal((await long).error.code, 'context_length_exceeded')
    assert.deepEqual(order, ['small 200', 'long 400'])
  } finally {
    await h.close()
  }
})

test("the pool's processes take queued prompts tenant by tenant, first come first served within each", async () => {
  const modelDir = writeTestTokenizer()
  const pool = createTokenizerPool({
    modelDir,
    startTokenizer: forkTokenizer,
    tokenizer: loadTokenizer(modelDir),
    numProcesses: 1,
    inlineMaxChars: 0, // every prompt goes to the process
    startNow: false,
  })
  try {
    const order: string[] = []
    const signal = new AbortController().signal
    const ask = (tenant: string, name: string) => {
      const parsed = requestParsers.completion({ model: 'echo-test', prompt: name.repeat(300) })
      return pool.tokenize(parsed, tenant, signal).then(({ numTokens, ids }) => {
        assert.equal(numTokens, 1 + 300 * name.length) // BOS and one id per character
        assert.deepEqual([...ids!], [1, ...charIds(name.repeat(300))])
        order.push(name)
      })
    }
    // alpha's six prompts are queued before beta's two, all before the one process has started
    // (it starts for the first prompt, and says it is ready on a later turn).
    const all = ['a1', 'a2', 'a3', 'a4', 'a5', 'a6'].map((name) => ask('alpha', name))
    all.push(ask('beta', 'b1'), ask('beta', 'b2'))
    await Promise.all(all)
    // The tenants in turn, alpha first (it queued first): a1, b1, a2, b2, and alpha's rest.
    // First come first served was a1…a6 b1 b2.
    assert.deepEqual(order, ['a1', 'b1', 'a2', 'b2', 'a3', 'a4', 'a5', 'a6'])
  } finally {
    await pool.close()
    rmSync(modelDir, { recursive: true, force: true })
  }
})

/** The pool's tokenizer processes among `parent`'s children now (from /proc). */
function tokenizerPids(parent = process.pid): number[] {
  return childPids(parent).filter((pid) => {
    try {
      return readFileSync(`/proc/${pid}/cmdline`, 'utf8').includes('tokenizer-process.js')
    } catch {
      return false // it exited while being read
    }
  })
}

/** The one tokenizer process of this process's pool. */
function theTokenizerPid(): number {
  const pids = tokenizerPids()
  assert.equal(pids.length, 1, `one tokenizer process: ${pids.join(', ')}`)
  return pids[0]
}

/** A pool of one process that takes every prompt, over the test tokenizer. */
function poolOfOne(answerTimeoutMs?: number) {
  const modelDir = writeTestTokenizer()
  const pool = createTokenizerPool({
    modelDir,
    startTokenizer: forkTokenizer,
    tokenizer: loadTokenizer(modelDir),
    numProcesses: 1,
    inlineMaxChars: 0,
    startNow: false,
    answerTimeoutMs,
  })
  return {
    pool,
    async close() {
      await pool.close()
      rmSync(modelDir, { recursive: true, force: true })
    },
  }
}

const noSignal = new AbortController().signal
const completionOf = (prompt: string) => requestParsers.completion({ model: 'echo-test', prompt })

test('a pool starts its processes at once by default, so that the first long prompt need not wait for one to load', async () => {
  const modelDir = writeTestTokenizer()
  const pool = createTokenizerPool({
    modelDir,
    startTokenizer: forkTokenizer,
    tokenizer: loadTokenizer(modelDir),
    numProcesses: 2,
  })
  try {
    const areUp = await pollUntil(() => tokenizerPids().length === 2, {
      timeoutMs: 15_000,
      intervalMs: 20,
    })
    assert.ok(areUp, `tokenizer processes before any prompt: ${tokenizerPids().join(', ')}`)
  } finally {
    await pool.close()
    rmSync(modelDir, { recursive: true, force: true })
  }
})

test('a prompt of keepBelow tokens or more comes back counted, without its ids; one shorter with them', async () => {
  const { pool, close } = poolOfOne()
  try {
    // BOS and one id per character: 1 + 600 tokens.
    const text = 'xy'.repeat(300)
    const atLimit = await pool.tokenize(completionOf(text), 'alpha', noSignal, { keepBelow: 601 })
    assert.deepEqual(atLimit, { numTokens: 601, ids: null })
    const below = await pool.tokenize(completionOf(text), 'alpha', noSignal, { keepBelow: 602 })
    assert.equal(below.numTokens, 601)
    assert.deepEqual([...below.ids!], [1, ...charIds(text)])
  } finally {
    await close()
  }
})

test('a tokenizer process runs below the router (niceness 10) and collects garbage on its own thread', async () => {
  assert.ok(getPriority() <= tokenizerNiceness, 'the test runs at niceness 10 or less')
  const { pool, close } = poolOfOne()
  try {
    await pool.tokenize(completionOf('Hi there'), 'alpha', noSignal)
    const pid = theTokenizerPid()
    assert.equal(getPriority(pid), tokenizerNiceness)
    const args = readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0')
    assert.ok(args.includes('--single-threaded-gc'), args.join(' '))
  } finally {
    await close()
  }
})

test('a tokenizer process killed mid-prompt fails that prompt with internal_error, and the next prompt starts another', async () => {
  const { pool, close } = poolOfOne()
  try {
    await pool.tokenize(completionOf('warm'), 'alpha', noSignal) // the process is up
    const pid = theTokenizerPid()
    // Long enough to still be tokenizing when the kill lands (the test tokenizer: ~1 µs a char).
    const long = pool.tokenize(completionOf('ab '.repeat(300_000)), 'alpha', noSignal)
    process.kill(pid, 'SIGKILL')
    await assert.rejects(long, (err: KvfenceError) => {
      assert.equal(err.code, 'internal_error')
      assert.equal(err.message, 'the tokenizer process exited (SIGKILL)')
      return true
    })
    const next = await pool.tokenize(completionOf('again'), 'alpha', noSignal)
    assert.deepEqual([...next.ids!], [1, ...charIds('again')])
    assert.notEqual(theTokenizerPid(), pid, 'a new process')
  } finally {
    await close()
  }
})

test('a tokenizer process that stops answering (SIGSTOP) is killed at answerTimeoutMs: its prompt fails with internal_error, the one queued behind it goes to a new process', async () => {
  // Found by a trial: a stopped process held its prompt, and every one queued behind it, for ever.
  const { pool, close } = poolOfOne(1000)
  try {
    await pool.tokenize(completionOf('warm'), 'alpha', noSignal)
    const pid = theTokenizerPid()
    process.kill(pid, 'SIGSTOP')
    const held = pool.tokenize(completionOf('held'), 'alpha', noSignal)
    const queued = pool.tokenize(completionOf('queued'), 'beta', noSignal)
    await assert.rejects(held, {
      code: 'internal_error',
      message: 'the tokenizer process did not answer within 1000 ms and was killed',
    })
    // Taken by the process started in its place.
    assert.deepEqual([...(await queued).ids!], [1, ...charIds('queued')])
    assert.equal(isRunning(pid), false)
    assert.notEqual(theTokenizerPid(), pid, 'a new process')
  } finally {
    await close()
  }
})

test('a tokenizer process outlives SIGINT and SIGTERM sent to its process group (Ctrl-C, systemd): the prompt it holds is answered', async () => {
  // Found by a trial: Ctrl-C on serve reached the tokenizer process too; it died, and the prompt
  // it held got a 500 while the router drained.
  const { pool, close } = poolOfOne()
  try {
    await pool.tokenize(completionOf('warm'), 'alpha', noSignal)
    const pid = theTokenizerPid()
    const long = pool.tokenize(completionOf('ab '.repeat(300_000)), 'alpha', noSignal)
    process.kill(pid, 'SIGINT')
    process.kill(pid, 'SIGTERM')
    assert.equal((await long).numTokens, 1 + 900_000)
    assert.deepEqual(
      [...(await pool.tokenize(completionOf('next'), 'alpha', noSignal)).ids!],
      [1, ...charIds('next')],
    )
    assert.equal(theTokenizerPid(), pid, 'the same process')
  } finally {
    await close()
  }
})

test('closing the pool fails the prompt being tokenized and resolves once its process has exited', async () => {
  const { pool, close } = poolOfOne()
  try {
    await pool.tokenize(completionOf('warm'), 'alpha', noSignal)
    const pid = theTokenizerPid()
    const long = pool.tokenize(completionOf('ab '.repeat(300_000)), 'alpha', noSignal)
    const queued = pool.tokenize(completionOf('queued'), 'beta', noSignal)
    const refusals = [long, queued].map((prompt) =>
      assert.rejects(prompt, { code: 'internal_error', message: 'router stopped' }),
    )
    await pool.close()
    await Promise.all(refusals)
    assert.equal(isRunning(pid), false, 'close resolves once the process has exited')
  } finally {
    await close()
  }
})

test("closing the pool ends even a stopped tokenizer process (SIGSTOP): the router's stop never waits on one", async () => {
  const { pool, close } = poolOfOne()
  try {
    await pool.tokenize(completionOf('warm'), 'alpha', noSignal)
    const pid = theTokenizerPid()
    process.kill(pid, 'SIGSTOP')
    // Before the fix close() sent SIGTERM, which a stopped process never acts on: it hung.
    const bound = new Promise<'hung'>((resolve) =>
      setTimeout(() => resolve('hung'), 15_000).unref(),
    )
    assert.equal(await Promise.race([pool.close().then(() => 'closed'), bound]), 'closed')
    assert.equal(isRunning(pid), false)
  } finally {
    await close()
  }
})

test('a prompt whose request ends (client gone, drain deadline) while in a process rejects at once with request_aborted', async () => {
  const { pool, close } = poolOfOne()
  try {
    await pool.tokenize(completionOf('warm'), 'alpha', noSignal)
    const abort = new AbortController()
    const long = pool.tokenize(completionOf('ab '.repeat(300_000)), 'alpha', abort.signal)
    await new Promise((resolve) => setTimeout(resolve, 50)) // on the process by now
    abort.abort()
    // Before the fix it waited for the process's answer and resolved with the ids.
    await assert.rejects(long, { code: 'request_aborted' })
    const next = await pool.tokenize(completionOf('next'), 'alpha', noSignal)
    assert.deepEqual([...next.ids!], [1, ...charIds('next')])
  } finally {
    await close()
  }
})

test('a router process killed with SIGKILL leaves no tokenizer process behind', async () => {
  // A parent that starts a pool, has it start its process, prints that process's pid and is
  // killed: the process sees its channel close and exits.
  const modelDir = writeTestTokenizer()
  const poolUrl = new URL('../../../src/router/tokenize/tokenizer-pool.js', import.meta.url).href
  const forkUrl = new URL('../../../src/router/tokenize/tokenizer-fork.js', import.meta.url).href
  const tokUrl = new URL('../../../src/model/tokenizer.js', import.meta.url).href
  const stopUrl = new URL('../../../src/cli/stop-children.js', import.meta.url).href
  const schemasUrl = new URL('../../../src/router/api/schemas.js', import.meta.url).href
  const parent = [
    `const { createTokenizerPool } = await import(${JSON.stringify(poolUrl)})`,
    `const { forkTokenizer } = await import(${JSON.stringify(forkUrl)})`,
    `const { loadTokenizer } = await import(${JSON.stringify(tokUrl)})`,
    `const { childPids } = await import(${JSON.stringify(stopUrl)})`,
    `const { requestParsers } = await import(${JSON.stringify(schemasUrl)})`,
    `const modelDir = ${JSON.stringify(modelDir)}`,
    'const pool = createTokenizerPool({ modelDir, startTokenizer: forkTokenizer, tokenizer: loadTokenizer(modelDir), numProcesses: 1, inlineMaxChars: 0 })',
    "const warm = requestParsers.completion({ model: 'echo-test', prompt: 'warm' })",
    "await pool.tokenize(warm, 'alpha', new AbortController().signal)",
    "process.stdout.write(childPids().join(' ') + '\\n')",
    "process.kill(process.pid, 'SIGKILL')",
  ].join('\n')
  try {
    const stdout = await new Promise<string>((resolve) => {
      const child = spawn(process.execPath, ['--input-type=module', '-e', parent], {
        stdio: ['ignore', 'pipe', 'inherit'],
      })
      let out = ''
      child.stdout.setEncoding('utf8').on('data', (s: string) => (out += s))
      child.once('close', () => resolve(out))
    })
    // One pid, and a real one: signalling 0 would reach the whole process group.
    assert.match(stdout, /^[1-9]\d*\n$/, 'one tokenizer process')
    const pid = Number(stdout)
    const isGone = await pollUntil(() => !isRunning(pid), { timeoutMs: 15_000, intervalMs: 50 })
    if (!isGone) process.kill(pid, 'SIGKILL')
    assert.ok(isGone, `tokenizer process ${pid} still running after its router was killed`)
  } finally {
    rmSync(modelDir, { recursive: true, force: true })
  }
})
