/** A reply from an upstream read whole, bounded: a worker's (the router's probes) or another
 *  engine's (the gateway). Knows a readable stream of bytes; knows nothing of what it holds. */
import type { IncomingMessage } from 'node:http'

/** Reads a reply from an upstream (a worker or the gateway's engine) as UTF-8 text. Throws a plain
 *  Error "reply longer than `maxBytes` bytes" (after destroying the reply) past `maxBytes`, so
 *  that a runaway upstream cannot fill the router's memory. */
export async function readReplyText(res: IncomingMessage, maxBytes: number): Promise<string> {
  const chunks: Buffer[] = []
  let numBytes = 0
  for await (const chunk of res as AsyncIterable<Buffer>) {
    numBytes += chunk.length
    if (numBytes > maxBytes) {
      res.destroy()
      throw new Error(`reply longer than ${maxBytes} bytes`)
    }
    chunks.push(chunk)
  }
  return Buffer.concat(chunks).toString('utf8')
}
