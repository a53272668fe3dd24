/** The differential oracle: the single-process engine (no transfer, one pool) at temperature 0
 *  runs a request alone and says which tokens and text the disaggregated cluster must return.
 *  Builds prompts exactly as the router does (completion text or chat template), so the token ids
 *  match. Knows token ids and text; knows nothing of HTTP or tenants' keys. */
import { buildFaultConfig } from '../engine/faults.js'
import { generateLocal } from '../engine/local-engine.js'
import { createWorkerCore, type WorkerCore } from '../engine/worker-core.js'
import { loadModel } from '../model/weights.js'
import { loadTokenizer, type Tokenizer } from '../model/tokenizer.js'
import { chatPromptTokenIds, completionPromptTokenIds } from '../router/tokenize/prompt-ids.js'

/** A request as the soak sends it. */
export interface SoakRequest {
  endpoint: 'chat' | 'completion'
  prompt: string
  maxTokens: number
}

/** What the single-process engine answers. */
export interface Expected {
  text: string
  numTokens: number
}

/** The oracle over one model directory. */
export class Oracle {
  private readonly tokenizer: Tokenizer
  private readonly core: WorkerCore
  private readonly cache = new Map<string, Expected>()

  /** Loads the model and a pool of `numPages` × `pageSize` (the oracle's own, nothing shared). */
  constructor(modelDir: string, numPages: number, pageSize: number) {
    this.tokenizer = loadTokenizer(modelDir)
    this.core = createWorkerCore({
      model: loadModel(modelDir),
      numPages,
      pageSize,
      faults: buildFaultConfig([], false, {}),
    })
  }

  /** Prompt token ids, as the router computes them. */
  promptTokenIds(req: SoakRequest): number[] {
    return req.endpoint === 'chat'
      ? chatPromptTokenIds(this.tokenizer, [{ role: 'user', content: req.prompt }])
      : completionPromptTokenIds(this.tokenizer, { text: req.prompt })
  }

  /** The tokens and text at temperature 0, run alone. Throws `context_length_exceeded` when the
   *  request does not fit the oracle's pool. Memoized per request. */
  expected(req: SoakRequest): Expected {
    const key = `${req.endpoint}\0${req.maxTokens}\0${req.prompt}`
    const hit = this.cache.get(key)
    if (hit) return hit
    const eos = this.tokenizer.eosTokenId
    const local = generateLocal(this.core, this.promptTokenIds(req), {
      maxTokens: req.maxTokens,
      sampling: { temperature: 0, topP: 1, seed: null },
      stopTokenIds: eos === null ? [] : [eos],
    })
    const out = { text: this.tokenizer.decode(local.tokenIds), numTokens: local.tokenIds.length }
    if (this.cache.size > 10_000) this.cache.clear() // bounded: a soak rarely repeats a prompt
    this.cache.set(key, out)
    return out
  }
}
