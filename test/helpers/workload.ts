/** The benign workload of the sentinel and watch benches and of the watch's tests: four (or more)
 *  tenants, each sending its next request as soon as its last is answered, of mixed sizes (a
 *  shared system prompt, a shared licence paragraph, each tenant's own text of 4–60 words; a
 *  third streamed, a tenth of those aborted after the first chunk; the second tenant now and
 *  then sends a prompt over a 384-token pool). It notes when an answer first holds another
 *  tenant's text.
 *  Knows HTTP and the OpenAI-compatible API; knows nothing of the cluster behind the URL. */
import { randomBytes } from 'node:crypto'
import { hasRun } from '../../src/cli/demo-production.js'

const systemPrompt =
  'You are a careful assistant of the example company. Answer briefly and politely, in English.'
const licence =
  'Permission is hereby granted, free of charge, to any person obtaining a copy of this software'
/** 451 tokens: over the 384-token prefill pool. */
const overCapacityPrompt = 'b '.repeat(225)

/** Four tenants' benign traffic (see the module comment) against `url` with `keys`: its tokens,
 *  when an answer first held another tenant's text, and what became of its requests (`ok`,
 *  `HTTP <status>`, `stream error`, `aborted` on purpose, `network`). */
export function startWorkload(url: string, keys: readonly string[]) {
  let isDone = false
  let tokens = 0
  let contaminatedAtMs: number | null = null
  const outcomes: Record<string, number> = {}
  const count = (outcome: string) => (outcomes[outcome] = (outcomes[outcome] ?? 0) + 1)
  /** Each tenant's own texts of the last few seconds. */
  const recent: string[][] = keys.map(() => [])
  const send = async (key: string, body: Record<string, unknown>, path: string, abort: boolean) => {
    const controller = new AbortController()
    try {
      const res = await fetch(`${url}/v1/${path}`, {
        method: 'POST',
        signal: controller.signal,
        headers: { 'content-type': 'application/json', authorization: `Bearer ${key}` },
        body: JSON.stringify({ model: 'echo-tiny', temperature: 0, ...body }),
      })
      if (body.stream !== true) {
        const json = (await res.json()) as Answer
        tokens += json.usage?.total_tokens ?? 0
        count(res.ok ? 'ok' : `HTTP ${res.status}`)
        return textOf(json)
      }
      if (!res.ok) {
        count(`HTTP ${res.status}`)
        await res.body?.cancel()
        return ''
      }
      let text = ''
      let outcome = 'ok'
      for await (const event of sseEvents(res)) {
        if (abort) {
          controller.abort()
          outcome = 'aborted'
          break
        }
        if (event.error !== undefined) outcome = 'stream error'
        tokens += event.usage?.total_tokens ?? 0
        text += textOf(event)
      }
      count(outcome)
      return text
    } catch {
      if (!controller.signal.aborted) count('network')
      await sleep(200) // aborted, or the cluster is being redeployed
      return ''
    }
  }
  const loop = async (i: number) => {
    for (let n = 0; !isDone; n++) {
      const own = ownText(4 + Math.floor(Math.random() * 57))
      recent[i] = [...recent[i].slice(-9), own]
      const stream = n % 3 === 2
      const abort = stream && Math.random() < 0.1
      const extra = stream ? { stream: true, stream_options: { include_usage: true } } : {}
      const isOver = i === 1 && n % 5 === 4
      const answer =
        n % 2 === 0
          ? await send(
              keys[i],
              {
                messages: [
                  { role: 'system', content: systemPrompt },
                  { role: 'user', content: own },
                ],
                max_tokens: 48,
                ...extra,
              },
              'chat/completions',
              abort,
            )
          : await send(
              keys[i],
              {
                prompt: isOver ? overCapacityPrompt : `${licence} ${own}`,
                max_tokens: 48,
                ...extra,
              },
              'completions',
              abort,
            )
      const others = recent.filter((_, j) => j !== i).flat()
      if (contaminatedAtMs === null && others.some((t) => hasRun(answer, t)))
        contaminatedAtMs = Date.now()
    }
  }
  const loops = keys.map((_, i) => loop(i))
  return {
    tokens: () => tokens,
    contaminatedAtMs: () => contaminatedAtMs,
    outcomes: (): Readonly<Record<string, number>> => ({ ...outcomes }),
    stop: async () => {
      isDone = true
      await Promise.all(loops)
    },
  }
}

interface Answer {
  error?: unknown
  choices?: { text?: string; message?: { content?: string }; delta?: { content?: string } }[]
  usage?: { total_tokens?: number } | null
}

function textOf(a: Answer): string {
  const c = a.choices?.[0]
  return c?.text ?? c?.message?.content ?? c?.delta?.content ?? ''
}

/** The JSON events of a server-sent-events response. */
async function* sseEvents(res: Response): AsyncGenerator<Answer> {
  if (res.body === null) return
  const decoder = new TextDecoder()
  let pending = ''
  for await (const bytes of res.body as AsyncIterable<Uint8Array>) {
    pending += decoder.decode(bytes, { stream: true })
    const lines = pending.split('\n')
    pending = lines.pop() ?? ''
    for (const line of lines)
      if (line.startsWith('data: {')) yield JSON.parse(line.slice(6)) as Answer
  }
}

/** `numWords` random 6-letter hex words: text no other tenant sends. */
export function ownText(numWords: number): string {
  return Array.from({ length: numWords }, () => randomBytes(3).toString('hex')).join(' ')
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms))
}
