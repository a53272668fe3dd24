/** `npm run bench -- NAME [--json FILE] [args]`: run one benchmark (or all with no NAME) and print
 *  its JSON. Each benchmark measures its ratios within one run, on this machine, as the medians of
 *  per-repeat ratios of sides run beside each other, with their spreads (ratio.ts). */
import { existsSync, writeFileSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'

/** Benchmarks by name: module file (in this folder) and its exported entry point. */
const benches = {
  model: { file: 'model.js', entry: 'benchModel' },
  transfer: { file: 'transfer.js', entry: 'benchTransfer' },
  router: { file: 'router.js', entry: 'benchRouter' },
  audit: { file: 'audit.js', entry: 'benchAudit' },
  fairness: { file: 'fairness.js', entry: 'benchFairness' },
  sentinel: { file: 'sentinel.js', entry: 'benchSentinel' },
  offload: { file: 'offload.js', entry: 'benchOffload' },
} as const
type BenchName = keyof typeof benches

const here = dirname(fileURLToPath(import.meta.url))

async function run(name: BenchName, args: string[]): Promise<object> {
  const { file, entry } = benches[name]
  const path = join(here, file)
  if (!existsSync(path)) throw new Error(`benchmark "${name}" is not implemented yet`)
  const mod = (await import(path)) as Record<string, (args: string[]) => Promise<object>>
  return mod[entry](args)
}

async function main(argv: string[]): Promise<void> {
  const jsonAt = argv.indexOf('--json')
  const jsonFile = jsonAt >= 0 ? argv[jsonAt + 1] : undefined
  if (jsonAt >= 0 && !jsonFile) throw new Error('--json needs a file name')
  const rest = jsonAt >= 0 ? [...argv.slice(0, jsonAt), ...argv.slice(jsonAt + 2)] : argv
  const [name, ...args] = rest
  if (name !== undefined && !Object.hasOwn(benches, name)) {
    throw new Error(`unknown benchmark "${name}"; known: ${Object.keys(benches).join(', ')}`)
  }
  const names = name === undefined ? (Object.keys(benches) as BenchName[]) : [name as BenchName]
  const results: Record<string, object> = {}
  for (const n of names) {
    try {
      results[n] = await run(n, args)
    } catch (err) {
      if (name !== undefined) throw err
      results[n] = { skipped: (err as Error).message }
    }
  }
  const out = JSON.stringify(name === undefined ? results : results[name], null, 2)
  process.stdout.write(`${out}\n`)
  if (jsonFile) writeFileSync(jsonFile, `${out}\n`)
}

main(process.argv.slice(2)).catch((err: unknown) => {
  process.stderr.write(`bench: ${err instanceof Error ? err.message : String(err)}\n`)
  process.exit(2)
})
