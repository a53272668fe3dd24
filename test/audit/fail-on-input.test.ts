/** A bad `--fail-on` or config `failOn` is refused as bad input: one line naming the bad term and
 *  the terms the gate takes, exit 2, with `--plan` as without it, before any request. */
import assert from 'node:assert/strict'
import { describe, test } from 'node:test'
import { AuditError } from '../../src/audit/index.js'
import { parseAuditConfig } from '../../src/audit/config.js'
import { standInTenants, startStandIn, tenantKeys } from './standins.js'
import { kvfence } from '../helpers/cli.js'

/** The classes and severities the gate takes, written out here (classes.ts, types.ts). */
const someKnownTerms = [
  'content-leak',
  'side-channel',
  'credential-exposure',
  'critical',
  'high',
  'medium',
  'low',
  'info',
]

const env = { KEY_A: standInTenants[0].key, KEY_B: standInTenants[1].key }
const configHead =
  'target: http://127.0.0.1:9\ntenants:\n  - { name: a, keyEnv: KEY_A }\n  - { name: b, keyEnv: KEY_B }\n'

function configFault(failOn: string): string {
  try {
    parseAuditConfig(`${configHead}failOn: ${failOn}\n`, 'audit.yaml', env)
  } catch (err) {
    assert.ok(err instanceof AuditError, String(err))
    assert.equal(err.code, 'invalid_config')
    return err.message
  }
  assert.fail(`failOn: ${failOn} was taken`)
}

describe('config failOn', () => {
  test('an unknown term is named, with the known classes and severities', () => {
    for (const failOn of ['[bogus]', '[content-leak, bogus]', 'bogus']) {
      const message = configFault(failOn)
      assert.match(
        message,
        /^config audit\.yaml: failOn: unknown term "bogus" \(known: [^\n]+\)$/,
        failOn,
      )
      const known = message.slice(message.indexOf('(known: ') + 8, -1).split(', ')
      for (const term of someKnownTerms) assert.ok(known.includes(term), `${failOn}: ${term}`)
    }
  })

  test('known terms still read, one or a list; a number is told what failOn takes', () => {
    const one = parseAuditConfig(`${configHead}failOn: high\n`, 'audit.yaml', env)
    assert.deepEqual(one.failOn, ['high'])
    const list = parseAuditConfig(`${configHead}failOn: [content-leak, low]\n`, 'audit.yaml', env)
    assert.deepEqual(list.failOn, ['content-leak', 'low'])
    assert.equal(
      configFault('7'),
      'config audit.yaml: failOn: must be a term or a list of terms (classes, severities, tags or verdicts)',
    )
  })
})

describe('--fail-on with --plan', () => {
  test('a bad term is refused as the audit refuses it: the same one line, exit 2, nothing sent', async () => {
    const standIn = await startStandIn('safe')
    try {
      const args = [
        'audit',
        '--target',
        standIn.url,
        '--tenant',
        `alice=${tenantKeys.alice}`,
        '--tenant',
        `bob=${tenantKeys.bob}`,
        '--fail-on',
        'bogus',
      ]
      const audit = await kvfence(...args)
      const plan = await kvfence(...args, '--plan')
      for (const run of [audit, plan]) {
        assert.equal(run.code, 2)
        assert.equal(run.stdout, '')
        assert.match(
          run.stderr,
          /^kvfence audit: --fail-on: unknown term "bogus" \(known: [^\n]+\)\n$/,
        )
      }
      assert.equal(plan.stderr, audit.stderr)
      assert.deepEqual(standIn.stats.paths, [])
      // A good gate still plans.
      const good = await kvfence(...args.slice(0, -1), 'high', '--plan')
      assert.equal(good.code, 0, good.stderr)
    } finally {
      await standIn.close()
    }
  })
})
