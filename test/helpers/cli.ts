/** `kvfence` run in the test's own process (src/cli/run.ts), for checks that end before any part
 *  starts (a refused flag, a file written and printed): the same parsing, actions and refusal
 *  lines as the `kvfence` process, without a Node start per case. A test of what only a process
 *  shows (its exit status, a signal, what reaches a parent) spawns `cliPath` instead. */
import { runCli } from '../../src/cli/run.js'

/** What a {@link kvfence} run printed and the exit status the process would have ended with. */
export interface CliResult {
  /** 0 when the command returned without setting `process.exitCode`. */
  code: number
  stdout: string
  stderr: string
}

/** Runs `kvfence ...args` in this process. Text written to process.stdout and process.stderr
 *  while it runs is captured (the test runner's own reports, written as Buffers, pass through);
 *  the process's exit code is restored after. Runs must not overlap. */
export async function kvfence(...args: string[]): Promise<CliResult> {
  let stdout = ''
  let stderr = ''
  const out = process.stdout.write
  const err = process.stderr.write
  const capture = (stream: NodeJS.WriteStream, add: (text: string) => void) => {
    const original = stream.write as (...a: unknown[]) => boolean
    return ((chunk: unknown, ...rest: unknown[]): boolean => {
      if (typeof chunk !== 'string') return original.call(stream, chunk, ...rest)
      add(chunk)
      ;(rest.find((r) => typeof r === 'function') as (() => void) | undefined)?.()
      return true
    }) as typeof stream.write
  }
  process.stdout.write = capture(process.stdout, (t) => (stdout += t))
  process.stderr.write = capture(process.stderr, (t) => (stderr += t))
  const exitCodeBefore = process.exitCode
  process.exitCode = undefined
  try {
    const code = await runCli(args, {
      writeOut: (text) => void (stdout += text),
      writeErr: (text) => void (stderr += text),
    })
    return { code: code ?? Number(process.exitCode ?? 0), stdout, stderr }
  } finally {
    process.stdout.write = out
    process.stderr.write = err
    process.exitCode = exitCodeBefore
  }
}

/** {@link kvfence} with `env` added to `process.env` while it runs (as a child given
 *  `{ ...process.env, ...env }` would see it); the variables are restored after. */
export async function kvfenceWithEnv(
  env: Readonly<Record<string, string>>,
  ...args: string[]
): Promise<CliResult> {
  const before = new Map(Object.keys(env).map((k) => [k, process.env[k]]))
  Object.assign(process.env, env)
  try {
    return await kvfence(...args)
  } finally {
    for (const [k, v] of before) {
      if (v === undefined) delete process.env[k]
      else process.env[k] = v
    }
  }
}

/** {@link kvfence}, settling as `promisify(execFile)` of the `kvfence` process does: resolves
 *  with its output on code 0, rejects otherwise with an Error carrying `code`, `stdout` and
 *  `stderr` (its message ends with the stderr text). */
export async function kvfenceOrThrow(...args: string[]): Promise<CliResult> {
  const res = await kvfence(...args)
  if (res.code === 0) return res
  throw Object.assign(
    new Error(`kvfence ${args.join(' ')} exited with ${res.code}\n${res.stderr}`),
    res,
  )
}
