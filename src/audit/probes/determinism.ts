/** Probe `determinism`: the same temperature-0 prompt, twice alone and twice while other
 *  requests run beside it. Outputs that change with load are not a leak by themselves (batch
 *  composition changes floating-point reduction order in most engines), but they make A/B
 *  comparisons and reproductions unreliable, and an output that changes only under load deserves
 *  a look: a warning at most. The load is other requests' material (canaries, planted per
 *  request), and every answer, the subject's and the load's, is checked for another request's:
 *  one found is a leak (`content-leak`), as in the concurrency probe. */
import { runUntilExhausted, type Budget } from '../budget.js'
import type { Probe } from '../probe.js'
import { inconclusiveRemediation } from '../probe.js'
import { createRng } from '../rng.js'
import { isAnsweredWhole, type CompletionResult, type Target } from '../target.js'
import type { Finding } from '../types.js'
import {
  crossingRemediation,
  findCrossings,
  leakFindings,
  plantMaterial,
  requestLog,
  type Observed,
  type Planted,
} from './material.js'

const maxTokens = 32
const numAlone = 2
const numUnderLoad = 2
/** Tokens of a prompt cut to 120 characters, at most (about two characters a token). */
const shortPromptTokens = 60

const advice =
  'Not a leak by itself. For reproducible temperature-0 output run the engine in a ' +
  'batch-invariant mode (SGLang --enable-deterministic-inference, vLLM VLLM_BATCH_INVARIANT=1) ' +
  'or compare outputs only at equal load; if outputs change in ways other than small wording ' +
  "differences, look at the canary and concurrency probes' results."

export const determinismProbe: Probe = {
  name: 'determinism',
  description:
    'one temperature-0 prompt twice alone and twice beside other requests; output that changes with load is a warning with advice; another request’s canary in any answer is a leak',
  class: 'integrity',
  controls: { aisvs: [], guards: [] },
  plan: ({ limits }) => [
    // Each of the subject's requests is asked once more after a 429 or 503.
    {
      what: 'the same prompt, alone and under load',
      numRequests: 2 * (numAlone + numUnderLoad),
      tokensEach: shortPromptTokens + maxTokens,
    },
    {
      what: 'load beside it',
      numRequests: numUnderLoad * Math.max(1, limits.concurrency - 1),
      tokensEach: shortPromptTokens + 64,
    },
  ],
  async run(target, budget, context): Promise<Finding[]> {
    const rng = createRng(context.seed, 'determinism')
    const [subject, ...load] = plantMaterial(
      rng,
      target.tenants,
      Array.from(
        { length: 1 + numUnderLoad * Math.max(1, budget.limits.concurrency - 1) },
        (_, i) => `d${i}`,
      ),
    )
    const { alone, loaded, observed, stoppedBy } = await send(target, budget, subject, load)
    const accepted = (rs: CompletionResult[]) => rs.filter(isAnsweredWhole)
    const okAlone = accepted(alone)
    const okLoaded = accepted(loaded)
    const reference = okAlone[0]?.text
    const numDistinctAlone = new Set(okAlone.map((r) => r.text)).size
    const numDifferUnderLoad = okLoaded.filter((r) => r.text !== reference).length
    // Only counts and positions are kept: outputs stay out of the report.
    const evidence = {
      numAlone: okAlone.length,
      numUnderLoad: okLoaded.length,
      numDistinctAlone,
      numDifferUnderLoad,
      firstDifferenceAt: okLoaded
        .filter((r) => r.text !== reference)
        .map((r) => firstDifference(r.text, reference ?? '')),
      stoppedBy,
    }
    context.log(`alone: ${numDistinctAlone} distinct; under load: ${numDifferUnderLoad} differ`)
    const planted = [subject, ...load].map(short)
    const crossings = findCrossings(observed, planted)
    if (crossings.length > 0) {
      const summary = { ...evidence, requests: requestLog(observed) }
      return leakFindings('determinism', crossings, planted, summary, crossingRemediation)
    }
    if (okAlone.length < 2 || okLoaded.length === 0) {
      return [
        {
          probe: 'determinism',
          verdict: 'inconclusive',
          severity: 'low',
          title: 'too few answers to compare outputs alone and under load',
          evidence,
          remediation: inconclusiveRemediation,
        },
      ]
    }
    if (numDistinctAlone > 1 || numDifferUnderLoad > 0) {
      return [
        {
          probe: 'determinism',
          verdict: 'warning',
          severity: 'low',
          title:
            numDistinctAlone > 1
              ? 'temperature-0 output differs even between identical requests sent alone'
              : `temperature-0 output changed under load (${numDifferUnderLoad} of ${okLoaded.length})`,
          evidence,
          remediation: advice,
        },
      ]
    }
    return [
      {
        probe: 'determinism',
        verdict: 'clean',
        severity: 'info',
        title: `temperature-0 output identical alone and under load (${okAlone.length + okLoaded.length} answers)`,
        evidence,
        remediation: 'None needed.',
      },
    ]
  },
}

/** Index of the first character where `a` and `b` differ. */
function firstDifference(a: string, b: string): number {
  let i = 0
  while (i < a.length && i < b.length && a[i] === b[i]) i++
  return i
}

/** Short prompts, so that a small KV pool holds several at once and the server does not shed
 *  the load (a 503 compares nothing). */
function short(p: Planted): Planted {
  return { ...p, prompt: p.prompt.slice(0, p.prompt.lastIndexOf(' ', 120)) }
}

/** The subject alone, then beside the load, round by round; every answer observed with the
 *  (short) material it was sent with. */
async function send(
  target: Target,
  budget: Budget,
  subject: Planted,
  load: readonly Planted[],
): Promise<{
  alone: CompletionResult[]
  loaded: CompletionResult[]
  observed: Observed[]
  stoppedBy: string | null
}> {
  const tenant = target.tenants[0]
  const observed: Observed[] = []
  const sent = (p: Planted, label: string, stream: boolean, result: CompletionResult) => {
    observed.push({ planted: short(p), label, stream, result })
    return result
  }
  const ask = async (label: string): Promise<CompletionResult> => {
    const once = async () =>
      sent(
        subject,
        label,
        false,
        await target.complete({
          tenant,
          prompt: short(subject).prompt,
          maxTokens,
          stream: false,
        }),
      )
    const first = await once()
    if (first.status !== 429 && first.status !== 503) return first
    await new Promise((r) => setTimeout(r, 200))
    return once()
  }
  const alone: CompletionResult[] = []
  const loaded: CompletionResult[] = []
  const stoppedBy = await runUntilExhausted(async () => {
    for (let i = 0; i < numAlone; i++) alone.push(await ask('alone'))
    const perRound = Math.max(1, budget.limits.concurrency - 1)
    for (let r = 0; r < numUnderLoad; r++) {
      const others = load.slice(r * perRound, (r + 1) * perRound).map(async (p) =>
        sent(
          p,
          'load beside it, streamed',
          true,
          await target.complete({
            tenant: p.tenant,
            prompt: short(p).prompt,
            maxTokens: 64,
            stream: true,
          }),
        ),
      )
      const [mine] = await Promise.all([ask('under load'), ...others])
      loaded.push(mine)
    }
  })
  return { alone, loaded, observed, stoppedBy }
}
