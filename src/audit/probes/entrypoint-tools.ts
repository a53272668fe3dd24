/** The Responses tool-call round trip of the `entrypoints` probe: tenant A asks with a function
 *  tool, continues with a `function_call_output` (by `previous_response_id` where the first
 *  answer has an id, else with the whole conversation), then sends the whole conversation again
 *  (the positive control: its own continuation reused); tenant B sends a whole conversation of its
 *  own that starts with the same prefix and was never primed by B. B served cached tokens of it
 *  is a side channel (the continuation drops the tenant's salt: vLLM PR #51818); A's canaries in
 *  B's answer, a leak. A 4xx to the first request means tools are not accepted: the arm is not
 *  served, and says so. Knows the Responses shapes for tools; sends through the target. */
import { makeCanaries } from '../canaries.js'
import type { Rng } from '../rng.js'
import type { Target } from '../target.js'
import type { Tenant } from '../types.js'
import { parseEntrypointAnswer, type EntrypointAnswer } from './entrypoint-shapes.js'
import type { Exchange, Trial } from './entrypoint-trials.js'

export const toolPath = 'responses-tools'
const tool = {
  type: 'function',
  name: 'lookup_record',
  description: 'Looks a record up by its id.',
  parameters: {
    type: 'object',
    properties: { id: { type: 'string' } },
    required: ['id'],
  },
}

/** What the round trip gave: trials and exchanges to judge, or why it was not run. */
export type ToolArm =
  | { readonly kind: 'run'; readonly trials: Trial[]; readonly exchanges: Exchange[] }
  | { readonly kind: 'not-served'; readonly status: number | null }

/** Runs the round trip; `prefix` is fresh, `taken` the canaries drawn so far (extended). */
export async function runToolArm(
  target: Target,
  send: (tenant: Tenant, body: unknown) => Promise<EntrypointAnswer>,
  rng: Rng,
  prefix: string,
  taken: { A: string[]; B: string[] },
  maxTokens: number,
): Promise<ToolArm> {
  const [a, b] = target.tenants
  const draw = (who: 'A' | 'B') => {
    const c = makeCanaries(rng, 2, [...taken.A, ...taken.B])
    taken[who].push(...c)
    return c.join(' ')
  }
  const aUser = `${prefix} ${draw('A')}`
  const common = { ...(target.model === null ? {} : { model: target.model }), tools: [tool] }
  const base = { ...common, max_output_tokens: maxTokens, temperature: 0 }
  const first = await send(a, { ...base, input: aUser, tool_choice: 'auto' })
  if (!first.isAnswered) return { kind: 'not-served', status: first.status }
  const call = first.functionCalls[0] ?? {
    callId: `call_${makeCanaries(rng, 1)[0]}`,
    name: tool.name,
    arguments: '{"id":"1"}',
  }
  const aOutput = draw('A')
  const conversation = (user: string, callId: string, output: string) => [
    { role: 'user', content: user },
    { type: 'function_call', call_id: callId, name: call.name, arguments: call.arguments },
    { type: 'function_call_output', call_id: callId, output },
  ]
  const exchanges: Exchange[] = [{ tenant: 'A', path: toolPath, prompt: aUser, answer: first }]
  const byId = first.functionCalls.length > 0 && first.responseId !== null
  const continued = await send(a, {
    ...base,
    ...(byId
      ? {
          previous_response_id: first.responseId,
          input: [{ type: 'function_call_output', call_id: call.callId, output: aOutput }],
        }
      : { input: conversation(aUser, call.callId, aOutput) }),
  })
  const control = await send(a, { ...base, input: conversation(aUser, call.callId, aOutput) })
  const bUser = `${prefix} ${draw('B')}`
  const bCall = `call_${makeCanaries(rng, 1)[0]}`
  const test = await send(b, { ...base, input: conversation(bUser, bCall, draw('B')) })
  exchanges.push(
    { tenant: 'A', path: toolPath, prompt: aOutput, answer: continued },
    { tenant: 'A', path: toolPath, prompt: aUser, answer: control },
    { tenant: 'B', path: toolPath, prompt: bUser, answer: test },
  )
  return { kind: 'run', trials: [{ primedOn: toolPath, path: toolPath, control, test }], exchanges }
}

/** Sends a Responses body for the tool arm and reads its answer. */
export function toolSender(
  target: Target,
  maxBodyBytes: number,
): (tenant: Tenant, body: unknown) => Promise<EntrypointAnswer> {
  return async (tenant, body) => {
    const http = await target.postGeneration(
      '/v1/responses',
      body,
      { tenant, maxBodyBytes },
      (h) => parseEntrypointAnswer('responses', h).isAnswered,
    )
    return parseEntrypointAnswer('responses', http)
  }
}
