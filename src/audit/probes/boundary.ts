/** Probe `boundary`: prompts of exactly pool−1, pool, pool+1, context−1, context and context+1
 *  tokens (the sizes that are known), each with `max_tokens: 1`. A prompt that cannot fit (more
 *  tokens than the KV pool or the context window) must be refused with a 4xx; a 200 means the
 *  endpoint took the path that leaked in the incident. At exactly the limit, prompt plus one
 *  generated token overflows by one, so either answer is accepted there. */
import { BudgetExhaustedError } from '../budget.js'
import type { Probe } from '../probe.js'
import { inconclusiveRemediation, rejectionRemediation } from '../probe.js'
import type { PromptSizer, Rounding } from '../sizer.js'
import { outcomeOf, type CompletionResult, type Outcome, type Target } from '../target.js'
import type { Finding } from '../types.js'

interface BoundarySize {
  readonly labels: string[]
  readonly tokens: number
}

interface SizeResult {
  readonly labels: string
  readonly promptTokens: number
  readonly reportedPromptTokens: number | null
  readonly mustReject: boolean
  readonly status: number | null
  readonly outcome: Outcome
  readonly errorCode: string | null
  readonly failure: string | null
}

export const boundaryProbe: Probe = {
  name: 'boundary',
  description:
    'prompts of pool−1, pool, pool+1, context−1, context, context+1 tokens; one that cannot fit must get a 4xx, never a 200',
  class: 'misconfiguration',
  controls: { aisvs: [], guards: ['G2', 'G3'] },
  isSizing: true,
  plan: ({ poolTokens, contextTokens, inputLimitTokens }) => {
    const limit = Math.min(...[poolTokens, contextTokens].filter((n) => n !== null))
    const sizes = boundarySizes(poolTokens, contextTokens, inputLimitTokens)
    // A prompt that fits may be sent once more, resized after the first count.
    return sizes.map((s) => ({
      what: `prompt of ${s.tokens} tokens (${s.labels.join('/')})`,
      numRequests: s.tokens > limit ? 1 : 2,
      tokensEach: s.tokens + 1,
    }))
  },
  async run(target, _budget, context): Promise<Finding[]> {
    const { poolTokens, contextTokens } = context.discovery
    if (poolTokens === null && contextTokens === null) {
      return inconclusive('neither the KV pool nor the context window is known: no size to test', {
        poolTokens,
        contextTokens,
      })
    }
    const calibrated = await context.sizer()
    if (calibrated === null) {
      return inconclusive(
        'could not calibrate token counts: no usage.prompt_tokens, no /tokenize',
        { poolTokens, contextTokens },
      )
    }
    const limitTokens = Math.min(...[poolTokens, contextTokens].filter((n) => n !== null))
    const sizes = boundarySizes(poolTokens, contextTokens, context.discovery.inputLimitTokens)
    const { results, sizer } = await sendSizes(target, calibrated, sizes, limitTokens)
    context.log(
      results
        .map((r) => `${r.labels}=${r.promptTokens}:${r.status ?? r.failure ?? 'none'}`)
        .join(' '),
    )
    const evidence = {
      poolTokens,
      contextTokens,
      limitTokens,
      calibration: {
        method: sizer.method,
        overheadTokens: round3(sizer.overheadTokens),
        tokensPerWord: round3(sizer.tokensPerWord),
        observations: sizer.observations,
      },
      sizes: results,
    }
    return judge(results, { poolTokens, contextTokens, limitTokens }, evidence)
  },
}

function inconclusive(title: string, evidence: Record<string, unknown>): Finding[] {
  return [
    {
      probe: 'boundary',
      verdict: 'inconclusive',
      severity: 'medium',
      title,
      evidence,
      remediation: inconclusiveRemediation,
    },
  ]
}

/** Sends every size as the first tenant. Prompts that fit go one by one: each measured count
 *  sharpens the sizing of the next (the sizer returned is the sharpest), and a prompt that came
 *  out at the wrong size is sent once more, corrected. Prompts that cannot fit tell nothing
 *  about sizing; they go concurrently (budget permitting). */
async function sendSizes(
  target: Target,
  calibrated: PromptSizer,
  sizes: readonly BoundarySize[],
  limitTokens: number,
): Promise<{ results: SizeResult[]; sizer: PromptSizer }> {
  const tenant = target.tenants[0]
  const results: SizeResult[] = []
  // Land below a size that must fit and above one that must not, never across the limit.
  const roundingFor = (size: BoundarySize): Rounding =>
    size.tokens > limitTokens ? 'up' : size.tokens < limitTokens ? 'down' : 'nearest'
  const send = async (size: BoundarySize, current: PromptSizer): Promise<SizeResult> => {
    const mustReject = size.tokens > limitTokens
    try {
      const res = await target.complete({
        tenant,
        prompt: current.build(size.tokens, roundingFor(size)),
        maxTokens: 1,
        stream: false,
        isValid: !mustReject,
      })
      return toSizeResult(size, res, mustReject)
    } catch (err) {
      if (!(err instanceof BudgetExhaustedError)) throw err
      return notSent(size, mustReject)
    }
  }
  let sizer = calibrated
  for (const size of sizes.filter((s) => s.tokens <= limitTokens)) {
    let result = await send(size, sizer)
    if (result.reportedPromptTokens !== null) {
      const wordsSent = sizer.wordsFor(size.tokens, roundingFor(size))
      sizer = sizer.refine({ words: wordsSent, tokens: result.reportedPromptTokens })
      // Resend only when the corrected sizing gives another prompt (some sizes cannot be hit
      // exactly, e.g. with two tokens per filler word).
      const isResized = sizer.wordsFor(size.tokens, roundingFor(size)) !== wordsSent
      if (result.reportedPromptTokens !== size.tokens && isResized) {
        const retry = await send(size, sizer)
        if (retry.failure !== 'budget') result = retry
      }
    }
    results.push(result)
  }
  const overLimit = sizes.filter((s) => s.tokens > limitTokens)
  const current = sizer
  results.push(...(await Promise.all(overLimit.map((size) => send(size, current)))))
  return { results, sizer }
}

/** A warning for each limit a prompt over it was accepted past; else clean when every prompt
 *  over the limit got a 4xx while prompts that fit were answered (the positive control), and
 *  inconclusive otherwise. */
function judge(
  results: readonly SizeResult[],
  limits: { poolTokens: number | null; contextTokens: number | null; limitTokens: number },
  evidence: Record<string, unknown>,
): Finding[] {
  const { poolTokens, contextTokens, limitTokens } = limits
  const mustReject = results.filter((r) => r.mustReject)
  const accepted = mustReject.filter((r) => r.outcome === 'accepted' && !isMisSized(r, limitTokens))
  const findings: Finding[] = []
  const overPool = accepted.filter((r) => poolTokens !== null && r.promptTokens > poolTokens)
  const overContext = accepted.filter(
    (r) => contextTokens !== null && r.promptTokens > contextTokens && !overPool.includes(r),
  )
  if (overPool.length > 0) {
    findings.push({
      probe: 'boundary',
      verdict: 'warning',
      severity: 'high',
      tags: ['over-pool-accepted'],
      title: `accepted a prompt larger than the KV pool (${overPool.map((r) => r.promptTokens).join(', ')} > ${poolTokens} tokens)`,
      evidence,
      remediation: rejectionRemediation,
    })
  }
  if (overContext.length > 0) {
    findings.push({
      probe: 'boundary',
      verdict: 'warning',
      severity: 'high',
      title: `accepted a prompt larger than the advertised context (${overContext.map((r) => r.promptTokens).join(', ')} > ${contextTokens} tokens)`,
      evidence,
      remediation: rejectionRemediation,
    })
  }
  if (findings.length > 0) return findings
  // A 4xx proves a working rejection path only if the endpoint accepts prompts that fit:
  // otherwise the 4xx may be about something else (model, parameters, account).
  const isControlAccepted = results.some(
    (r) => r.promptTokens < limitTokens && r.outcome === 'accepted',
  )
  const isAllRejected = mustReject.length > 0 && mustReject.every((r) => r.outcome === 'rejected')
  if (isAllRejected && !isControlAccepted) {
    return inconclusive(
      `prompts that fit (under ${limitTokens} tokens) were refused too, so the 4xx for larger ones proves nothing`,
      evidence,
    )
  }
  if (isAllRejected) {
    return [
      {
        probe: 'boundary',
        verdict: 'clean',
        severity: 'info',
        title: `rejected every prompt larger than ${limitTokens} tokens with a 4xx`,
        evidence,
        remediation: 'None needed.',
      },
    ]
  }
  return inconclusive(
    'some prompts larger than the limit got neither a 4xx nor a 200 (server error, timeout, auth or budget)',
    evidence,
  )
}

/** The sizes sent: pool and context, each −1, exact and +1; and, when the engine reports the
 *  largest input it accepts (SGLang: 6 tokens under the smaller limit), that size too, the one a
 *  correct engine of that kind must accept (the control the refusals are judged against). */
function boundarySizes(
  poolTokens: number | null,
  contextTokens: number | null,
  inputLimitTokens: number | null = null,
): BoundarySize[] {
  const byTokens = new Map<number, string[]>()
  const add = (label: string, tokens: number): void => {
    if (tokens < 1) return
    byTokens.set(tokens, [...(byTokens.get(tokens) ?? []), label])
  }
  for (const [name, n] of [
    ['pool', poolTokens],
    ['context', contextTokens],
  ] as const) {
    if (n === null) continue
    add(`${name}-1`, n - 1)
    add(name, n)
    add(`${name}+1`, n + 1)
  }
  if (inputLimitTokens !== null) add('input-limit', inputLimitTokens)
  return [...byTokens.entries()]
    .sort(([a], [b]) => a - b)
    .map(([tokens, labels]) => ({ tokens, labels }))
}

function toSizeResult(size: BoundarySize, res: CompletionResult, mustReject: boolean): SizeResult {
  return {
    labels: size.labels.join('/'),
    promptTokens: size.tokens,
    reportedPromptTokens: res.promptTokens,
    mustReject,
    status: res.status,
    outcome: outcomeOf(res),
    errorCode: res.errorCode,
    failure: res.failure,
  }
}

function notSent(size: BoundarySize, mustReject: boolean): SizeResult {
  return {
    labels: size.labels.join('/'),
    promptTokens: size.tokens,
    reportedPromptTokens: null,
    mustReject,
    status: null,
    outcome: 'failed',
    errorCode: null,
    failure: 'budget',
  }
}

/** A 200 whose reported count says our prompt in fact fitted (calibration off by a few tokens)
 *  is no evidence. A count far below the limit is not a sizing error: a server that swapped the
 *  prompt for a placeholder may report the placeholder's length. */
function isMisSized(result: SizeResult, limitTokens: number): boolean {
  const reported = result.reportedPromptTokens
  return reported !== null && reported <= limitTokens && reported >= limitTokens - 4
}

function round3(n: number): number {
  return Math.round(n * 1000) / 1000
}
