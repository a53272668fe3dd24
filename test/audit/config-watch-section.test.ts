/** One YAML file serves `kvfence audit --config` and `kvfence watch --config` (docs/monitoring.md,
 *  deploy/watch.example.yaml): the audit ignores the `watch:` section, which the watch's own parser
 *  checks. A fresh-user trial ran `audit --config deploy/watch.example.yaml` and got
 *  `Unrecognized key: "watch"`. */
import assert from 'node:assert/strict'
import { fileURLToPath } from 'node:url'
import { test } from 'node:test'
import { loadAuditConfig } from '../../src/audit/index.js'

const example = fileURLToPath(new URL('../../../deploy/watch.example.yaml', import.meta.url))

test("the audit reads the watch's example config, its watch: section ignored", async () => {
  const config = await loadAuditConfig(example, {
    KVFENCE_WATCH_A_KEY: 'sk-watch-a',
    KVFENCE_WATCH_B_KEY: 'sk-watch-b',
  })
  assert.equal(config.target, 'https://llm.example.internal')
  assert.deepEqual(config.authorizedTargets, ['llm.example.internal'])
  assert.deepEqual(
    config.tenants?.map((t) => [t.name, t.key]),
    [
      ['watch-a', 'sk-watch-a'],
      ['watch-b', 'sk-watch-b'],
    ],
  )
  assert.ok(!('watch' in config), 'the watch section is not part of the audit config')
})
