/** The streamed answer's per-token work: each chunk is serialized from a template built once per
 *  request, byte for byte what `JSON.stringify` gives, and the SSE headers leave in the same socket
 *  write as the first events (not one write of their own). */
import assert from 'node:assert/strict'
import type { Socket } from 'node:net'
import { test } from 'node:test'
import { chatChunk, sseTemplate, textCompletion } from '../../../src/router/api/responses.js'
import { startHarness } from '../helpers.js'

const header = { id: 'cmpl-1', created: 1_700_000_000, model: 'echo-test' }

test('sseTemplate gives exactly the event JSON.stringify gives, for any text', () => {
  const texts = ['', 'a', ' quote " and \\ backslash', 'line\nbreak\u2028\u0000', '🙂 東京', '"}]']
  const completion = sseTemplate((text) => textCompletion(header, text, null, undefined, null))
  const chat = sseTemplate((text) => chatChunk(header, { content: text }, null, true, null))
  for (const text of texts) {
    assert.equal(
      completion(text),
      `data: ${JSON.stringify(textCompletion(header, text, null, undefined, null))}\n\n`,
    )
    assert.equal(
      chat(text),
      `data: ${JSON.stringify(chatChunk(header, { content: text }, null, true, null))}\n\n`,
    )
  }
})

test('a streamed answer: the headers and the first events leave in one socket write', async () => {
  const h = await startHarness()
  try {
    const writes: string[] = []
    h.router.server.on('connection', (socket: Socket) => {
      const s = socket as Socket & Record<'_write' | '_writev', (...args: unknown[]) => void>
      const write = s._write.bind(s)
      const writev = s._writev.bind(s)
      s._write = (chunk: unknown, ...rest: unknown[]) => {
        writes.push(String(chunk))
        write(chunk, ...rest)
      }
      s._writev = (...args: unknown[]) => {
        writes.push((args[0] as { chunk: unknown }[]).map((c) => String(c.chunk)).join(''))
        writev(...args)
      }
    })
    const stream = await h.client().completions.create({
      model: 'echo-test',
      prompt: 'Hi',
      stream: true,
    })
    for await (const chunk of stream) assert.equal(chunk.object, 'text_completion')
    assert.match(writes[0], /^HTTP\/1\.1 200 OK\r\n[^]*\r\n\r\n[0-9a-f]+\r\ndata: \{/)
  } finally {
    await h.close()
  }
})
