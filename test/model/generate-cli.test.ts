/** `kvfence generate` run as a real child process on the bundled model: its text equals what
 *  `generateLocal` produces in this process at temperature 0, and bad flags exit non-zero with a
 *  one-line message. */
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { describe, it } from 'node:test'
import { promisify } from 'node:util'
import { buildFaultConfig } from '../../src/engine/faults.js'
import { generateLocal } from '../../src/engine/local-engine.js'
import { createWorkerCore } from '../../src/engine/worker-core.js'
import { loadTokenizer } from '../../src/model/tokenizer.js'
import { loadModel } from '../../src/model/weights.js'
import { cliPath, echoModelDir } from '../helpers/paths.js'

const run = promisify(execFile)

async function cli(...args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  try {
    const { stdout, stderr } = await run(process.execPath, [cliPath, 'generate', ...args])
    return { code: 0, stdout, stderr }
  } catch (err) {
    const e = err as { code: number; stdout: string; stderr: string }
    return { code: e.code, stdout: e.stdout, stderr: e.stderr }
  }
}

describe('kvfence generate', () => {
  it('prints exactly the text of generateLocal at temperature 0', async () => {
    const prompt = 'The canary is K7Q2-ZX91-PLM4. Repeat: The canary is K7Q2'
    const tokenizer = loadTokenizer(echoModelDir)
    const model = loadModel(echoModelDir)
    const core = createWorkerCore({
      model,
      numPages: 8,
      pageSize: 16,
      faults: buildFaultConfig([], false, {}),
    })
    const ids = tokenizer.encode(prompt)
    const eos = [
      ...model.config.eosTokenIds,
      ...(tokenizer.eosTokenId === null ? [] : [tokenizer.eosTokenId]),
    ]
    const expected = generateLocal(core, ids, {
      maxTokens: 24,
      sampling: { temperature: 0, topP: 1, seed: null },
      stopTokenIds: eos,
    })
    const out = await cli('--model', echoModelDir, '--prompt', prompt, '--max-tokens', '24')
    assert.equal(out.stderr, '')
    assert.equal(out.code, 0)
    assert.equal(out.stdout, `${tokenizer.decode(expected.tokenIds)}\n`)
    assert.ok(expected.tokenIds.length > 0)
  })

  it('sampling flags: top-k 1 at temperature 1.5 is greedy; a seeded mix equals generateLocal', async () => {
    const prompt = 'the river walks near the stone garden and the light opens over'
    const greedy = await cli('--model', echoModelDir, '--prompt', prompt, '--max-tokens', '20')
    // Keeping the single most probable token leaves nothing to draw: the argmax, whatever the
    // temperature or seed.
    const topK1 = await cli(
      '--model', echoModelDir, '--prompt', prompt, '--max-tokens', '20',
      '--temperature', '1.5', '--top-k', '1', '--seed', '7',
    ) // prettier-ignore
    assert.equal(topK1.code, 0, topK1.stderr)
    assert.equal(topK1.stdout, greedy.stdout)
    // -1 and 0 turn top-k off, as on the HTTP API: at temperature 0 that is the greedy text.
    for (const off of ['0', '-1']) {
      const res = await cli(
        '--model',
        echoModelDir,
        '--prompt',
        prompt,
        '--max-tokens',
        '20',
        '--top-k',
        off,
      )
      assert.equal(res.code, 0, res.stderr)
      assert.equal(res.stdout, greedy.stdout)
    }

    const tokenizer = loadTokenizer(echoModelDir)
    const model = loadModel(echoModelDir)
    const core = createWorkerCore({
      model,
      numPages: 8,
      pageSize: 16,
      faults: buildFaultConfig([], false, {}),
    })
    const eos = [
      ...model.config.eosTokenIds,
      ...(tokenizer.eosTokenId === null ? [] : [tokenizer.eosTokenId]),
    ]
    const sampling = {
      temperature: 1.2,
      topP: 0.95,
      topK: 5,
      minP: 0.05,
      presencePenalty: 0.3,
      frequencyPenalty: 0.5,
      seed: 11,
    }
    const expected = generateLocal(core, tokenizer.encode(prompt), {
      maxTokens: 20,
      sampling,
      stopTokenIds: eos,
    })
    const mixed = await cli(
      '--model', echoModelDir, '--prompt', prompt, '--max-tokens', '20', '--temperature', '1.2',
      '--top-p', '0.95', '--top-k', '5', '--min-p', '0.05', '--presence-penalty', '0.3',
      '--frequency-penalty', '0.5', '--seed', '11',
    ) // prettier-ignore
    assert.equal(mixed.code, 0, mixed.stderr)
    assert.equal(mixed.stdout, `${tokenizer.decode(expected.tokenIds)}\n`)
    assert.notEqual(mixed.stdout, greedy.stdout, 'the sampled run should differ from greedy')
    model.kernels.close()
  })

  it('refuses bad flags and a missing model with a one-line error and a non-zero exit', async () => {
    const badTemp = await cli('--prompt', 'hi', '--temperature', '3')
    assert.notEqual(badTemp.code, 0)
    assert.match(badTemp.stderr, /--temperature.*expected a number in \[0, 2\], got "3"/)
    const noModel = await cli('--prompt', 'hi', '--model', '/nonexistent/model')
    assert.equal(noModel.code, 2)
    assert.equal(noModel.stderr.trim().split('\n').length, 1, noModel.stderr)
    assert.match(noModel.stderr, /^kvfence: .*\/nonexistent\/model/)
    const badMinP = await cli('--prompt', 'hi', '--min-p', '1.5')
    assert.notEqual(badMinP.code, 0)
    assert.match(badMinP.stderr, /--min-p/)
    assert.equal(badMinP.stderr.trim().split('\n').length, 1, badMinP.stderr)
    const badTopK = await cli('--prompt', 'hi', '--top-k', '-2')
    assert.equal(badTopK.code, 2)
    assert.equal(
      badTopK.stderr.trim(),
      `error: option '--top-k <k>' argument '-2' is invalid. expected an integer ≥ -1 (-1 or 0: off), got "-2"`,
    )
    const badPenalty = await cli('--prompt', 'hi', '--frequency-penalty', '-3')
    assert.notEqual(badPenalty.code, 0)
    assert.match(badPenalty.stderr, /--frequency-penalty/)
    const empty = await cli('--prompt', '')
    assert.equal(empty.code, 2)
    assert.equal(empty.stderr.trim(), 'kvfence: --prompt is empty')
  })
})
