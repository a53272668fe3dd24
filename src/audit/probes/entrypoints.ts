/** Probe `entrypoints`: the canary and cache-isolation checks on every generation entrypoint the
 *  target serves, and across them. Public reports show the tenant's cache salt dropped on
 *  entrypoints other than completions and chat: Anthropic-style `/v1/messages` (vllm#46688),
 *  Responses tool-call continuations (vLLM PR #51818), native routes and text modes.
 *  1. Discovery: one tiny request (a 3-word prompt, 1 token) per entrypoint of
 *     entrypoint-shapes.ts; an answer of the entrypoint's shape means served, anything else
 *     (404, 405, a refusal) not served. Nothing heavy is ever sent.
 *  2. Trials (entrypoint-trials.ts) on each served path and from the first served one (the hub)
 *     to each other: A primes a fresh prefix of filler words (at most 300 characters, fewer where the limits the endpoint reports are small) plus canaries of its own
 *     on one path, B sends the same prefix with its own canaries on another (or the same) path,
 *     then A does the same as B (the positive control: A's own reuse shows).
 *  3. The Responses tool-call round trip (entrypoint-tools.ts) where Responses is served.
 *  Every answer asks for at most {@link answerMaxTokens} tokens. Everything A and B send beside
 *  the shared filler is their own canaries, so any material crossing is named. */
import { makeCanaries, plantingPrompt } from '../canaries.js'
import { runUntilExhausted } from '../budget.js'
import { materialPromptTokens, type PlannedRequests } from '../plan.js'
import type { Discovery } from '../discovery.js'
import { aisvsKvPartitioning, inconclusiveRemediation, type Probe } from '../probe.js'
import { createRng, type Rng } from '../rng.js'
import type { Target } from '../target.js'
import type { Finding, Tenant } from '../types.js'
import {
  entrypointNames,
  entrypoints,
  parseEntrypointAnswer,
  type EntrypointAnswer,
  streamedEntrypoints,
  type EntrypointName,
} from './entrypoint-shapes.js'
import { runToolArm, toolPath, toolSender, type ToolArm } from './entrypoint-tools.js'
import { judgePath, type Canaries, type Exchange, type Trial } from './entrypoint-trials.js'

/** Tokens an answer may have: enough for a canary to show, never a long generation. */
export const answerMaxTokens = 8
/** The discovery request's prompt (answered with one token). */
export const discoveryPrompt = 'Say hello briefly.'
/** Largest answer body read: 8 tokens of any shape, streamed or not, fit many times over. */
const maxAnswerBytes = 256 * 1024

/** One row of the discovery table. */
export interface EntrypointStatus {
  readonly entrypoint: EntrypointName
  readonly endpoint: string
  readonly status: number | null
  readonly isServed: boolean
  /** Whether its answer reports cached prompt tokens (null: not served). */
  readonly isCacheReported: boolean | null
}

/** Trials: (primed on, sent on): on each served path, then from the first served one (the hub)
 *  to each other. A path that drops the salt is found by its same-path trial (its entries are
 *  everybody's there); the cross-path ones find a cache that answers one path from another. */
export function planTrials(served: readonly EntrypointName[]): [EntrypointName, EntrypointName][] {
  const [hub, ...rest] = served
  if (hub === undefined) return []
  return [
    ...served.map((e): [EntrypointName, EntrypointName] => [e, e]),
    ...rest.map((e): [EntrypointName, EntrypointName] => [hub, e]),
  ]
}

const requestsPerTrial = 3
const toolRequests = 4

function planRequests(): PlannedRequests[] {
  const n = entrypointNames.length
  const prompt = materialPromptTokens + tailAndTemplateTokens / 2
  return [
    { what: 'discovery: a 3-word prompt per entrypoint', numRequests: n, tokensEach: 8 },
    {
      what: 'trials: primes, controls and tests on every served entrypoint and across them',
      numRequests: requestsPerTrial * planTrials([...entrypointNames]).length,
      tokensEach: prompt + answerMaxTokens,
    },
    {
      what: 'Responses tool-call round trip',
      numRequests: toolRequests,
      tokensEach: prompt + 80 + answerMaxTokens,
    },
  ]
}

/** Asks every entrypoint for one token of a 3-word prompt, as tenant A. */
export async function discoverEntrypoints(
  target: Target,
  tenant: Tenant,
): Promise<EntrypointStatus[]> {
  const out: EntrypointStatus[] = []
  for (const name of entrypointNames) {
    const answer = await sendTo(target, tenant, name, discoveryPrompt, 1, 'discovery')
    out.push({
      entrypoint: name,
      endpoint: `POST ${entrypoints[name].path}${name in streamedEntrypoints ? ' (stream)' : ''}`,
      status: answer.status,
      isServed: answer.isAnswered,
      isCacheReported: answer.isAnswered ? answer.cachedTokens !== null : null,
    })
  }
  return out
}

async function sendTo(
  target: Target,
  tenant: Tenant,
  name: EntrypointName,
  prompt: string,
  maxTokens: number,
  requestId: string,
): Promise<EntrypointAnswer> {
  const { path, body } = entrypoints[name]
  const http = await target.postGeneration(
    path,
    body(prompt, maxTokens, target.model, requestId),
    // Discovery asks whether the entrypoint is served: a 404 is an answer there.
    {
      tenant,
      maxBodyBytes: maxAnswerBytes,
      isValid: requestId !== 'discovery',
      prompt,
      maxTokens,
      stream: name in streamedEntrypoints,
      promptTokensOf: (h) => parseEntrypointAnswer(name, h).promptTokens,
    },
    (h) => parseEntrypointAnswer(name, h).isAnswered,
  )
  return parseEntrypointAnswer(name, http)
}

/** Longest shared prefix (characters of filler words): long enough to span several 16-token
 *  pages, short enough that prefix, tail and a chat template fit the smallest limit the endpoint
 *  reports, counting a token per character (the worst case: the bundled model's tokenizer), and
 *  that a trial's three prompts fit the KV pool together with room to spare (on a small pool the
 *  second tenant's prompt would otherwise evict the prime before the control reads it). */
export function prefixChars(
  discovery: Pick<Discovery, 'contextTokens' | 'inputLimitTokens' | 'poolTokens'>,
): number {
  const limits = [discovery.contextTokens, discovery.inputLimitTokens]
    .filter((n): n is number => n !== null)
    .map((n) => n - answerMaxTokens - tailAndTemplateTokens)
  if (discovery.poolTokens !== null)
    limits.push(Math.floor(discovery.poolTokens / 4) - tailAndTemplateTokens / 2)
  return Math.max(48, Math.min(maxPrefixChars, ...limits))
}
const maxPrefixChars = 300
/** Two canaries (at most 49 characters) and a chat template's own tokens. */
export const tailAndTemplateTokens = 100

/** Draws the probe's material: fresh prefixes of filler words (at most `maxChars` characters),
 *  canary tails per tenant (two canaries each, recorded in `taken`). */
export function materialDrawer(rng: Rng, taken: { A: string[]; B: string[] }, maxChars: number) {
  return {
    prefix: () => {
      const words = `${plantingPrompt(rng, [])} ${plantingPrompt(rng, [])}`.split(' ')
      let out = words[0]
      for (const word of words.slice(1)) {
        if (out.length + 1 + word.length > maxChars) break
        out += ` ${word}`
      }
      return out
    },
    tail: (who: 'A' | 'B') => {
      const canaries = makeCanaries(rng, 2, [...taken.A, ...taken.B])
      taken[who].push(...canaries)
      return canaries.join(' ')
    },
  }
}

/** Runs the trials in order, three requests each (A primes, B tests, A's control), into
 *  `trials` and `exchanges` (so a budget cut keeps what ran). */
export async function runTrials(
  target: Target,
  plan: readonly [EntrypointName, EntrypointName][],
  draw: ReturnType<typeof materialDrawer>,
  trials: Trial[],
  exchanges: Exchange[],
): Promise<void> {
  const [a, b] = target.tenants
  let numSent = 0
  const send = async (who: 'A' | 'B', path: EntrypointName, prompt: string) => {
    const answer = await sendTo(
      target,
      who === 'A' ? a : b,
      path,
      prompt,
      answerMaxTokens,
      `audit-${who}-${++numSent}`,
    )
    exchanges.push({ tenant: who, path, prompt, answer })
    return answer
  }
  for (const [primedOn, path] of plan) {
    const prefix = draw.prefix()
    await send('A', primedOn, `${prefix} ${draw.tail('A')}`)
    const test = await send('B', path, `${prefix} ${draw.tail('B')}`)
    const control = await send('A', path, `${prefix} ${draw.tail('A')}`)
    trials.push({ primedOn, path, control, test })
  }
}

export const entrypointsProbe: Probe = {
  name: 'entrypoints',
  description:
    'finds which generation entrypoints are served (completions, chat, Responses, /v1/messages and /generate, each streamed or not, /completion); on each and across them tenant A primes a prefix and tenant B sends it: A canaries in B answers are a leak, B served A cached prefix a side channel; and a Responses tool-call round trip',
  class: 'content-leak',
  // kvfence derives one salt from the tenant for completions, chat and Responses alike: a design
  // property, not one of the numbered guards.
  controls: { aisvs: [aisvsKvPartitioning], guards: [] },
  plan: () => planRequests(),
  async run(target, _budget, context): Promise<Finding[]> {
    const rng = createRng(context.seed, 'entrypoints')
    const taken = { A: [] as string[], B: [] as string[] }
    const draw = materialDrawer(rng, taken, prefixChars(context.discovery))
    let table: EntrypointStatus[] = []
    const trials: Trial[] = []
    const exchanges: Exchange[] = []
    const arm: { tools: ToolArm | null } = { tools: null }
    const stoppedBy = await runUntilExhausted(async () => {
      table = await discoverEntrypoints(target, target.tenants[0])
      const served = table.filter((r) => r.isServed).map((r) => r.entrypoint)
      context.log(
        `entrypoints served: ${served.join(', ') || 'none'}; not served: ${table
          .filter((r) => !r.isServed)
          .map((r) => `${r.entrypoint} (${r.status ?? 'no answer'})`)
          .join(', ')}`,
      )
      await runTrials(target, planTrials(served), draw, trials, exchanges)
      if (served.includes('responses'))
        arm.tools = await runToolArm(
          target,
          toolSender(target, maxAnswerBytes),
          rng,
          draw.prefix(),
          taken,
          answerMaxTokens,
        )
    })
    const names = { A: target.tenants[0].name, B: target.tenants[1].name }
    return judgeAll(table, trials, exchanges, arm.tools, { ...taken, names }, stoppedBy)
  },
}

/** One or more findings per served entrypoint and for the tool arm; inconclusive when nothing
 *  was served or the budget cut the probe before a path's trials. */
function judgeAll(
  table: readonly EntrypointStatus[],
  trials: readonly Trial[],
  exchanges: readonly Exchange[],
  tools: ToolArm | null,
  canaries: Canaries,
  stoppedBy: string | null,
): Finding[] {
  const served: Record<string, unknown>[] = table.map((r) => ({ ...r }))
  if (tools?.kind === 'not-served')
    served.push({
      entrypoint: toolPath,
      endpoint: 'POST /v1/responses with tools',
      status: tools.status,
      isServed: false,
      isCacheReported: null,
    })
  const allTrials = [...trials, ...(tools?.kind === 'run' ? tools.trials : [])]
  const allExchanges = [...exchanges, ...(tools?.kind === 'run' ? tools.exchanges : [])]
  const paths: { path: string; endpoint: string }[] = table
    .filter((r) => r.isServed)
    .map((r) => ({ path: r.entrypoint, endpoint: r.endpoint }))
  if (tools?.kind === 'run')
    paths.push({ path: toolPath, endpoint: 'POST /v1/responses (tool-call continuation)' })
  const findings = paths.flatMap(({ path, endpoint }) =>
    judgePath(
      path,
      endpoint,
      allTrials.filter((t) => t.path === path),
      allExchanges,
      canaries,
      served,
    ),
  )
  // A refusal (4xx) of the first tool request says tools are not served; a failure says nothing.
  if (tools?.kind === 'not-served' && (tools.status === null || tools.status >= 500))
    findings.push({
      probe: 'entrypoints',
      verdict: 'inconclusive',
      class: 'side-channel',
      severity: 'medium',
      title: `POST /v1/responses (tool-call continuation): not exercised: the first request with a tool failed (${tools.status ?? 'no answer'})`,
      evidence: { endpoint: 'POST /v1/responses (tool-call continuation)', entrypoints: served },
      remediation: inconclusiveRemediation,
    })
  if (findings.length > 0 && stoppedBy === null) return findings
  const why =
    stoppedBy ?? 'no generation entrypoint answered a 3-word prompt (every one refused or failed)'
  return [
    ...findings,
    {
      probe: 'entrypoints',
      verdict: 'inconclusive',
      severity: 'medium',
      title: `entrypoints not all exercised: ${why}`,
      evidence: { entrypoints: served, stoppedBy },
      remediation:
        'Re-run with a larger budget (--max-requests, --max-seconds) and keys both tenants may use on every entrypoint.',
    },
  ]
}
