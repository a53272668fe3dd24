/** Fault and guard switches (DESIGN.md §5): every fault of the design is accepted, any fault or
 *  disabled guard is refused without KVFENCE_ALLOW_FAULTS=1, single guards can be turned off, and
 *  the banner names what is off. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import {
  buildFaultConfig,
  faultBanner,
  faultDescriptions,
  implementedFaults,
} from '../../src/engine/faults.js'

const allow = { KVFENCE_ALLOW_FAULTS: '1' }

describe('fault and guard switches', () => {
  it('implements exactly the eight faults of DESIGN.md §5, the prefix cache’s three and delay-begin', () => {
    assert.deepEqual([...implementedFaults].sort(), [
      'corrupt-transfer',
      'delay-begin',
      'drop-abort',
      'early-release',
      'lost-ack',
      'offload-key-without-tenant',
      'offload-load-as-hit',
      'placeholder-forward',
      'publish-partial',
      'skip-scrub',
      'stale-epoch',
      'truncate-transfer',
    ])
    assert.deepEqual(Object.keys(faultDescriptions).sort(), [...implementedFaults].sort())
  })

  it('refuses a fault, all guards off, or one guard off without KVFENCE_ALLOW_FAULTS=1', () => {
    const refusal =
      /^Error: --inject-fault and --unsafe-disable-guard\(s\) are refused unless KVFENCE_ALLOW_FAULTS=1 is set$/
    assert.throws(() => buildFaultConfig(['lost-ack'], false, {}), refusal)
    assert.throws(() => buildFaultConfig([], true, {}), refusal)
    assert.throws(
      () => buildFaultConfig([], false, { KVFENCE_ALLOW_FAULTS: 'yes' }, ['G7']),
      refusal,
    )
    assert.equal(buildFaultConfig([], false, {}).guardsEnabled, true)
  })

  it('turns single guards off, case-insensitively, and all of them with --unsafe-disable-guards', () => {
    const one = buildFaultConfig([], false, allow, ['G7', 'g4'])
    assert.deepEqual([...one.disabledGuards], ['G7', 'G4'])
    assert.equal(one.guardsEnabled, false)
    assert.deepEqual(
      Object.entries(one.guards)
        .filter(([, on]) => !on)
        .map(([id]) => id),
      ['G4', 'G7'],
    )
    const all = buildFaultConfig([], true, allow)
    assert.equal(Object.values(all.guards).filter(Boolean).length, 0)
    assert.ok(Object.isFrozen(all.guards))
  })

  it('names unknown faults and guards in one line', () => {
    assert.throws(
      () => buildFaultConfig(['eat-pages'], false, allow),
      /^Error: unknown fault "eat-pages"; known faults: placeholder-forward, early-release, /,
    )
    assert.throws(
      () => buildFaultConfig([], false, allow, ['G11']),
      /^Error: unknown guard "G11"; known guards: G1, G2, G3, G4, G5, G6, G7, G8, G9, G10$/,
    )
  })

  it('prints a banner naming the fault and the guards that are off, none when shipped', () => {
    assert.equal(faultBanner('kvfence decode', buildFaultConfig([], false, {})), null)
    const banner = faultBanner(
      'kvfence decode',
      buildFaultConfig(['lost-ack'], false, allow, ['G7']),
    )!
    assert.match(banner, /!! kvfence decode: UNSAFE CONFIGURATION — FOR TESTS AND DEMOS ONLY/)
    assert.match(banner, /!! {3}fault injected: lost-ack \(/)
    assert.match(banner, /!! {3}guards OFF: G7 \(--unsafe-disable-guard\)/)
  })
})
