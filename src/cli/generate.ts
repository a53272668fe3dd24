/** `kvfence generate`: tokenize a prompt, run prefill and decode in this one process
 *  (`generateLocal` over a worker core: model, KV pool, guards), print the completion.
 *  The simplest tour of the engine API; no HTTP, no transfer, no tenants. */
import { InvalidArgumentError, type Command } from 'commander'
import { createWorkerCore } from '../engine/worker-core.js'
import { generateLocal } from '../engine/local-engine.js'
import { buildFaultConfig } from '../engine/faults.js'
import { loadTokenizer, unrepresentableTextError } from '../model/tokenizer.js'
import { defaultThreads, loadModel } from '../model/weights.js'
import { bundledModelDir } from '../common/paths.js'
import { intOption, positiveIntOption, threadsHelp, threadsOption } from './options.js'

interface GenerateFlags {
  model: string
  prompt: string
  maxTokens: number
  temperature: number
  topP: number
  topK?: number | null
  minP: number
  presencePenalty: number
  frequencyPenalty: number
  seed?: number
  threads?: number
}

/** Tokens per KV page of the one-process pool. */
const pageSize = 16

function temperatureOption(value: string): number {
  const t = Number(value)
  if (value.trim() === '' || !Number.isFinite(t) || t < 0 || t > 2)
    throw new InvalidArgumentError(`expected a number in [0, 2], got "${value}"`)
  return t
}

/** A parser of a number flag in [min, max] (the API's range of the same field). */
function rangeOption(min: number, max: number): (value: string) => number {
  return (value) => {
    const x = Number(value)
    if (value.trim() === '' || !Number.isFinite(x) || x < min || x > max)
      throw new InvalidArgumentError(`expected a number in [${min}, ${max}], got "${value}"`)
    return x
  }
}

function topPOption(value: string): number {
  const p = Number(value)
  if (value.trim() === '' || !(p > 0 && p <= 1))
    throw new InvalidArgumentError(`expected a number in (0, 1], got "${value}"`)
  return p
}

/** `--top-k`: an integer ≥ -1; -1 and 0 turn it off, as `top_k` of the HTTP API (vLLM's rule). */
function topKOption(value: string): number | null {
  if (!/^-?\d+$/.test(value) || Number(value) < -1 || !Number.isSafeInteger(Number(value)))
    throw new InvalidArgumentError(`expected an integer ≥ -1 (-1 or 0: off), got "${value}"`)
  const k = Number(value)
  return k >= 1 ? k : null
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
    .option('--top-p <p>', 'nucleus mass in (0, 1]', topPOption, 1)
    .option(
      '--top-k <k>',
      'keep the k most probable tokens (-1 or 0: off, the default)',
      topKOption,
    )
    .option('--min-p <p>', 'keep tokens ≥ p × the top probability', rangeOption(0, 1), 0)
    .option('--presence-penalty <x>', "OpenAI's presence penalty", rangeOption(-2, 2), 0)
    .option('--frequency-penalty <x>', "OpenAI's frequency penalty", rangeOption(-2, 2), 0)
    .option('--seed <n>', 'seed of the sampling random stream (same seed, same tokens)', intOption)
    .option('--threads <n>', threadsHelp, threadsOption)
    .action((flags: GenerateFlags) => {
      const tokenizer = loadTokenizer(flags.model)
      if (flags.prompt === '') throw new Error('--prompt is empty')
      const lost = tokenizer.firstLostCharacter(flags.prompt)
      if (lost !== null) throw unrepresentableTextError(lost, '--prompt')
      const model = loadModel(flags.model, { threads: flags.threads ?? defaultThreads() })
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
        sampling: {
          temperature: flags.temperature,
          topP: flags.topP,
          topK: flags.topK ?? null,
          minP: flags.minP,
          presencePenalty: flags.presencePenalty,
          frequencyPenalty: flags.frequencyPenalty,
          seed: flags.seed ?? null,
        },
        stopTokenIds: eos,
      })
      const text = tokenizer.decode(result.tokenIds)
      process.stdout.write(`${text}\n`)
      const note = blankCompletionNote(
        text,
        result.tokenIds.length,
        flags.model === bundledModelDir,
      )
      if (note !== null) process.stderr.write(`kvfence generate: ${note}\n`)
    })
}

/** One line saying that a completion prints as nothing, and what it is, or null when it shows:
 *  a fresh-user trial took the bundled echo model's newlines for a broken detokenizer. Exported
 *  for its test. */
export function blankCompletionNote(
  text: string,
  numTokens: number,
  isBundledModel: boolean,
): string | null {
  if (numTokens === 0) return 'the model ended at once (end of sequence first): no completion'
  if (text.trim() !== '') return null
  const chars = [...text]
  const shown =
    chars.every((c) => c === chars[0]) && chars.length > 0
      ? `${chars.length} × ${JSON.stringify(chars[0])}`
      : JSON.stringify(text.length > 40 ? `${text.slice(0, 40)}…` : text)
  const why = isBundledModel
    ? ': the bundled echo model copies from its prompt (try --prompt "the code is 8Vc1XzQ7. Repeat: the code is") and gives newlines where it finds nothing to copy'
    : ''
  return `the completion is whitespace only (${numTokens} tokens, ${shown})${why}`
}
