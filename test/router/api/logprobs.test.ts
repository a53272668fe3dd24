/** Completions `logprobs.text_offset` counts the completion text as returned: a special token
 *  (named in `tokens`) adds nothing to it, since the text skips special tokens. Checked on the
 *  bundled echo model's real tokenizer, by hand: `<pad><pad>#` shows as `#`. */
import assert from 'node:assert/strict'
import { it } from 'node:test'
import { loadTokenizer } from '../../../src/model/tokenizer.js'
import { CompletionLogprobsBuilder, tokenTextOf } from '../../../src/router/api/logprobs.js'
import { echoModelDir } from '../../helpers/paths.js'

it('text_offset skips special tokens, which the completion text does not show', () => {
  const tokenizer = loadTokenizer(echoModelDir)
  const decode = (ids: readonly number[], options: { skipSpecialTokens: boolean }) =>
    tokenizer.decode(ids, options)
  const ids = tokenizer.encode('<pad><pad>#ab', { addSpecialTokens: false })
  assert.equal(tokenizer.decode(ids), '#ab')
  const entries = ids.map((tokenId) => ({ tokenId, logprobs: { logprob: -1, top: [] } }))
  const logprobs = new CompletionLogprobsBuilder(
    tokenTextOf(decode),
    tokenTextOf(decode, true),
  ).next(entries)
  assert.deepEqual(logprobs.tokens, ['<pad>', '<pad>', '#', 'a', 'b'])
  assert.deepEqual(logprobs.text_offset, [0, 0, 0, 1, 2])
})
