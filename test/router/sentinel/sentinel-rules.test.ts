/** The response sentinel's Prometheus alerting rules (deploy/kvfence-sentinel-rules.yml) through
 *  `promtool test rules` with deploy/kvfence-sentinel-rules.test.yml: a confirmed leak pages at
 *  once, suspected answers warn at a sustained rate (one alone does not), fingerprints near
 *  their cap warn. Skips, saying why, only when promtool is not installed. */
import { testRulesFile } from '../../helpers/promtool.js'

testRulesFile(
  'promtool: the sentinel rules file is valid and its unit tests pass',
  'kvfence-sentinel-rules',
  3,
)
