/** `kvfence generate`: tokenize a prompt, run prefill and decode in this one process
 *  (`generateLocal` over a worker core: model, KV pool, guards), print the completion.
 *  The simplest tour of the engine API; no HTTP, no transfer, no tenants. */
import { InvalidArgumentError, type Command } from 'commander'
import { createWorkerCore } from '../engine/worker-core.js'
import { generateLocal } from '../engine/local-engine.js'
import { buildFaultConfig } from '../engine/faults.js'
import { loadTokenizer } from '../model/tokenizer.js'
import { loadModel } from '../model/weights.js'
import { bundledModelDir } from '../paths.js'
import { intOption } from './options.js'

interface GenerateFlags {
  model: string
  prompt: string
  maxTokens: number
  temperature: number
  seed?: number
}

/** Tokens per KV page of the one-process pool. */
const pageSize = 16

function temperatureOption(value: string): number {
  const t = Number(value)
  if (value.trim() === '' || !Number.isFinite(t) || t < 0 || t > 2)
    throw new InvalidArgumentError(`expected a number in [0, 2], got "${value}"`)
  return t
}

function positiveIntOption(value: string): number {
  const n = intOption(value)
  if (n < 1) throw new InvalidArgumentError(`expected a positive integer, got "${value}"`)
  return n
}

/** Register `kvfence generate` on the program. */
export function registerGenerate(program: Command): void {
  program
    .command('generate')
    .description(
      'Generate a completion offline in one process (no server): the engine API in one call',
    )
    .option('--model <dir>', 'Hugging Face model directory', bundledModelDir)
    .requiredOption('--prompt <text>', 'prompt text (completed as is, no chat template)')
    .option('--max-tokens <n>', 'tokens to generate at most', positiveIntOption, 64)
    .option('--temperature <t>', 'sampling temperature; 0 is greedy', temperatureOption, 0)
    .option('--seed <n>', 'seed of the sampling random stream (same seed, same tokens)', intOption)
    .action((flags: GenerateFlags) => {
      const tokenizer = loadTokenizer(flags.model)
      const model = loadModel(flags.model)
      if (flags.prompt === '') throw new Error('--prompt is empty')
      const promptTokenIds = tokenizer.encode(flags.prompt)
      if (promptTokenIds.length === 0) throw new Error('--prompt encodes to no tokens')
      const total = promptTokenIds.length + flags.maxTokens
      const core = createWorkerCore({
        model,
        numPages: Math.ceil(total / pageSize),
        pageSize,
        faults: buildFaultConfig([], false, process.env),
      })
      const eos = [...model.config.eosTokenIds]
      if (tokenizer.eosTokenId !== null) eos.push(tokenizer.eosTokenId)
      const result = generateLocal(core, promptTokenIds, {
        maxTokens: flags.maxTokens,
        sampling: { temperature: flags.temperature, topP: 1, seed: flags.seed ?? null },
        stopTokenIds: eos,
      })
      process.stdout.write(`${tokenizer.decode(result.tokenIds)}\n`)
    })
}
