/** The watch's Prometheus alerting rules (deploy/kvfence-watch-rules.yml) through `promtool test
 *  rules` with deploy/kvfence-watch-rules.test.yml: a leak pages, a capacity gap warns, 5 minutes
 *  without a successful cycle warns. Skips, saying why, only when promtool is not installed. */
import { testRulesFile } from '../helpers/promtool.js'

testRulesFile('promtool: the rules file is valid and its unit tests pass', 'kvfence-watch-rules', 5)
