/** The options of a prefill or decode worker, each described once: its name, type, range, default,
 *  help text, the roles that take it and whether a worker entry of the cluster file sets it. From
 *  this table are derived the flags of `kvfence prefill|decode` (src/cli/worker.ts), the worker
 *  entries of the cluster file's schema (src/config/cluster.ts) and the argv the launcher passes
 *  to a forked worker ({@link workerArgv}, src/config/launch.ts); a new option is one entry here.
 *  Knows names, ranges and defaults; knows nothing of commander, zod or processes. */
import { bundledModelDir } from '../common/paths.js'
import { maxTimerMs } from '../common/timer-limit.js'
import { defaultMaxBatch } from './decode-scheduler.js'

/** The two kinds of worker. */
export type WorkerRole = 'prefill' | 'decode'

const bothRoles = ['prefill', 'decode'] as const

/** pino's log levels, for `--log-level`. */
export const logLevels = ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'] as const

/** Whether a worker entry of the cluster file sets the option: `required` (every entry of a
 *  worker started here names it), `optional`, or absent (the launcher sets it from the plan:
 *  addresses, ports, TLS files, faults). */
type InFile = 'required' | 'optional'

/** What every option says. The flag is `--` and the name in kebab case (`pageSize` →
 *  `--page-size`); commander turns it back into the name. */
interface Described {
  /** Help text of the flag. */
  readonly doc: string
  readonly roles: readonly WorkerRole[]
  readonly inFile?: InFile
}

/** A default, or one per role. */
type PerRole<V> = V | { readonly [R in WorkerRole]: V }

/** An integer in [min, max] (max default `Number.MAX_SAFE_INTEGER`); `what` replaces the range's
 *  wording in the CLI's error (e.g. "a port from 0 to 65535"); `arg` names the value in the help
 *  (default `n`). */
export interface IntOption extends Described {
  readonly kind: 'int'
  readonly arg?: string
  readonly min: number
  readonly max?: number
  readonly what?: string
  readonly default?: PerRole<number>
}

/** A string; `choices` lists the values allowed; `isPath`: a path, which the cluster file gives
 *  relative to itself. */
export interface TextOption extends Described {
  readonly kind: 'text'
  readonly arg: string
  readonly choices?: readonly string[]
  readonly isPath?: boolean
  readonly default?: PerRole<string>
}

/** A flag without a value: true when given. */
export interface SwitchOption extends Described {
  readonly kind: 'switch'
  readonly default?: false
}

/** A repeatable string flag, collected into a list (default empty). */
export interface ListOption extends Described {
  readonly kind: 'list'
  readonly arg: string
}

/** One described option. */
export type WorkerOption = IntOption | TextOption | SwitchOption | ListOption

const int = <const O extends Omit<IntOption, 'kind'>>(o: O) => ({ ...o, kind: 'int' }) as const
const text = <const O extends Omit<TextOption, 'kind'>>(o: O) => ({ ...o, kind: 'text' }) as const
const toggle = <const O extends Omit<SwitchOption, 'kind'>>(o: O) =>
  ({ ...o, kind: 'switch' }) as const
const list = <const O extends Omit<ListOption, 'kind'>>(o: O) => ({ ...o, kind: 'list' }) as const

/** Every worker option, in the order of the help. */
export const workerOptions = {
  model: text({
    arg: 'dir',
    doc: 'Hugging Face model directory',
    default: bundledModelDir,
    roles: bothRoles,
  }),
  pages: int({
    min: 1,
    default: 64,
    doc: 'pages in this worker’s KV pool',
    roles: bothRoles,
    inFile: 'required',
  }),
  pageSize: int({ min: 1, default: 16, doc: 'tokens per page', roles: bothRoles }),
  host: text({
    arg: 'host',
    doc: 'control-plane address to bind',
    default: '127.0.0.1',
    roles: bothRoles,
  }),
  port: int({
    arg: 'port',
    min: 0,
    max: 65535,
    what: 'a port from 0 to 65535',
    doc: 'control-plane port (0 picks one)',
    default: { prefill: 8101, decode: 8102 },
    roles: bothRoles,
  }),
  injectFault: list({
    arg: 'name',
    doc: 'inject a fault (needs KVFENCE_ALLOW_FAULTS=1); repeatable',
    roles: bothRoles,
  }),
  unsafeDisableGuards: toggle({
    doc: 'turn every safety guard off (needs KVFENCE_ALLOW_FAULTS=1)',
    default: false,
    roles: bothRoles,
  }),
  unsafeDisableGuard: list({
    arg: 'id',
    doc: 'turn one safety guard off, e.g. G7 (needs KVFENCE_ALLOW_FAULTS=1); repeatable',
    roles: bothRoles,
  }),
  transferTimeoutMs: int({
    arg: 'ms',
    min: 1,
    max: maxTimerMs,
    doc: 'a KV transfer with no progress (or no ACK) for this long fails (default 30000)',
    roles: bothRoles,
    inFile: 'optional',
  }),
  logLevel: text({
    arg: 'level',
    choices: logLevels,
    doc: 'pino log level',
    default: 'info',
    roles: bothRoles,
  }),
  threads: int({
    min: 1,
    max: 64,
    doc: 'compute threads per model (default: min(2, available cores))',
    roles: bothRoles,
    inFile: 'optional',
  }),
  tlsCa: text({
    arg: 'file',
    doc: 'cluster CA certificate: with --tls-cert/--tls-key, the control plane and KV transfers run over mutual TLS 1.3 (kvfence certs init)',
    roles: bothRoles,
  }),
  tlsCert: text({
    arg: 'file',
    doc: 'this worker’s certificate, signed by the cluster CA',
    roles: bothRoles,
  }),
  tlsKey: text({ arg: 'file', doc: 'this worker’s private key', roles: bothRoles }),
  allowPlaintext: toggle({
    doc: 'without TLS, bind (and, prefill, send KV pages to) addresses beyond loopback anyway: refused otherwise',
    default: false,
    roles: bothRoles,
  }),
  prefixCachePages: int({
    min: 0,
    doc: 'most KV pool pages the prefix cache may hold, split between tenants as the router’s tenants file says (each tenant its own partition), 0 = off (default: a quarter of --pages)',
    roles: ['prefill'],
    inFile: 'optional',
  }),
  prefixCachePagesPerTenant: int({
    min: 1,
    doc: 'the most pages of a tenant’s default share of the prefix cache (default: an equal share of the pages the tenants file does not give by name)',
    roles: ['prefill'],
    inFile: 'optional',
  }),
  prefixCacheShared: toggle({
    doc: 'one prefix-cache budget shared by all tenants: one tenant’s traffic then changes another’s hits (the load side channel of docs/threat-model.md); for a single tenant only',
    roles: ['prefill'],
    inFile: 'optional',
  }),
  prefixCacheOffloadBytes: int({
    min: 0,
    doc: 'host memory for pages evicted from the prefix cache, loaded back (verified) on a hit; each tenant has its partition’s share of it unless --prefix-cache-shared (default 0: none)',
    roles: ['prefill'],
    inFile: 'optional',
  }),
  prefixCacheOffloadDir: text({
    arg: 'dir',
    isPath: true,
    doc: 'a directory (existing, mode 0700) for pages dropped from the host offload tier (or evicted from the cache, without --prefix-cache-offload-bytes), loaded back (verified) on a hit; needs --prefix-cache-offload-disk-bytes',
    roles: ['prefill'],
    inFile: 'optional',
  }),
  prefixCacheOffloadDiskBytes: int({
    min: 1,
    doc: 'most bytes of files in --prefix-cache-offload-dir (> 0), split between tenants as --prefix-cache-offload-bytes',
    roles: ['prefill'],
    inFile: 'optional',
  }),
  transferHost: text({
    arg: 'host',
    doc: 'KV transfer receiver address to bind',
    default: '127.0.0.1',
    roles: ['decode'],
  }),
  transferPort: int({
    arg: 'port',
    min: 0,
    max: 65535,
    what: 'a port from 0 to 65535',
    doc: 'KV transfer receiver port (0 picks one)',
    default: 8103,
    roles: ['decode'],
  }),
  maxBatch: int({
    min: 1,
    what: 'an integer ≥ 1',
    doc: 'most sequences per decode step (continuous batching)',
    default: defaultMaxBatch,
    roles: ['decode'],
    inFile: 'optional',
  }),
} satisfies Record<string, WorkerOption>

type Options = typeof workerOptions

/** The name of a worker option. */
export type WorkerOptionName = keyof Options

/** The value type of an option. */
type ValueOf<O> = O extends { kind: 'int' }
  ? number
  : O extends { kind: 'switch' }
    ? boolean
    : O extends { kind: 'list' }
      ? string[]
      : string

/** Names of the options `R` takes. */
type NamesOf<R extends WorkerRole> = {
  [N in WorkerOptionName]: R extends Options[N]['roles'][number] ? N : never
}[WorkerOptionName]

/** The parsed flags of a worker of role `R` (both roles' when `R` is the union): an option with a
 *  default always has a value. */
export type WorkerFlags<R extends WorkerRole = WorkerRole> = {
  [
    N in NamesOf<R> as Options[N] extends { default: unknown } | { kind: 'list' } ? N : never
  ]: ValueOf<Options[N]>
} & {
  [
    N in NamesOf<R> as Options[N] extends { default: unknown } | { kind: 'list' } ? never : N
  ]?: ValueOf<Options[N]>
}

/** Names of the options a worker entry of the cluster file sets for role `R`. */
type FileNamesOf<R extends WorkerRole> = {
  [N in NamesOf<R>]: Options[N] extends { inFile: InFile } ? N : never
}[NamesOf<R>]

/** A worker entry of the cluster file for a worker of role `R` started here: `pages` and the
 *  optional options of {@link workerOptions} marked `inFile`. */
export type WorkerFileEntry<R extends WorkerRole> = {
  [N in FileNamesOf<R> as Options[N] extends { inFile: 'required' } ? N : never]: ValueOf<
    Options[N]
  >
} & {
  [N in FileNamesOf<R> as Options[N] extends { inFile: 'required' } ? never : N]?: ValueOf<
    Options[N]
  >
}

/** Values of any of the options, none required: what {@link workerArgv} turns into flags. */
export type WorkerValues = { [N in WorkerOptionName]?: ValueOf<Options[N]> }

/** The options role `role` takes, in the help's order, with their names. */
export function optionsOf(role: WorkerRole): [WorkerOptionName, WorkerOption][] {
  return (Object.entries(workerOptions) as [WorkerOptionName, WorkerOption][]).filter(([, o]) =>
    o.roles.includes(role),
  )
}

/** `--page-size` for `pageSize`. */
export function flagOf(name: string): string {
  return `--${name.replace(/[A-Z]/g, (c) => `-${c.toLowerCase()}`)}`
}

/** The default of `option` for `role`, or undefined (a list defaults to empty). */
export function defaultOf(
  option: WorkerOption,
  role: WorkerRole,
): number | string | boolean | string[] | undefined {
  if (option.kind === 'list') return []
  const d = option.default
  return typeof d === 'object' ? d[role] : d
}

/** The argv that gives a worker of `role` the options set in `values` (an option `role` does not
 *  take, or an unset one, is left out; a switch is given when true): what the launcher passes to
 *  `kvfence prefill|decode`. */
export function workerArgv(role: WorkerRole, values: WorkerValues): string[] {
  return optionsOf(role).flatMap(([name, o]) => {
    const value = values[name]
    if (value === undefined) return []
    const flag = flagOf(name)
    if (o.kind === 'switch') return value === true ? [flag] : []
    if (o.kind === 'list') return (value as string[]).flatMap((v) => [flag, v])
    return [flag, String(value)]
  })
}
