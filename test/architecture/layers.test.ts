/** The layers of src/ and the direction of their imports, read from the sources with the
 *  TypeScript compiler (every `import`, `export … from` and `import()` with a relative path):
 *  cli → soak → config → router | engine → control → model → transfer, kv. A folder imports only
 *  those to its right (its own files too). Router and engine are beside each other, as the two
 *  kinds of process they run in: neither imports the other. What they say to each other is
 *  control's (the messages, the hand-off, the channel's two ends, the cluster token): the router
 *  holds control's client, a worker control's channel server, so the router imports no engine
 *  code and a worker no router code. The audit is a column apart: it imports none of the layers, and
 *  only cli and soak import it. The shared floor — src/common/ (errors, paths, small helpers),
 *  src/link/ (how parts link: mutual TLS, certificate expiry, the plaintext rule) and src/files/ —
 *  is imported by all and imports nothing but itself. src/ itself holds no files.
 *  Package imports (`node:*`, npm) are not checked here. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { srcImportEdges } from './imports.js'

/** Rank of each layer: a folder may import a folder of lower rank. */
const layerRank: Readonly<Record<string, number>> = {
  cli: 6,
  soak: 5,
  config: 4,
  router: 3,
  engine: 3,
  control: 2,
  model: 1,
  transfer: 0,
  kv: 0,
}

/** Folders of the shared floor. */
const sharedFolders = new Set(['common', 'link', 'files'])

/** The folders that may import the audit. */
const auditImporters = new Set(['cli', 'soak'])

/** The part of src/ a file belongs to: its top folder, or `shared` for the floor. `path` is
 *  relative to src/, with `/` separators; a file in src/ itself belongs to no part. */
function partOf(path: string): string {
  const top = path.includes('/') ? path.slice(0, path.indexOf('/')) : '(src/ itself)'
  return sharedFolders.has(top) ? 'shared' : top
}

/** Why an import from `from` to `to` (both relative to src/, `/` separators) runs against the
 *  layers, or undefined when it is allowed. */
export function importViolation(from: string, to: string): string | undefined {
  const a = partOf(from)
  const b = partOf(to)
  if (a !== 'shared' && a !== 'audit' && layerRank[a] === undefined)
    return `${a} is not a known layer`
  if (a === b || b === 'shared') return undefined
  if (a === 'shared') return `the shared floor imports ${b}`
  if (a === 'audit') return `the audit imports ${b}`
  if (b === 'audit')
    return auditImporters.has(a) ? undefined : `${a} imports the audit (only cli and soak may)`
  const ra = layerRank[a]
  const rb = layerRank[b]
  if (ra === undefined) return `${a} is not a known layer`
  if (rb === undefined) return `${b} is not a known layer`
  return rb < ra ? undefined : `${a} imports ${b}, a layer ${rb === ra ? 'beside' : 'above'} it`
}

describe('layers of src/', () => {
  it('the rule: down the layers, the audit apart, the shared floor for all', () => {
    const cases: [string, string, string | undefined][] = [
      ['cli/serve.ts', 'config/launch.ts', undefined],
      ['soak/cluster.ts', 'config/launch.ts', undefined],
      ['soak/cluster.ts', 'cli/keys.ts', 'soak imports cli, a layer above it'],
      ['router/tenants/tenants.ts', 'config/issues.ts', 'router imports config, a layer above it'],
      ['router/tenants/tenants.ts', 'files/issues.ts', undefined],
      ['engine/decode-worker.ts', 'kv/pool.ts', undefined],
      ['router/start.ts', 'engine/faults.ts', 'router imports engine, a layer beside it'],
      ['engine/worker-server.ts', 'router/api/http.ts', 'engine imports router, a layer beside it'],
      ['router/start.ts', 'control/worker-client.ts', undefined],
      ['engine/worker-server.ts', 'control/channel-server.ts', undefined],
      ['control/handoff.ts', 'engine/sequence.ts', 'control imports engine, a layer above it'],
      [
        'control/channel-client.ts',
        'router/api/http.ts',
        'control imports router, a layer above it',
      ],
      ['kv/pool.ts', 'transfer/frames.ts', 'kv imports transfer, a layer beside it'],
      ['model/forward.ts', 'model/threads/team.ts', undefined],
      ['audit/run.ts', 'router/tenants/tenants.ts', 'the audit imports router'],
      ['audit/probes/canary.ts', 'common/errors.ts', undefined],
      [
        'router/gateway.ts',
        'audit/canaries.ts',
        'router imports the audit (only cli and soak may)',
      ],
      ['soak/oracle.ts', 'audit/rng.ts', undefined],
      ['common/errors.ts', 'engine/faults.ts', 'the shared floor imports engine'],
      ['link/tls.ts', 'router/api/http.ts', 'the shared floor imports router'],
      ['router/start.ts', 'link/tls.ts', undefined],
      ['loose.ts', 'common/errors.ts', '(src/ itself) is not a known layer'],
      ['files/yaml-file.ts', 'common/errors.ts', undefined],
    ]
    for (const [from, to, want] of cases)
      assert.equal(importViolation(from, to), want, `${from} → ${to}`)
  })

  it('no import in src/ runs against the layers', () => {
    const violations: string[] = []
    for (const { from, to, line, specifier } of srcImportEdges()) {
      const why = importViolation(from, to)
      if (why !== undefined) violations.push(`src/${from}:${line} '${specifier}': ${why}`)
    }
    assert.deepEqual(violations, [], `imports against the layers:\n${violations.join('\n')}`)
  })
})
