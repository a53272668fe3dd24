/** Each worker option is described once (src/engine/worker-options.ts), and the three places
 *  derived from that table agree with it: the flags of `kvfence prefill|decode` (their help, range
 *  checks and defaults), the worker entries of the cluster file's schema, and the argv the
 *  launcher forks a worker with, which the CLI parses back into the value the file gave. Every
 *  check iterates the table, so an option added there is checked here without a new line (only
 *  an option bound to another by a rule of the file, such as the offload directory and its size,
 *  names its companion in {@link companions}). */
import assert from 'node:assert/strict'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, it } from 'node:test'
import { Command, CommanderError } from 'commander'
import { pino } from 'pino'
import { addWorkerOptions } from '../../src/cli/worker.js'
import { parseClusterConfig } from '../../src/config/cluster.js'
import { clusterConfigPlan, workerArgs } from '../../src/config/launch.js'
import {
  defaultOf,
  flagOf,
  optionsOf,
  workerArgv,
  workerOptions,
  type WorkerOption,
  type WorkerRole,
} from '../../src/engine/worker-options.js'
import { apiKeyDigest } from '../../src/router/tenants/tenants.js'

const roles: WorkerRole[] = ['prefill', 'decode']
const dir = mkdtempSync(join(tmpdir(), 'kvfence-worker-options-'))
after(() => rmSync(dir, { recursive: true, force: true }))
const tenants = [{ name: 'a', keySha256: apiKeyDigest('k'.repeat(32)) }]

/** A valid value of `o` that is not its default. */
function sample(o: WorkerOption): unknown {
  if (o.kind === 'int') return o.max ?? o.min + 1
  if (o.kind === 'switch') return true
  if (o.kind === 'list') return ['a', 'b']
  return o.choices?.[0] ?? 'some-value'
}

/** Options the file accepts only together with another (a rule between them in cluster.ts). */
const companions: Readonly<Record<string, object>> = {
  prefixCacheOffloadDir: { prefixCacheOffloadDiskBytes: 4096 },
  prefixCacheOffloadDiskBytes: { prefixCacheOffloadDir: 'offload' },
}

/** A fresh `kvfence <role>` command that parses without starting anything or exiting. */
function workerCommand(role: WorkerRole): Command {
  const cmd = new Command(role)
    .exitOverride()
    .configureOutput({ writeErr: () => {}, writeOut: () => {} })
  return addWorkerOptions(cmd, role).action(() => {})
}

/** The values the CLI parses from `argv`. */
function parsed(role: WorkerRole, argv: string[]): Record<string, unknown> {
  const cmd = workerCommand(role)
  cmd.parse(argv, { from: 'user' })
  return cmd.opts()
}

/** `text` without white space, so that a help line wrapped anywhere still matches. */
const squash = (text: string) => text.replace(/\s+/g, '')

describe('worker options, described once', () => {
  for (const role of roles) {
    it(`kvfence ${role}: exactly the described options, each with its help text and default`, () => {
      const cmd = workerCommand(role)
      const described = optionsOf(role).map(([name]) => name)
      assert.deepEqual(
        cmd.options.map((o) => o.attributeName()),
        described,
      )
      const help = squash(cmd.helpInformation())
      for (const [name, o] of optionsOf(role)) {
        const arg = o.kind === 'switch' ? '' : `<${o.arg ?? 'n'}>`
        assert.ok(help.includes(squash(`${flagOf(name)} ${arg}${o.doc}`)), `${name} in the help`)
      }
      for (const name of Object.keys(workerOptions))
        if (!described.includes(name as keyof typeof workerOptions))
          assert.ok(!help.includes(`${flagOf(name)}<`), `${name} is not a ${role} flag`)
      const defaults = parsed(role, [])
      for (const [name, o] of optionsOf(role))
        assert.deepEqual(defaults[name], defaultOf(o, role), `default of ${name}`)
    })

    it(`kvfence ${role}: the launcher's argv parses back into every option's value`, () => {
      for (const [name, o] of optionsOf(role)) {
        const value = sample(o)
        const argv = workerArgv(role, { [name]: value })
        assert.deepEqual(parsed(role, argv)[name], value, `${name}: ${argv.join(' ')}`)
      }
    })

    it(`kvfence ${role}: an integer outside its range is refused, naming the flag`, () => {
      for (const [name, o] of optionsOf(role)) {
        if (o.kind !== 'int') continue
        const bad = o.min > 0 ? String(o.min - 1) : '-1'
        assert.throws(
          () => parsed(role, [flagOf(name), bad]),
          (err: unknown) =>
            err instanceof CommanderError &&
            err.code === 'commander.invalidArgument' &&
            err.message.startsWith(
              `error: option '${flagOf(name)} <${o.arg ?? 'n'}>' argument '${bad}' is invalid. expected `,
            ),
          name,
        )
      }
    })

    it(`cluster file → launcher → kvfence ${role}: each option of a ${role} entry arrives`, () => {
      const file = optionsOf(role).filter(([, o]) => o.inFile !== undefined)
      assert.ok(file.some(([name]) => name === 'pages'))
      for (const [name, o] of file) {
        const entry = { pages: 64, ...companions[name], [name]: sample(o) }
        const other = role === 'prefill' ? 'decode' : 'prefill'
        const config = parseClusterConfig(
          { workers: { [role]: [entry], [other]: [{ pages: 8 }] }, tenants },
          'cluster.yaml',
          dir,
        )
        const plan = clusterConfigPlan(config, pino({ level: 'silent' }))
        const worker = plan[role][0]
        assert.ok(!('url' in worker))
        const want =
          o.kind === 'text' && o.isPath === true ? join(dir, String(sample(o))) : sample(o)
        assert.deepEqual(parsed(role, workerArgs(plan, role, worker))[name], want, name)
      }
    })

    it(`cluster file: a bad value of a ${role} entry's option names the field`, () => {
      for (const [name, o] of optionsOf(role)) {
        if (o.inFile === undefined) continue
        const bad = o.kind === 'int' ? o.min - 1 : o.kind === 'switch' ? 'yes' : ''
        const entry = { pages: 64, ...companions[name], [name]: bad }
        const other = role === 'prefill' ? 'decode' : 'prefill'
        assert.throws(
          () =>
            parseClusterConfig(
              { workers: { [role]: [entry], [other]: [{ pages: 8 }] }, tenants },
              'cluster.yaml',
              dir,
            ),
          (err: Error) => err.message.startsWith(`cluster.yaml: workers.${role}.0.${name}: `),
          name,
        )
      }
    })
  }

  it('the launcher gives a worker the plan’s model, page size, address and free ports', () => {
    const plan = {
      modelDir: '/models/m',
      pageSize: 8,
      host: '127.0.0.1',
      logLevel: 'info',
      prefill: [],
      decode: [],
      router: { runs: 'forked', tenantsFile: 't.yaml', port: 0 },
    } as const
    const decode = parsed('decode', workerArgs(plan, 'decode', { pages: 4 }))
    assert.deepEqual(
      [decode.model, decode.pageSize, decode.host, decode.port, decode.transferPort, decode.pages],
      ['/models/m', 8, '127.0.0.1', 0, 0, 4],
    )
    assert.deepEqual(workerArgs(plan, 'prefill', { pages: 4, args: ['--threads', '3'] }), [
      '--model',
      '/models/m',
      '--pages',
      '4',
      '--page-size',
      '8',
      '--host',
      '127.0.0.1',
      '--port',
      '0',
      '--threads',
      '3',
    ])
  })
})
