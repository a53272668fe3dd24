/** The TLS certificates' Prometheus alerting rules (deploy/kvfence-tls-rules.yml) through
 *  `promtool test rules` with deploy/kvfence-tls-rules.test.yml: a certificate warns once fewer
 *  than 30 days are left, not before, and pages once expired. Skips, saying why, only when
 *  promtool is not installed. */
import { testRulesFile } from '../helpers/promtool.js'

testRulesFile(
  'promtool: the TLS rules file is valid and its unit tests pass',
  'kvfence-tls-rules',
  2,
)
